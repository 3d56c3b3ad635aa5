"""Several pools in one process: each subscription keeps its own bound."""

from __future__ import annotations

import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

from tests.support import wait_for
from workerpool import JobContext
from workerpool.assembly.fleet import Fleet
from workerpool.config import Settings
from workerpool.periodic import parse_schedules
from workerpool.registry import Registry
from workerpool.testing.pubsub import PubSubResources


def test_a_flood_on_one_subscription_does_not_delay_the_other(
    pubsub_resources: PubSubResources,
) -> None:
    # Given two subscriptions, heavy (bound 2) flooded with 200 jobs, light (bound 4)
    heavy, light = (
        pubsub_resources,
        PubSubResources(pubsub_resources.project, pubsub_resources.host),
    )
    heavy.provision()
    light.provision()
    jobs, lock = Registry(), threading.Lock()
    running: dict[str, int] = defaultdict(int)
    peak: dict[str, int] = defaultdict(int)
    started: dict[str, float] = {}

    def track(kind: str, ctx: JobContext, seconds: float) -> None:
        with lock:
            running[kind] += 1
            peak[kind] = max(peak[kind], running[kind])
            started[ctx.job_id] = time.monotonic()
        time.sleep(seconds)
        with lock:
            running[kind] -= 1

    @jobs.job("t.heavy")
    def heavy_job(ctx: JobContext, payload: dict[str, Any]) -> None:
        track("heavy", ctx, 0.5)

    @jobs.job("t.light")
    def light_job(ctx: JobContext, payload: dict[str, Any]) -> None:
        track("light", ctx, 0.05)

    heavy.publish_many("t.heavy", [(f"h-{i}", {}) for i in range(200)])
    settings = Settings(
        project=pubsub_resources.project,
        idempotency_store="memory://",
        pools=(
            {"subscription": heavy.subscription, "max_outstanding": 2},
            {"subscription": light.subscription, "max_outstanding": 4},
        ),
    )
    fleet = Fleet(settings, jobs=jobs).start()
    try:
        assert wait_for(lambda: peak["heavy"] == 2, timeout=30)
        # When light jobs arrive behind the flood
        published = time.monotonic()
        light.publish_many("t.light", [(f"l-{uuid.uuid4().hex[:6]}", {}) for _ in range(12)])
        assert wait_for(lambda: sum(1 for k in started if k.startswith("l-")) == 12, timeout=30)
        waits = sorted(t - published for k, t in started.items() if k.startswith("l-"))
        heavy_left = 200 - sum(1 for k in started if k.startswith("h-"))
    finally:
        fleet.stop(time.monotonic() + 5)
        light.close()
    # Then they all started while the heavy backlog was still there, each pool in its bound
    print(f"light job waits {waits[0]:.2f}..{waits[-1]:.2f}s; heavy still queued: {heavy_left}")
    assert heavy_left > 150
    assert peak["heavy"] == 2 and peak["light"] <= 4
    # 12 jobs of 0.05 s in 4 slots need ~0.15 s of work: far less than one heavy job's turn
    assert waits[-1] < 0.5 * heavy_left / 2


def test_each_pool_fires_the_periodic_schedules_that_name_it(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given two pools on two topics, a schedule of the first and one naming the second
    first, second = (
        pubsub_resources,
        PubSubResources(pubsub_resources.project, pubsub_resources.host),
    )
    first.provision()
    second.provision()
    jobs, ran = Registry(), []

    @jobs.job("t.tick")
    def tick(ctx: JobContext, payload: dict[str, Any]) -> None:
        ran.append(ctx.job_id)

    schedules = parse_schedules([
        {"name": "first", "job": "t.tick", "every": "1s"},
        {"name": "second", "job": "t.tick", "every": "1s", "pool": second.subscription},
    ], "test")  # fmt: skip
    settings = Settings(
        project=pubsub_resources.project,
        idempotency_store=f"sqlite:///{tmp_path / 'fleet.db'}",
        pools=({"subscription": first.subscription}, {"subscription": second.subscription}),
        schedules=schedules,
    ).validate()
    # When the fleet runs
    fleet = Fleet(settings, jobs=jobs).start()
    try:
        done = [launcher.processor.stats for launcher in fleet.launchers]
        assert wait_for(lambda: min(stats["done"] for stats in done) >= 3, timeout=30), done
    finally:
        fleet.stop(time.monotonic() + 5)
        second.close()
    # Then each pool ran the ticks of its own schedule, published to its topic
    names = {job_id.split(":")[1] for job_id in ran}
    assert names == {"first", "second"} and len(ran) == len(set(ran))
