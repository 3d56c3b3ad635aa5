"""Checkpoints and progress: the stores (memory, SQLite, Firestore on its emulator), a job's
runs resuming from ``ctx.last_checkpoint`` through a real processor, and the progress writer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import FIRESTORE_PROJECT
from tests.support import store_handles, wait_for
from workerpool import AsyncJobContext, JobContext
from workerpool.constants import Label
from workerpool.control import Cancel, MemoryCancels
from workerpool.control.middleware import CancelGate, Cancels
from workerpool.idempotency import Claimed, MemoryStore
from workerpool.idempotency.middleware import Idempotency
from workerpool.progress import (
    MAX_CHECKPOINT_BYTES,
    CheckpointTooLarge,
    JobStateStore,
    MemoryJobState,
    Report,
    SqliteJobState,
)
from workerpool.progress.middleware import Checkpoints
from workerpool.progress.store import FORGET_AFTER
from workerpool.progress.writer import LAPSE, REFRESH, ProgressWriter
from workerpool.registry import Registry
from workerpool.stores import StoreError
from workerpool.testing import run_job
from workerpool.testing.fakes import FakeAcks, FakeDeadLetters, FakeLeaser, make_delivery
from workerpool.worker.aio import EventLoop
from workerpool.worker.backoff import Backoff
from workerpool.worker.processor import Processor, ProcessorSettings
from workerpool.worker.timers import Timers

StoreFactory = Callable[[], JobStateStore]


@pytest.fixture(params=["memory", "sqlite", "firestore"])
def make_store(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[StoreFactory]:
    def firestore(collection: str) -> JobStateStore:
        from workerpool.progress.firestore import FirestoreJobState

        return FirestoreJobState(FIRESTORE_PROJECT, collection)

    with store_handles(
        request.param, request, monkeypatch,
        memory=MemoryJobState,
        sqlite=lambda: SqliteJobState(tmp_path / "fleet.db"),
        firestore=firestore,
    ) as make:  # fmt: skip
        yield make


def report(key: str, *, at: float, done: float | None = None, note: str = "") -> Report:
    replica, _, job_id = key.partition("/")
    return Report(key, "copy", job_id, replica, 90.0, done, 100, note, at, at + LAPSE)


# --- the stores ------------------------------------------------------------------------------


def test_a_checkpoint_is_seen_by_another_handle_until_forgotten(make_store: StoreFactory) -> None:
    writer, reader = make_store(), make_store()
    assert reader.load("j1") is None
    writer.save("j1", '{"row": 1}', 1.0)
    writer.save("j1", '{"row": 2}', 2.0)
    writer.save("j2", "[]", 2.0)
    assert reader.load("j1") == '{"row": 2}'
    assert reader.load_many(["j1", "j2", "never-saved"]) == {"j1": '{"row": 2}', "j2": "[]"}
    writer.forget(["j1", "never-saved"])
    assert reader.load("j1") is None
    assert reader.load("j2") == "[]"


def test_progress_is_listed_until_it_ends_or_lapses(make_store: StoreFactory) -> None:
    writer, reader = make_store(), make_store()
    writer.report([report("r1/a", at=100.0), report("r2/b", at=100.0, done=3, note="page 3")])
    writer.report([report("r1/a", at=101.0, done=7)])
    running = reader.running(now=102.0)
    assert [(r.key, r.done, r.note) for r in running] == [("r1/a", 7, ""), ("r2/b", 3, "page 3")]
    writer.ended(["r1/a"])
    assert [r.key for r in reader.running(now=102.0)] == ["r2/b"]
    assert reader.running(now=100.0 + LAPSE + 1) == []  # its replica stopped rewriting it
    reader.running(now=100.0 + LAPSE + FORGET_AFTER + 1)  # forgets it on the way
    writer.report([report("r3/c", at=100.0)])  # an old record again: only the new one is left
    assert [r.key for r in reader.running(now=101.0)] == ["r3/c"]


# --- a job's runs, through a real processor --------------------------------------------------

jobs = Registry()
steps_done: list[int] = []


@jobs.job("resumable", max_attempts=3)
def resumable(ctx: JobContext, payload: dict[str, Any]) -> None:
    start = 0 if ctx.last_checkpoint is None else ctx.last_checkpoint["next"]
    for step in range(start, 10):
        steps_done.append(step)
        ctx.progress(step + 1, 10)
        ctx.checkpoint({"next": step + 1})
        if step + 1 == payload.get("fail_after"):
            raise RuntimeError("the partner went away")


@jobs.job("async_resumable", max_attempts=3)
async def async_resumable(ctx: AsyncJobContext, payload: dict[str, Any]) -> None:
    start = 0 if ctx.last_checkpoint is None else ctx.last_checkpoint["next"]
    for step in range(start, 10):
        await asyncio.sleep(0)
        steps_done.append(step)
        await ctx.checkpoint({"next": step + 1})
        if step + 1 == payload.get("fail_after"):
            raise RuntimeError("the partner went away")


@jobs.job("too_big", max_attempts=1)
def too_big(ctx: JobContext, payload: dict[str, Any]) -> None:
    ctx.checkpoint({"rows": "x" * MAX_CHECKPOINT_BYTES})


@jobs.job("no_checkpoint")
def no_checkpoint(ctx: JobContext, payload: dict[str, Any]) -> None:
    steps_done.append(0 if ctx.last_checkpoint is None else -1)
    ctx.progress(1)


@pytest.fixture(autouse=True)
def _fresh_steps() -> None:
    steps_done.clear()


@pytest.mark.parametrize("job", ["resumable", "async_resumable"])
def test_a_retry_resumes_from_the_last_checkpoint_and_the_finished_job_forgets_it(
    job: str,
) -> None:
    store = MemoryJobState()
    mw = Checkpoints(store, "replica-1")
    first = run_job(job, {"fail_after": 4}, job_id="j1", jobs=jobs, middleware=[mw])
    assert first.label is Label.RETRIED
    assert store.load("j1") == '{"next":4}'  # kept for the next run, whatever ended this one
    mw.writer.flush()
    assert store.load("j1") == '{"next":4}'
    second = run_job(job, {}, job_id="j1", attempt=2, jobs=jobs, middleware=[mw])
    assert second.label is Label.DONE
    assert steps_done == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]  # no step done twice
    mw.writer.flush()
    assert store.load("j1") is None


def test_an_async_job_starts_on_the_checkpoint_read_with_its_pull() -> None:
    # Given a checkpoint of job j6, and a store that counts its reads
    reads: list[str] = []

    class Counting(MemoryJobState):
        def load(self, job_id: str) -> str | None:
            reads.append("load")
            return super().load(job_id)

        def load_many(self, job_ids: Sequence[str]) -> dict[str, str]:
            reads.append("load_many")
            return super().load_many(job_ids)

    store = Counting()
    store.save("j6", '{"next":7}', 1.0)
    mw = Checkpoints(store, "replica-1", is_async=lambda d: d.attributes["job"].startswith("a"))
    # When a pull of it and of a sync job is admitted, then the async job runs
    pulled = [
        make_delivery(b"{}", {"job": "async_resumable", "job_id": "j6"}, message_id="m-6"),
        make_delivery(b"{}", {"job": "resumable", "job_id": "j7"}, message_id="m-7"),
    ]
    mw.admitted(pulled)
    result = run_job("async_resumable", {}, job_id="j6", attempt=2, jobs=jobs, middleware=[mw])
    # Then one read served it (the sync job's is left to its run), and it resumed from step 7
    assert result.label is Label.DONE
    assert reads == ["load_many"]
    assert steps_done == [7, 8, 9]


class _CountingReads(MemoryJobState):
    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def load(self, job_id: str) -> str | None:
        self.reads.append("load")
        return super().load(job_id)

    def load_many(self, job_ids: Sequence[str]) -> dict[str, str]:
        self.reads.append("load_many")
        return super().load_many(job_ids)


@pytest.mark.parametrize("claim_at_admission", ["won", "held elsewhere"])
def test_an_async_job_runs_on_the_checkpoint_read_with_its_pull_only_if_claimed_before_it(
    timers: Timers, claim_at_admission: str
) -> None:
    # Given job j8 at its checkpoint 5 as a pull here admits a delivery of it; its claim is
    # won, or refused: another worker's run holds the job id
    claims, store = MemoryStore(), _CountingReads()
    elsewhere = claim_at_admission == "held elsewhere"
    if elsewhere:
        assert isinstance(claims.claim("j8", "elsewhere", "m-1", 60.0), Claimed)
    store.save("j8", '{"next":5}', 1.0)
    idempotency = Idempotency(claims, "here", timers)
    checkpoints = Checkpoints(store, "here", is_async=lambda delivery: True)
    loop = EventLoop()
    processor = Processor(
        jobs, FakeAcks(), FakeLeaser(), FakeDeadLetters(), [idempotency, checkpoints],
        ProcessorSettings(Backoff(1.0, 10.0)), loop=loop,
    )  # fmt: skip
    idempotency.start()
    delivery = make_delivery(b"{}", {"job": "async_resumable", "job_id": "j8"}, message_id="m-2")
    try:
        processor.admitted([delivery])
        if elsewhere:
            # When that run checkpoints on to 8 and gives the job up
            store.save("j8", '{"next":8}', 2.0)
            claims.release("j8", "elsewhere", "m-1")
        # When the delivery here starts
        processor.process(delivery)
    finally:
        idempotency.close(5)
        loop.close(2.0)
    if elsewhere:
        # Then it resumes from 8: the pull's read predates its claim, so it reads again
        assert steps_done == [8, 9] and store.reads == ["load_many", "load"]
    else:
        # Then the pull's read, made under its claim, is all it needs
        assert steps_done == [5, 6, 7, 8, 9] and store.reads == ["load_many"]


def test_a_final_failure_forgets_the_checkpoint() -> None:
    store = MemoryJobState()
    mw = Checkpoints(store, "replica-1")
    last = run_job("resumable", {"fail_after": 1}, job_id="j2", attempt=3, jobs=jobs,
                   middleware=[mw])  # fmt: skip
    assert last.label is Label.DEAD_LETTERED
    mw.writer.flush()
    assert store.load("j2") is None


def test_a_job_cancelled_before_its_run_reads_its_checkpoint_forgets_it() -> None:
    # Given a job id with a checkpoint from an earlier run, since cancelled
    store = MemoryJobState()
    store.save("j4", '{"next":4}', 1.0)
    cancelled = MemoryCancels(retention=86400.0)
    cancelled.add(Cancel("j4", "obsolete", time.time()))
    cancels = Cancels(cancelled, interval=3600.0)
    cancels.admitted(["j4"])
    mw = Checkpoints(store, "replica-1")
    # When its next delivery ends cancelled at the gate, before its run could read it
    result = run_job("resumable", {}, job_id="j4", attempt=2, jobs=jobs,
                     middleware=[CancelGate(cancels), mw])  # fmt: skip
    assert result.label is Label.CANCELLED and steps_done == []
    # Then the checkpoint is deleted: the job is finished, and no run may resume from it
    mw.writer.flush()
    assert store.load("j4") is None


def test_a_checkpoint_over_the_limit_fails_the_run_naming_its_size() -> None:
    mw = Checkpoints(MemoryJobState(), "replica-1")
    result = run_job("too_big", job_id="j3", jobs=jobs, middleware=[mw])
    assert result.error_message is not None
    assert "CheckpointTooLarge" in result.error_message
    assert f"{MAX_CHECKPOINT_BYTES + 11:,} bytes" in result.error_message
    assert f"limit is {MAX_CHECKPOINT_BYTES:,}" in result.error_message
    assert issubclass(CheckpointTooLarge, ValueError)  # callers may catch it as one


def test_a_job_that_never_checkpoints_costs_the_store_nothing() -> None:
    class Counting(MemoryJobState):
        calls = 0

        def forget(self, job_ids: Any) -> None:
            self.calls += 1

    store = Counting()
    mw = Checkpoints(store, "replica-1")
    assert run_job("no_checkpoint", job_id="j4", jobs=jobs, middleware=[mw]).label is Label.DONE
    mw.writer.flush()
    assert steps_done == [0]
    assert store.calls == 0


def test_without_a_shared_store_a_checkpoint_is_refused_and_progress_ignored() -> None:
    result = run_job("resumable", {}, job_id="j5", attempt=3, jobs=jobs)
    assert result.error_message is not None
    assert "LookupError" in result.error_message and "idempotency_store" in result.error_message
    assert run_job("no_checkpoint", job_id="j5", jobs=jobs).label is Label.DONE


# --- the progress writer ---------------------------------------------------------------------


class _Handle:
    """What the writer reads of a run (``RunHandle``'s fields)."""

    def __init__(self, key: str) -> None:
        self.key, self.job, self.replica = key, "copy", key.partition("/")[0]
        self.job_id = key.partition("/")[2]
        self.started = 50.0
        self.progress: tuple[float | None, float | None, str] = (None, None, "")
        self.changed = 0

    def report(self, done: float, note: str = "") -> None:
        self.progress, self.changed = (done, 10, note), self.changed + 1


class _Recording(MemoryJobState):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[list[str]] = []

    def report(self, reports: Any) -> None:
        self.writes.append([f"{r.key}={r.done}" for r in reports])
        super().report(reports)


def test_the_writer_writes_what_changed_once_per_flush_and_removes_what_ended() -> None:
    now = [100.0]
    store = _Recording()
    writer = ProgressWriter(store, clock=lambda: now[0])
    a, b = _Handle("r1/a"), _Handle("r1/b")
    writer.started(a)  # type: ignore[arg-type]
    writer.started(b)  # type: ignore[arg-type]
    for done in range(1, 1001):  # a loop reporting every step: one write per flush
        a.report(done)
    writer.flush()
    assert store.writes == [["r1/a=1000", "r1/b=None"]]
    now[0] += 1
    writer.flush()  # nothing changed
    b.report(5, "page 5")
    writer.flush()
    assert store.writes[1:] == [["r1/b=5"]]
    now[0] += REFRESH
    writer.flush()  # rewritten though unchanged, so that neither lapses
    assert store.writes[2:] == [["r1/a=1000", "r1/b=5"]]
    writer.ended(a)  # type: ignore[arg-type]
    writer.flush()
    assert [(r.key, r.note) for r in store.running(now[0])] == [("r1/b", "page 5")]
    assert store.running(now[0])[0].until == now[0] + LAPSE


def test_a_store_that_fails_loses_no_removal() -> None:
    class Failing(MemoryJobState):
        down = True

        def forget(self, job_ids: Any) -> None:
            if self.down:
                raise StoreError("unreachable")
            super().forget(job_ids)

    store = Failing()
    store.save("j1", "{}", 1.0)
    writer = ProgressWriter(store)
    writer.forget("j1")
    writer.flush()
    assert store.load("j1") == "{}"
    store.down = False
    writer.flush()
    assert store.load("j1") is None


def test_status_running_shows_each_run_as_a_row() -> None:
    from workerpool.progress.running import running_lines

    rows = [
        report("host-1-ab/j1", at=100.0, done=57, note="page 57"),
        Report("host-2-cd/j2", "sync", "j2", "host-2-cd", 90.0, 3, None, "", 1.0, 2.0),
        Report("host-2-cd/j3", "sync", "j3", "host-2-cd", 90.0, None, None, "", 1, 2),
    ]
    assert running_lines(rows) == [
        "JOB   JOB ID  REPLICA    STARTED (UTC)        PROGRESS      NOTE",
        "copy  j1      host-1-ab  1970-01-01 00:01:30  57/100 (57%)  page 57",
        "sync  j2      host-2-cd  1970-01-01 00:01:30  3",
        "sync  j3      host-2-cd  1970-01-01 00:01:30  -",
        "3 job(s) running",
    ]


def test_the_writer_thread_survives_a_bug_and_writes_on() -> None:
    # Given a store whose removals fail with a bug (not a store outage) for a while
    class Buggy(MemoryJobState):
        bug = True
        calls = 0

        def forget(self, job_ids: Any) -> None:
            self.calls += 1
            if self.bug:
                raise RuntimeError("a bug")
            super().forget(job_ids)

    store = Buggy()
    store.save("j1", "{}", 1.0)
    store.save("j2", "{}", 1.0)
    writer = ProgressWriter(store, interval=0.01)
    writer.forget("j1")
    writer.start()
    try:
        assert wait_for(lambda: store.calls >= 1, timeout=10)  # hit on the writer's thread
        # When the bug is gone
        store.bug = False
        writer.forget("j2")
        # Then the same thread writes on
        assert wait_for(lambda: store.load("j2") is None, timeout=10)
    finally:
        writer.close(1.0)
