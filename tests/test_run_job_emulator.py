"""``run_job`` says what a real worker does: each row of the decision table a job can reach,
run through ``run_job`` and through a worker on the emulator, side by side."""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass
from typing import Any

import pytest

from tests.support import wait_for
from workerpool import AsyncJobContext, Defer, JobContext, PermanentError, RetryableError
from workerpool import constants as c
from workerpool.constants import Label
from workerpool.registry import Registry
from workerpool.testing import run_job
from workerpool.testing.pubsub import PubSubResources


@dataclass
class Order:
    order_id: str
    quantity: int


JOBS = Registry()
STARTED = threading.Event()


@JOBS.job("kit.ok", payload=Order)
def ok(ctx: JobContext, order: Order) -> None:
    pass


@JOBS.job("kit.retryable")
def retryable(ctx: JobContext, payload: dict[str, Any]) -> None:
    raise RetryableError("upstream 503")


@JOBS.job("kit.bug")
def bug(ctx: JobContext, payload: dict[str, Any]) -> None:
    raise KeyError("a bug")


@JOBS.job("kit.permanent")
def permanent(ctx: JobContext, payload: dict[str, Any]) -> None:
    raise PermanentError("no such customer", error_type="crm.unknown_customer")


@JOBS.job("kit.last", max_attempts=1)
def last(ctx: JobContext, payload: dict[str, Any]) -> None:
    raise RetryableError("still down")


@JOBS.job("kit.later")
def later(ctx: JobContext, payload: dict[str, Any]) -> None:
    raise Defer("not before the file lands", delay=7)


@JOBS.job("kit.slow", timeout=0.5)
async def slow(ctx: AsyncJobContext, payload: dict[str, Any]) -> None:
    await asyncio.sleep(30)


@JOBS.job("kit.long")
def long(ctx: JobContext, payload: dict[str, Any]) -> None:
    STARTED.set()
    ctx.sleep(30)


# (job, message body, label, error_type): every row a job's own run can reach.
ROWS = [
    ("kit.ok", {"order_id": "o-1", "quantity": 2}, Label.DONE, None),
    ("kit.ok", {"order_id": "o-1", "quantity": "2"}, Label.DEAD_LETTERED, c.ERR_INVALID_PAYLOAD),
    ("kit.ok", b"{not json", Label.DEAD_LETTERED, c.ERR_NOT_JSON),
    ("kit.retryable", {}, Label.RETRIED, None),
    ("kit.bug", {}, Label.RETRIED, None),
    ("kit.permanent", {}, Label.DEAD_LETTERED, "crm.unknown_customer"),
    ("kit.last", {}, Label.DEAD_LETTERED, c.ERR_ATTEMPTS_EXHAUSTED),
    ("kit.later", {}, Label.DEFERRED, None),
    ("kit.slow", {}, Label.RETRIED, None),
    ("kit.long", {}, Label.DRAINED, None),
]


def _body(payload: Any) -> bytes:
    return payload if isinstance(payload, bytes) else json.dumps(payload).encode()


@pytest.mark.parametrize(
    ("job", "payload", "label", "error_type"),
    ROWS,
    ids=[f"{job}-{label}" + (f"-{e}" if e else "") for job, _, label, e in ROWS],
)
def test_run_job_says_what_a_real_worker_does(
    pubsub_resources: PubSubResources, job: str, payload: Any, label: Label, error_type: str | None
) -> None:
    # Given a job, When run_job runs it (the drain deadline 0.3 s in, for the long one)
    cancel_after = 0.3 if job == "kit.long" else None
    predicted = run_job(job, data=_body(payload), jobs=JOBS, cancel_after=cancel_after)
    # and a worker on the emulator gets the same message (drained 0.3 s in, for the long one)
    pubsub_resources.provision()
    STARTED.clear()
    pubsub_resources.publish_raw(_body(payload), {"job": job, "job_id": "row-1"})
    # (retries 10 s apart: a retried message must not run again before the worker stops)
    with pubsub_resources.worker(
        JOBS, max_outstanding=1, drain_timeout=0.3, min_backoff=10.0, max_backoff=20.0
    ) as worker:
        if job == "kit.long":
            assert STARTED.wait(30)
        else:
            assert wait_for(lambda: sum(worker.processor.stats.values()) >= 1, timeout=30)
    stats = dict(worker.processor.stats)
    records = pubsub_resources.dead_letters(expected=1, timeout=5) if error_type else []
    # Then both took the same way out, with the same failure record
    assert (predicted.label, predicted.error_type) == (label, error_type)
    # (a message given back comes back soon: a second copy pulled as the worker drained is
    # released unstarted, not run)
    assert stats.get(label) == 1 and set(stats) <= {label, Label.RELEASED}, stats
    assert [r.attributes[c.ATTR_ERROR_TYPE] for r in records] == (
        [error_type] if error_type else []
    )
    assert predicted.acked == (label in (Label.DONE, Label.DEAD_LETTERED))
    if label is Label.DEFERRED:
        assert predicted.delay == 7
    if label is Label.RETRIED:
        assert predicted.delay is not None and predicted.delay > 0
