"""The idempotency middleware counts each failed run by the minute in its store (the
dashboard's chart): a run whose handler raised, retried or dead-lettered, and nothing else
(pure logic: in-memory store, in-process fakes for Pub/Sub)."""

from __future__ import annotations

from typing import Any

from workerpool import Defer, JobContext, PermanentError, RetryableError
from workerpool.idempotency import MemoryStore
from workerpool.idempotency.middleware import Idempotency
from workerpool.registry import Registry
from workerpool.testing.fakes import FakeAcks, FakeDeadLetters, FakeLeaser, make_delivery
from workerpool.worker.backoff import Backoff
from workerpool.worker.processor import Processor, ProcessorSettings
from workerpool.worker.timers import Timers


def _jobs() -> Registry:
    jobs = Registry()

    @jobs.job("t.ok")
    def ok(ctx: JobContext, payload: dict[str, Any]) -> None:
        pass

    @jobs.job("t.retry")
    def retry(ctx: JobContext, payload: dict[str, Any]) -> None:
        raise RetryableError("again")

    @jobs.job("t.permanent")
    def permanent(ctx: JobContext, payload: dict[str, Any]) -> None:
        raise PermanentError("never")

    @jobs.job("t.crash")
    def crash(ctx: JobContext, payload: dict[str, Any]) -> None:
        raise ValueError("a bug")

    @jobs.job("t.defer")
    def defer(ctx: JobContext, payload: dict[str, Any]) -> None:
        raise Defer("later", delay=1.0)

    return jobs


def test_each_run_whose_handler_raised_counts_once_and_nothing_else(timers: Timers) -> None:
    store = MemoryStore()
    idempotency = Idempotency(store, "w1", timers)
    processor = Processor(
        _jobs(), FakeAcks(), FakeLeaser(), FakeDeadLetters(), [idempotency],
        ProcessorSettings(Backoff(1.0, 10.0)),
    )  # fmt: skip
    idempotency.start()
    try:
        # When runs end every way: done, retried twice, dead-lettered, crashed, deferred,
        # and a message that never runs (no such job)
        runs = ["t.ok", "t.retry", "t.retry", "t.permanent", "t.crash", "t.defer", "t.nothing"]
        for number, job in enumerate(runs):
            attributes = {"job": job, "job_id": f"{job}-{number}"}
            processor.process(make_delivery(b"{}", attributes, message_id=f"m-{number}"))
    finally:
        idempotency.close(timeout=5)
    # Then the four runs whose handler raised are counted
    counts = store.failed_per_minute(0)
    assert counts is not None and sum(counts.values()) == 4, counts
