"""Bursts of due ticks, in process: a worker publishes the ticks due at one instant all at
once and records them published in one transaction; one that dies before recording them
leaves them to another, and each job still runs once (a fake publisher; the bench and the
emulator tests run real workers)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path
from zoneinfo import ZoneInfo

from tests.support import wait_for
from workerpool.idempotency import Claimed, Done, MemoryStore
from workerpool.periodic import Marks, Periodic, SqliteMarks, Ticks
from workerpool.periodic.firing import Periodics
from workerpool.stores import StoreError

NOW = 1_800_000_000.0  # on the hour
SCHEDULES = 300


class Gated:
    """A publisher whose futures resolve only once ``expected`` publishes were started: a
    worker that waited for each before publishing the next would wait in vain."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.futures: list[Future[str]] = []
        self.job_ids: list[str] = []
        self._lock = threading.Lock()

    def publish(self, topic: str, data: bytes, **attributes: str) -> Future[str]:
        future: Future[str] = Future()
        with self._lock:
            self.futures.append(future)
            self.job_ids.append(attributes["job_id"])
            if len(self.futures) % self.expected == 0:
                for waiting in self.futures[-self.expected :]:
                    waiting.set_result(str(len(self.job_ids)))
        return future


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def schedules() -> list[Periodic]:
    every = Ticks(ZoneInfo("UTC"), every=10)
    return [Periodic(f"s{i:03d}", "demo.echo", every, catch_up="none") for i in range(SCHEDULES)]


def published(marks: Marks) -> bool:
    """Whether every schedule's tick NOW is marked published (none left unpublished)."""
    return all(marks.latest(s.name) == (NOW, 1) for s in schedules())


def test_a_burst_of_due_ticks_is_published_at_once_and_recorded_in_one_transaction(
    tmp_path: Path,
) -> None:
    # Given 300 schedules ticking together, fired by one worker on an SQLite store whose
    # statements are counted, and a publisher that confirms only once all 300 were sent
    marks = SqliteMarks(tmp_path / "m.db")
    statements: list[str] = []
    marks._conn.set_trace_callback(statements.append)
    publisher, clock = Gated(SCHEDULES), Clock(NOW - 1)
    firer = Periodics(schedules(), marks, "t", publisher, clock=clock)
    firer.start()
    try:
        # (counted from the end of its start, whose catch-up reads each schedule's last tick)
        assert wait_for(lambda: any("marked_at FROM" in s for s in statements), timeout=20)
        statements.clear()
        # When the tick falls
        clock.now = NOW + 0.5
        # Then all 300 are published, at once, and recorded published
        assert wait_for(lambda: published(SqliteMarks(tmp_path / "m.db")), timeout=20)
    finally:
        firer.close(5)
    assert sorted(publisher.job_ids) == sorted(s.job_id(NOW) for s in schedules())
    # And in a few statements for the whole burst (one a tick and more, one by one)
    writes = [s for s in statements if s.split()[0] not in ("SELECT", "BEGIN", "COMMIT")]
    print(f"{len(statements)} statements ({len(writes)} writes) for {SCHEDULES} ticks")
    assert len(writes) <= 3 and len(statements) < 20, [s[:60] for s in statements[:20]]


class Dying(SqliteMarks):
    """Marks of a worker that dies once it published a burst, before recording it."""

    def published_many(self, *args: object, **kwargs: object) -> None:
        raise StoreError("the worker died")


def test_a_worker_dying_between_publish_and_record_leaves_the_burst_to_another_once(
    tmp_path: Path,
) -> None:
    # Given a worker that publishes the burst of 300 ticks and dies before recording it
    publisher, clock = Gated(SCHEDULES), Clock(NOW - 1)
    dying = Periodics(schedules(), Dying(tmp_path / "m.db"), "t", publisher, clock=clock)
    dying.start()
    clock.now = NOW + 0.5
    assert wait_for(lambda: len(publisher.job_ids) == SCHEDULES, timeout=20)
    dying.close(5)
    marks = SqliteMarks(tmp_path / "m.db")
    assert len(marks.unpublished(NOW + 100)) == SCHEDULES
    # When another worker runs past take_over_after (5 s)
    other = Periodics(schedules(), SqliteMarks(tmp_path / "m.db"), "t", publisher,
                      clock=lambda: NOW + 10)  # fmt: skip
    other.start()
    try:
        assert wait_for(lambda: published(marks), timeout=20)
    finally:
        other.close(5)
    # Then it published each tick again, under the same job id
    ids = sorted(s.job_id(NOW) for s in schedules())
    assert sorted(publisher.job_ids) == sorted(ids + ids)
    # And each job runs once: the second message of a job id finds it done
    store = MemoryStore()
    outcomes = []
    for n, job_id in enumerate(publisher.job_ids):
        outcome = store.claim(job_id, "w", str(n), 60)
        outcomes.append(type(outcome))
        if isinstance(outcome, Claimed):
            store.complete(job_id, "w", str(n))
    assert outcomes.count(Claimed) == SCHEDULES and outcomes.count(Done) == SCHEDULES
