"""Bounded concurrency on the real emulator."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support import wait_for
from workerpool import JobContext
from workerpool.assembly.launcher import Launcher, Phase
from workerpool.registry import Registry
from workerpool.testing.pubsub import PubSubResources
from workerpool.worker.limits import DrainReport


class Tracker:
    """Records each run's start and end, and the highest number running at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.peak = 0
        self.intervals: list[tuple[float, float]] = []
        self.done: list[str] = []

    def run(self, ctx: JobContext, seconds: float) -> None:
        start = time.monotonic()
        with self.lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
        time.sleep(seconds)
        with self.lock:
            self.running -= 1
            self.intervals.append((start, time.monotonic()))
            self.done.append(ctx.job_id)


def peak_from_intervals(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


@pytest.mark.parametrize("n", [1, 8])
def test_running_handlers_never_exceed_and_reach_n(
    pubsub_resources: PubSubResources, n: int
) -> None:
    # Given a backlog of 10 x N short jobs
    pubsub_resources.provision()
    jobs, tracker = Registry(), Tracker()

    @jobs.job("t.short")
    def short(ctx: JobContext, payload: dict[str, Any]) -> None:
        tracker.run(ctx, 0.05)

    total = 10 * n
    pubsub_resources.publish_many("t.short", [(f"job-{i}", {}) for i in range(total)])
    # When a worker with max_outstanding=N drains it
    with pubsub_resources.worker(jobs, max_outstanding=n) as worker:
        assert wait_for(lambda: len(tracker.done) >= total, timeout=60)
        held_peak = worker.pool.limits.max_held
    # Then the peak of simultaneous handlers is exactly N, by counter and by timestamps
    assert tracker.peak == n
    assert peak_from_intervals(tracker.intervals) == n
    assert sorted(tracker.done) == sorted(f"job-{i}" for i in range(total))
    assert held_peak == n + 2


def test_a_launcher_stopped_twice_closes_everything_it_opened_once(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given a started launcher with the SQLite store (its threads: slots, pull loop, acks,
    # leases, timers, claims)
    pubsub_resources.provision()
    before = {t.name for t in threading.enumerate()}
    settings = pubsub_resources.settings(idempotency_store=f"sqlite:///{tmp_path / 'claims.db'}")
    launcher = Launcher(settings, jobs=Registry()).start()
    assert launcher.phase is Phase.RUNNING
    assert {t.name for t in threading.enumerate()} - before
    # When it is stopped twice
    first = launcher.stop(time.monotonic() + 5)
    second = launcher.stop(time.monotonic() + 5)
    # Then the second stop does nothing, and every thread it started has ended
    assert second == DrainReport(0, 0, 0, 0.0) and first.interrupted == 0
    assert wait_for(lambda: {t.name for t in threading.enumerate()} <= before, timeout=5), {
        t.name for t in threading.enumerate()
    } - before
