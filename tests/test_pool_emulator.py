"""Bounded concurrency on the real emulator."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support import wait_for
from workerpool import JobContext, PermanentError
from workerpool.assembly.launcher import Launcher, Phase
from workerpool.registry import Registry
from workerpool.testing.pubsub import PubSubResources
from workerpool.worker.acks import ACK_WINDOW, ORDERED_ACK_WINDOW
from workerpool.worker.delivery import Delivery
from workerpool.worker.limits import DrainReport
from workerpool.worker.middleware import Middleware


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


@pytest.mark.parametrize(
    ("ordered", "window"), [(True, ORDERED_ACK_WINDOW), (False, ACK_WINDOW)],
    ids=["ordered", "unordered"],
)  # fmt: skip
def test_a_launcher_batches_acks_for_as_long_as_its_subscriptions_kind_allows(
    pubsub_resources: PubSubResources, tmp_path: Path, ordered: bool, window: float
) -> None:
    # Given a subscription with message ordering, or one without
    pubsub_resources.provision(ordered=ordered)
    settings = pubsub_resources.settings(idempotency_store=f"sqlite:///{tmp_path / 'claims.db'}")
    # When a launcher starts on it
    launcher = Launcher(settings, jobs=Registry()).start()
    try:
        # Then an ack waits for others to share its request 50 ms, or 10 ms where Pub/Sub may
        # hold a key's later messages until those before are acked
        assert launcher._parts is not None
        assert launcher._parts.acks.ack_window == window
    finally:
        launcher.stop(time.monotonic() + 5)


class _SlowToHear(Middleware):
    """Hears that a message was dead-lettered slowly, as a batch's ledger write on a slow
    store."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.hearing = threading.Event()
        self.heard: list[str] = []

    def dead_lettered(self, delivery: Delivery, job_id: str) -> None:
        self.hearing.set()
        time.sleep(self.seconds)
        self.heard.append(job_id)


def test_a_drain_that_ends_while_a_dead_letter_is_heard_still_acks_it(
    pubsub_resources: PubSubResources,
) -> None:
    # Given a launcher of one slot and no prefetch (no pull in flight while it runs a job),
    # whose middleware takes 0.2 s to hear that a message was dead-lettered (longer than the
    # end of a drain gives a failure record still being published), and a job that always
    # fails
    pubsub_resources.provision(retry_policy=False, ack_deadline=10)
    jobs = Registry()

    @jobs.job("t.bad")
    def bad(ctx: JobContext, payload: Any) -> None:
        raise PermanentError("never")

    hearing = _SlowToHear(0.2)
    settings = pubsub_resources.settings(lease_extension=10.0, max_outstanding=1, prefetch=0)
    launcher = Launcher(settings, jobs=jobs, middleware=[hearing]).start()
    pubsub_resources.publish("t.bad", {}, job_id="j1")
    assert hearing.hearing.wait(30)
    # When the drain's deadline passes just then
    launcher.stop(time.monotonic())
    # Then the middleware heard it to the end, and its ack went out before the acks were
    # flushed: one failure record, and the message never comes back (its lease was 10 s)
    assert hearing.heard == ["j1"]
    assert len(pubsub_resources.dead_letters(expected=1, timeout=5)) == 1
    time.sleep(11)
    back = pubsub_resources.subscriber.pull(
        request={"subscription": pubsub_resources.subscription_path, "max_messages": 10},
        timeout=5,
    )
    assert list(back.received_messages) == []
