"""Cancel by job id: the record in the shared store (every backend), ``workerpool.cancel`` and
``workerpool cancel``, the outcome's row of the decide table, and the worker's gate and watch
on in-process runs (the real worker processes are in test_cancel_emulator.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tests.conftest import FIRESTORE_PROJECT
from tests.support import store_handles, wait_for
from workerpool.cli import main
from workerpool.constants import Label
from workerpool.context import AsyncJobContext, Flag, JobContext
from workerpool.control import Cancel, CancelStore, MemoryCancels, SqliteCancels
from workerpool.control.cancel import cancel
from workerpool.control.middleware import CANCEL_GRACE, CancelGate, Cancels, CancelWatch
from workerpool.control.store import SEEN_WITHIN
from workerpool.errors import RetryableError
from workerpool.idempotency import MemoryStore, SqliteStore
from workerpool.idempotency.middleware import Idempotency
from workerpool.registry import JobSpec, Registry
from workerpool.testing.fakes import FakeAcks, FakeDeadLetters, FakeLeaser, make_delivery
from workerpool.worker.aio import EventLoop
from workerpool.worker.backoff import Backoff
from workerpool.worker.envelope import Job
from workerpool.worker.middleware import Chain, Steps
from workerpool.worker.outcome import Ack, Cancelled, Facts, Failed, Succeeded, decide
from workerpool.worker.processor import Ending, Processor, ProcessorSettings
from workerpool.worker.run import Run, Settled
from workerpool.worker.timers import Timers

DAY = 86400.0
StoreFactory = Callable[[], CancelStore]


@pytest.fixture(params=["memory", "sqlite", "firestore"])
def make_store(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[StoreFactory]:
    def firestore(collection: str) -> CancelStore:
        from workerpool.control.firestore import FirestoreCancels

        return FirestoreCancels(FIRESTORE_PROJECT, collection, retention=DAY)

    with store_handles(
        request.param, request, monkeypatch,
        memory=lambda: MemoryCancels(retention=DAY),
        sqlite=lambda: SqliteCancels(tmp_path / "fleet.db", retention=DAY),
        firestore=firestore,
    ) as make:  # fmt: skip
        yield make


def test_the_first_cancel_of_a_job_id_stands_and_one_read_finds_those_asked(
    make_store: StoreFactory,
) -> None:
    # Given a cancel of "a" by one handle, then another of "a" and one of "b" by another
    first, second = make_store(), make_store()
    assert first.add(Cancel("a", "wrong input", 100.0)) == Cancel("a", "wrong input", 100.0)
    assert second.add(Cancel("a", "again", 101.0)) == Cancel("a", "wrong input", 100.0)
    second.add(Cancel("b", "", 102.0))
    # When a third handle looks up a, b and c together
    found = make_store().find(["a", "b", "c"], 103.0)
    # Then the first cancel of a and the one of b are found, nothing for c
    assert found == {"a": Cancel("a", "wrong input", 100.0), "b": Cancel("b", "", 102.0)}


def test_a_cancel_lasts_as_long_as_completions_are_kept(make_store: StoreFactory) -> None:
    # Given a cancel kept for a day (the store's retention)
    store = make_store()
    store.add(Cancel("a", "", 100.0))
    # Then it is found until the day is over, and a new cancel of the job id counts after it
    assert "a" in store.find(["a"], 100.0 + DAY - 1)
    assert store.find(["a"], 100.0 + DAY + 1) == {}
    assert store.add(Cancel("a", "later", 100.0 + DAY + 2)).reason == "later"


def test_a_cancel_of_a_finished_job_says_so_and_changes_nothing(tmp_path: Path) -> None:
    # Given a job id whose completion is recorded, and one not run yet
    url = f"sqlite:///{tmp_path / 'fleet.db'}"
    with SqliteStore(tmp_path / "fleet.db") as claims:
        claims.claim("done-1", "w", "m-1", 60.0)
        claims.complete("done-1", "w", "m-1")
    # When both are cancelled
    waits: list[float] = []
    answers = cancel(["done-1", "todo-1"], reason="not needed", store=url, sleep=waits.append)
    # Then the finished one is said so, and only the other is recorded, and the call returned
    # once every worker has read it before starting a job
    assert [a.state for a in answers] == ["finished", "cancelled"]
    assert waits == [SEEN_WITHIN]
    assert "already finished" in answers[0].line()
    found = SqliteCancels(tmp_path / "fleet.db", retention=DAY).find(["done-1", "todo-1"], 0)
    assert list(found) == ["todo-1"]
    assert found["todo-1"].reason == "not needed"


def test_the_command_says_one_line_a_job_id_and_refuses_a_store_without_cancels(
    tmp_path: Path,
) -> None:
    # Given a store file
    store = f"sqlite:///{tmp_path / 'fleet.db'}"
    # When two job ids are cancelled, then one of them again
    first = CliRunner().invoke(main, ["cancel", "a", "b", "--idempotency-store", store])
    again = CliRunner().invoke(main, ["cancel", "a", "--reason", "x", "--idempotency-store", store])
    refused = CliRunner().invoke(main, ["cancel", "a", "--idempotency-store", "none"])
    unseen = CliRunner().invoke(main, ["cancel", "a", "--idempotency-store", "memory://"])
    # Then each job id gets one line, exit 0; a store that keeps none is one line, exit 2
    assert (first.exit_code, first.output) == (0, "a: cancelled\nb: cancelled\n")
    assert again.exit_code == 0 and again.output.startswith("a: already cancelled at ")
    assert refused.exit_code == 2 and "keeps no cancels" in refused.output
    # ... and one no worker sees (the command's own memory) too: never "cancelled"
    assert unseen.exit_code == 2 and "no other process can see its cancels" in unseen.output


def test_a_cancelled_message_is_acked_with_its_own_label_and_no_failure_record() -> None:
    facts = Facts(attempt=3, max_attempts=3, backoff=Backoff(1, 10), last_delivery=True)
    assert decide(Cancelled("why"), facts) == Ack(Label.CANCELLED)


# --- the worker's side, in process -------------------------------------------------------------


def _run(job_id: str) -> Run:
    spec = JobSpec("t.job", lambda ctx, payload: None)
    message_id = f"m-{job_id}"
    job = Job(spec, job_id, {}, message_id, 1, None, {"job_id": job_id})
    ctx = JobContext(spec.name, job_id, message_id, 1, None, Flag())
    delivery = make_delivery(b"{}", {"job": "t.job", "job_id": job_id}, message_id=message_id)
    return Run(job, ctx, delivery, lambda run, outcome: True)


class _Clock:
    """A monotonic clock moved by hand: when the worker's last read of a job id began."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _worker(store: CancelStore, clock: _Clock | None = None) -> tuple[Cancels, Chain]:
    cancels = Cancels(  # looked up by hand below (``_poll`` is a loop)
        store, interval=3600.0, monotonic=clock or _Clock()
    )
    return cancels, Chain([CancelGate(cancels), CancelWatch(cancels)])


def test_a_job_cancelled_before_it_starts_never_reaches_its_handler() -> None:
    # Given a cancel of job 1, then a pull of jobs 1 and 2 admitted
    store = MemoryCancels(retention=DAY)
    store.add(Cancel("1", "obsolete", time.time()))
    cancels, chain = _worker(store)
    one, two = _run("1"), _run("2")
    CancelGate(cancels).admitted([one.delivery, two.delivery])
    # When both runs go through the chain
    started = []
    outcomes = []
    for run in (one, two):
        steps = Steps(chain, run)
        ended = steps.enter()
        if ended is None:
            started.append(run.job.job_id)
        outcomes.append(steps.leave(Succeeded() if ended is None else ended))
    # Then job 1 ends cancelled without starting, job 2 runs
    assert started == ["2"]
    assert outcomes == [Cancelled("obsolete"), Succeeded()]


def test_a_held_job_cancelled_while_it_waits_for_a_slot_never_starts() -> None:
    # Given jobs 1 and 2 admitted (their pull's read found no cancel) and job 1 running, with
    # job 2 held for the only slot and the worker's periodic read a long way off
    store, clock = MemoryCancels(retention=DAY), _Clock()
    cancels, chain = _worker(store, clock)
    cancels.admitted(["1", "2"])
    first = Steps(chain, _run("1"))
    assert first.enter() is None
    # When job 2 is cancelled, and the cancel returns (SEEN_WITHIN after it wrote), then job 1
    # ends and job 2 takes its slot at once
    store.add(Cancel("2", "obsolete", time.time()))
    clock.now += SEEN_WITHIN + 0.001
    assert first.leave(Succeeded()) == Succeeded()
    held = _run("2")
    ended = Steps(chain, held).enter()
    # Then job 2 never starts: it ends cancelled before its handler
    assert ended == Cancelled("obsolete")
    assert not held.ctx.cancelled.is_set()


def test_a_start_within_the_window_of_its_last_read_reads_nothing_more() -> None:
    # Given a store that counts its reads, and jobs 1 and 2 admitted by one read
    reads: list[set[str]] = []

    class Counting(MemoryCancels):
        def find(self, job_ids: Collection[str], now: float) -> dict[str, Cancel]:
            reads.append(set(job_ids))
            return super().find(job_ids, now)

    clock = _Clock()
    cancels, chain = _worker(Counting(retention=DAY), clock)
    cancels.admitted(["1", "2"])
    # When job 1 starts within SEEN_WITHIN of that read, and job 2 just after it
    clock.now += SEEN_WITHIN
    assert Steps(chain, _run("1")).enter() is None
    clock.now += 0.001
    assert Steps(chain, _run("2")).enter() is None
    # Then job 1 started on the admission's read, and job 2 waited for a read of its own
    assert reads == [{"1", "2"}, {"2"}]


def test_runs_starting_together_share_one_read_of_the_cancels() -> None:
    # Given a store that counts its reads, and 8 admitted jobs whose starts all ask at once
    # (the first read is held until all 8 have asked), their admission's read past the window
    reads: list[set[str]] = []
    asked, release = threading.Barrier(8), threading.Event()

    class Counting(MemoryCancels):
        def find(self, job_ids: Collection[str], now: float) -> dict[str, Cancel]:
            reads.append(set(job_ids))
            if len(reads) == 2:  # the first read at a start: let the others ask meanwhile
                release.wait(10)
            return super().find(job_ids, now)

    store, clock = Counting(retention=DAY), _Clock()
    cancels, chain = _worker(store, clock)
    ids = [str(i) for i in range(8)]
    cancels.admitted(ids)
    clock.now += SEEN_WITHIN + 0.001

    def start(job_id: str) -> None:
        asked.wait(10)
        Steps(chain, _run(job_id)).enter()

    threads = [threading.Thread(target=start, args=(job_id,)) for job_id in ids]
    for thread in threads:
        thread.start()
    assert wait_for(lambda: len(reads) == 2, timeout=10)
    # the other 7 ask while the first start's read is under way
    assert wait_for(lambda: len(cancels._starting) == 7, timeout=10)
    release.set()
    for thread in threads:
        thread.join(10)
    # Then the admission's read, the first start's, and one more for all the rest
    assert len(reads) == 3, reads
    assert set().union(*reads[1:]) == set(ids)


@pytest.mark.parametrize("handler_outcome", [Succeeded(), Failed("CancelledError", "cancelled")])
def test_a_run_cancelled_while_it_runs_is_told_and_ends_cancelled_whatever_it_returns(
    handler_outcome: Succeeded | Failed,
) -> None:
    # Given job 1 admitted and running
    store = MemoryCancels(retention=DAY)
    cancels, chain = _worker(store)
    run = _run("1")
    cancels.admitted(["1"])
    steps = Steps(chain, run)
    assert steps.enter() is None
    # When it is cancelled and the worker looks up what it holds
    store.add(Cancel("1", "stop", time.time()))
    cancels._poll_once()
    # Then the run sees ctx.cancelled, and ends cancelled whatever its handler returned
    assert run.ctx.cancelled.is_set()
    assert steps.leave(handler_outcome) == Cancelled("stop")
    # And once settled, the job id is no longer watched here
    cancels.settled(["1"])
    assert cancels.known("1") is None


def test_once_settled_the_job_id_is_no_longer_looked_up() -> None:
    store = MemoryCancels(retention=DAY)
    cancels, _ = _worker(store)
    cancels.admitted(["1"])
    CancelGate(cancels).settled(Settled(Label.DONE, "t.job", "1", "m-1", 1))
    store.add(Cancel("1", "", time.time()))
    cancels._poll_once()
    assert cancels.known("1") is None


@pytest.mark.parametrize("cooperates", [True, False])
def test_an_async_run_cancelled_has_a_grace_to_end_on_its_own_then_its_task_is_cancelled(
    cooperates: bool,
) -> None:
    # Given an async job that awaits ctx.cancelled (or ignores it), run by a processor with
    # the cancel gate and watch
    jobs, seen = Registry(), []
    store = MemoryCancels(retention=DAY)
    cancels = Cancels(store, interval=3600.0)
    told = threading.Event()

    @jobs.job("t.long")
    async def long(ctx: AsyncJobContext, payload: dict[str, Any]) -> None:
        told.set()
        try:
            if cooperates:
                await ctx.cancelled
                seen.append("returned")
                return
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen.append(f"task cancelled after {time.monotonic() - cancelled_at[0]:.2f}s")
            raise

    loop = EventLoop()
    acks = FakeAcks()
    processor = Processor(
        jobs, acks, FakeLeaser(), FakeDeadLetters(), [CancelGate(cancels), CancelWatch(cancels)],
        ProcessorSettings(Backoff(1, 10)), loop=loop,
    )  # fmt: skip
    delivery = make_delivery(b"{}", {"job": "t.long", "job_id": "1"})
    cancels.admitted(["1"])
    cancelled_at: list[float] = []
    # When it runs, and is cancelled meanwhile
    worker = threading.Thread(target=processor.process, args=(delivery,))
    worker.start()
    assert told.wait(10)
    store.add(Cancel("1", "stop", time.time()))
    cancelled_at.append(time.monotonic())
    cancels._poll_once()
    worker.join(10)
    loop.close(2.0)
    # Then one that awaits ctx.cancelled ends on its own, one that ignores it has its task
    # cancelled once the grace is over; either way the run ends cancelled, and is acked
    if cooperates:
        assert seen == ["returned"]
    else:
        [line] = seen
        waited = float(line.split()[-1].rstrip("s"))
        assert CANCEL_GRACE <= waited < CANCEL_GRACE + 5, line
    assert processor.stats == {"cancelled": 1} and acks.acked == ["ack-m-1"]


class _PermitLater:
    """The permit of an async run made ready ahead in a full pool: granted by hand."""

    def __init__(self) -> None:
        self._start: Callable[[bool], None] | None = None

    def put_down(self) -> bool:
        return True

    def pick_up(self) -> bool:
        return True

    def start_when_held(self, start: Callable[[bool], None]) -> None:
        self._start = start

    def grant(self) -> None:
        assert self._start is not None, "the run did not wait for its permit"
        self._start(True)


def test_an_async_run_cancelled_while_ready_ahead_for_a_slot_never_starts() -> None:
    # Given an async job made ready ahead (through the cancel gate and watch) in a full pool,
    # waiting for a permit
    jobs, started = Registry(), threading.Event()

    @jobs.job("t.async")
    async def job(ctx: AsyncJobContext, payload: dict[str, Any]) -> None:
        started.set()

    store = MemoryCancels(retention=DAY)
    cancels = Cancels(store, interval=3600.0)
    loop, acks = EventLoop(), FakeAcks()
    processor = Processor(
        jobs, acks, FakeLeaser(), FakeDeadLetters(), [CancelGate(cancels), CancelWatch(cancels)],
        ProcessorSettings(Backoff(1, 10)), loop=loop,
    )  # fmt: skip
    delivery = make_delivery(b"{}", {"job": "t.async", "job_id": "1"})
    cancels.admitted(["1"])
    permit, rest = _PermitLater(), []
    try:
        assert processor.process(delivery, permit, resume=rest.append) is Ending.CARRIED
        # When its job id is cancelled and read meanwhile, and then a slot frees for it
        store.add(Cancel("1", "obsolete", time.time()))
        cancels._poll_once()
        permit.grant()
        assert wait_for(lambda: rest, timeout=10)
        assert rest[0]() is Ending.SETTLED
        # Then its handler never started, and it ends cancelled (acked)
        assert not started.is_set()
        assert processor.stats == {"cancelled": 1} and acks.acked == ["ack-m-1"]
    finally:
        loop.close(2.0)


def test_a_run_cancelled_while_it_runs_is_recorded_done_and_a_redelivery_never_runs(
    timers: Timers,
) -> None:
    # Given a worker with claims and the cancel gate and watch, running a sync job that
    # stops when told (it raises, as demo.sleep does)
    jobs, runs = Registry(), []
    claims, store = MemoryStore(), MemoryCancels(retention=DAY)
    cancels = Cancels(store, interval=3600.0)
    idempotency = Idempotency(claims, "w1", timers)
    told = threading.Event()

    @jobs.job("t.stops")
    def stops(ctx: JobContext, payload: dict[str, Any]) -> None:
        runs.append(ctx.message_id)
        told.set()
        if ctx.cancelled.wait(30):
            raise RetryableError("cancelled")

    acks = FakeAcks()
    middleware = [CancelGate(cancels), idempotency, CancelWatch(cancels)]
    processor = Processor(
        jobs, acks, FakeLeaser(), FakeDeadLetters(), middleware, ProcessorSettings(Backoff(1, 10))
    )
    idempotency.start()
    first = make_delivery(b"{}", {"job": "t.stops", "job_id": "1"}, message_id="m-1")
    processor.admitted([first])
    worker = threading.Thread(target=processor.process, args=(first,))
    worker.start()
    assert told.wait(10)
    # When its job id is cancelled while it runs
    store.add(Cancel("1", "stop", time.time()))
    cancels._poll_once()
    worker.join(10)
    assert wait_for(lambda: processor.stats == {"cancelled": 1}, timeout=10)
    # Then its job id is recorded as done (what it raised is no failure), its message acked
    assert claims.completed_at("1") is not None
    # And a redelivery of it, once the worker no longer knows of the cancel, is acked unrun
    cancels._known.clear()
    second = make_delivery(b"{}", {"job": "t.stops", "job_id": "1"}, message_id="m-2")
    processor.process(second)
    idempotency.close(5)
    assert runs == ["m-1"]
    assert acks.acked == ["ack-m-1", "ack-m-2"]
    assert processor.stats == {"cancelled": 1, "duplicate": 1}


def test_the_cancel_poller_survives_a_bug_and_reads_on() -> None:
    # Given a held job and a store whose reads fail with a bug (not a store outage) for a while
    class Buggy(MemoryCancels):
        bug = False
        calls = 0

        def find(self, job_ids: Collection[str], now: float) -> dict[str, Cancel]:
            self.calls += 1
            if self.bug:
                raise RuntimeError("a bug")
            return super().find(job_ids, now)

    store = Buggy(retention=DAY)
    cancels = Cancels(store, interval=0.01)
    cancels.admitted(["1"])
    store.bug = True
    cancels.start()
    try:
        assert wait_for(lambda: store.calls >= 3, timeout=10)
        # When the bug is gone and the job is cancelled
        store.bug = False
        store.add(Cancel("1", "obsolete", time.time()))
        # Then the same thread reads on and finds it
        assert wait_for(lambda: cancels.known("1") is not None, timeout=10)
    finally:
        cancels.close(1.0)
