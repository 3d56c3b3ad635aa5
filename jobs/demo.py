"""Jobs for the demo and the tests: sleep for a while (``demo.sleep``, or ``demo.async_sleep``
as an ``async def``), fail on demand, work through steps resuming from a checkpoint
(``demo.steps``).

If ``WORKERPOOL_DEMO_LEDGER`` names a file, every run appends one JSON line to it (job id,
message id, attempt, pid, start and end times), which is how the tests check from outside a
worker process what ran, when, and how often. The path comes from the environment, never from
a message, so a publisher cannot make a worker write files.

With ``WORKERPOOL_DEMO_LEDGER_STARTS=1`` a run also appends a line with outcome ``"start"`` (and
no ``end``) when it begins, so tests can see what is running now; it is off by default.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal

from workerpool import (
    AsyncJobContext,
    Defer,
    JobContext,
    PermanentError,
    RetryableError,
    job,
)
from workerpool.context import RunContext

_ledger_lock = threading.Lock()


@dataclass
class SleepRequest:
    seconds: float = 0.1
    # "retryable" or "permanent": raise that error (retryable: while attempt < fail_until).
    fail: Literal["retryable", "permanent"] | None = None
    fail_until: int = 0
    # Fail (as ``fail`` says) only while a file of this path exists: a test removes it, as an
    # operator fixes a cause, to let a replay succeed.
    fail_while: str = ""
    # Sleep on regardless of ctx.cancelled, like a handler stuck in a call that cannot be
    # interrupted (the tests use it to show a drain does not wait for it). demo.sleep only.
    ignore_cancel: bool = False
    # Ask to run later (raise Defer) while the delivery attempt is at most this. demo.sleep only.
    defer_until: int = 0


def _record(ctx: RunContext, started: float, outcome: str, **extra: Any) -> None:
    path = os.environ.get("WORKERPOOL_DEMO_LEDGER")
    if not path:
        return
    entry: dict[str, Any] = {
        "job_id": ctx.job_id,
        "message_id": ctx.message_id,
        "attempt": ctx.delivery_attempt,
        "pid": os.getpid(),
        "start": started,
        # When Pub/Sub took the message (a test tells a late publish from a late delivery).
        "published": ctx.publish_time.timestamp() if ctx.publish_time else None,
        **extra,
    }
    if outcome != "start":
        entry["end"] = time.time()
    entry["outcome"] = outcome
    with _ledger_lock, open(path, "a") as ledger:
        ledger.write(json.dumps(entry) + "\n")


def _record_start(ctx: RunContext, started: float) -> None:
    if os.environ.get("WORKERPOOL_DEMO_LEDGER_STARTS") == "1":
        _record(ctx, started, "start")


@job("demo.sleep", timeout=600, payload=SleepRequest)
def sleep(ctx: JobContext, request: SleepRequest) -> None:
    if ctx.delivery_attempt <= request.defer_until:
        raise Defer(f"asked to run later than attempt {ctx.delivery_attempt}", delay=0.1)
    started = time.time()
    _record_start(ctx, started)
    if request.ignore_cancel:
        time.sleep(request.seconds)
        finished = True
    else:
        finished = ctx.sleep(request.seconds)
    _end(ctx, request, started, finished)


@job("demo.async_sleep", timeout=600, payload=SleepRequest)
async def async_sleep(ctx: AsyncJobContext, request: SleepRequest) -> None:
    """``demo.sleep`` as an ``async def``: a cancel (drain deadline, timeout) ends its sleep
    with ``CancelledError``, which it records and lets through."""
    started = time.time()
    _record_start(ctx, started)
    try:
        await asyncio.sleep(request.seconds)
    except asyncio.CancelledError:
        _record(ctx, started, "cancelled")
        raise
    _end(ctx, request, started, finished=True)


def _end(ctx: RunContext, request: SleepRequest, started: float, finished: bool) -> None:
    if request.fail == "permanent":
        _record(ctx, started, "permanent")
        raise PermanentError("asked to fail permanently")
    fixed = bool(request.fail_while) and not os.path.exists(request.fail_while)
    if (
        request.fail == "retryable"
        and not fixed
        and (request.fail_until == 0 or ctx.delivery_attempt < request.fail_until)
    ):
        _record(ctx, started, "retryable")
        raise RetryableError(f"asked to fail on attempt {ctx.delivery_attempt}")
    _record(ctx, started, "done" if finished else "cancelled")
    if not finished:
        raise RetryableError("cancelled before the sleep ended")


@dataclass
class StepsRequest:
    steps: int = 100
    step_seconds: float = 0.05


@job("demo.steps", timeout=600, payload=StepsRequest)
def steps(ctx: JobContext, request: StepsRequest) -> None:
    """Steps of ``step_seconds`` each, a checkpoint after each: a run after a crash, a drain
    or a retry starts at the step after the last one stored, so at most the one step that was
    under way when the last run stopped is done twice. Each step done is a ledger line."""
    started = time.time()
    first = 0 if ctx.last_checkpoint is None else int(ctx.last_checkpoint["next"])
    _record(ctx, started, "resume", step=first)
    for step in range(first, request.steps):
        if not ctx.sleep(request.step_seconds):
            _record(ctx, started, "cancelled", step=step)
            raise RetryableError(f"cancelled before step {step}")
        _record(ctx, started, "step", step=step)
        ctx.checkpoint({"next": step + 1})
        ctx.progress(step + 1, request.steps, note=f"step {step + 1}")
    _record(ctx, started, "done")


@job("demo.echo", timeout=60)
def echo(ctx: JobContext, payload: dict[str, Any]) -> None:
    ctx.logger.info("echo %s", sorted(payload))


@job("demo.batch_done", timeout=60)
def batch_done(ctx: JobContext, payload: dict[str, Any]) -> None:
    """A batch's completion job (``on_complete``): its totals go to the ledger."""
    _record(ctx, time.time(), "done", batch=payload)
