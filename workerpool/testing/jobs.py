"""``run_job``: run one job in a unit test the way a worker would, without Pub/Sub.

The job goes through a real ``Processor`` (payload conversion, the job's typed config, its
``timeout``, rate limits, the decision table) with the test kit's fakes in place of Pub/Sub
(``workerpool.testing.fakes``), so what it returns is what a worker would do with the message.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from workerpool import constants as c
from workerpool.constants import Label
from workerpool.ratelimit import LocalLimiters, RateSpec, parse_rate
from workerpool.registry import JobSpec, Registry, registry
from workerpool.testing.fakes import FakeAcks, FakeDeadLetters, FakeLeaser
from workerpool.worker.aio import EventLoop
from workerpool.worker.backoff import Backoff
from workerpool.worker.delivery import Delivery
from workerpool.worker.middleware import Middleware, RateLimit, TimeLimit
from workerpool.worker.processor import Processor, ProcessorSettings
from workerpool.worker.run import Settled
from workerpool.worker.timers import Timers

# A rate limit the test did not declare: never makes a run wait.
_UNLIMITED = RateSpec(1e9, 1_000_000)


@dataclass(frozen=True)
class JobResult:
    """What the worker would do with the message: ``acked`` it, or give it back after
    ``delay`` seconds; ``label`` is how it is counted (``done``, ``retried``, ``deferred``,
    ``dead_lettered``, ``drained``); a dead-lettered one has its failure record's
    ``error_type`` and ``error_message``."""

    label: Label
    acked: bool
    delay: float | None = None
    error_type: str | None = None
    error_message: str | None = None

    @property
    def retried(self) -> bool:
        return self.label is Label.RETRIED

    @property
    def dead_lettered(self) -> bool:
        return self.label is Label.DEAD_LETTERED


def run_job(
    job: str | Callable[..., Any],
    payload: Any = None,
    *,
    job_id: str = "test-job",
    attempt: int = 1,
    config: Any = None,
    cancel_after: float | None = None,
    rate_limits: Mapping[str, str] | None = None,
    jobs: Registry = registry,
    data: bytes | None = None,
    middleware: Sequence[Middleware] = (),
) -> JobResult:
    """Run the job ``job`` (its name, or its handler as ``@job`` registered it in ``jobs``)
    once with ``payload`` (a JSON value; ``data`` gives the message body as bytes instead),
    as delivery ``attempt``, and return what the worker would do with its message.

    ``config`` is the job's ``[jobs."NAME"]`` section (a dict, converted as at start, or an
    instance of its config dataclass). ``cancel_after`` seconds, the drain deadline passes
    (``ctx.cancelled``, the message handed back). ``rate_limits`` declares the limiters its
    ``ctx.acquire`` calls use (``{"partner": "5/s"}``); the one its ``@job(rate_limit=...)``
    names, unless declared here, never makes it wait. ``middleware`` runs inside the kit's
    own, just outside the time limit (``workerpool.progress.middleware.Checkpoints`` over a
    ``MemoryJobState``, for a job that resumes from ``ctx.last_checkpoint``).
    """
    spec = _spec(job, jobs)
    alone = Registry()
    alone.add(spec)
    acks, records = FakeAcks(), FakeDeadLetters()
    limiters = _limiters(spec, rate_limits or {})
    timers, loop, seen = Timers(), EventLoop(), _Seen()
    chain = [seen, RateLimit(limiters), *middleware, TimeLimit(timers)]
    processor = Processor(
        alone, acks, FakeLeaser(), records, chain,
        ProcessorSettings(Backoff(), job_config=_config(alone, spec, config)),
        limiters=limiters, loop=loop,
    )  # fmt: skip
    body = json.dumps({} if payload is None else payload).encode() if data is None else data
    delivery = Delivery(
        ack_id="run-job", message_id=job_id, data=body,
        attributes={c.ATTR_JOB: spec.name, c.ATTR_JOB_ID: job_id},
        published=time.time(), delivery_attempt=attempt,
    )  # fmt: skip
    deadline = threading.Timer(cancel_after, processor.interrupt_running) if cancel_after else None
    timers.start()
    try:
        if deadline is not None:
            deadline.start()
        processor.process(delivery)
    finally:
        if deadline is not None:
            deadline.cancel()
        timers.close(1.0)
        loop.close(1.0)
    return _result(seen.event, acks, records)


def _spec(job: str | Callable[..., Any], jobs: Registry) -> JobSpec:
    if isinstance(job, str):
        spec = jobs.get(job)
        if spec is None:
            raise KeyError(f"no job named {job!r} is registered (known: {jobs.names()})")
        return spec
    for spec in jobs.specs():
        if spec.handler is job:
            return spec
    raise KeyError(f"{job!r} is not registered with @job (in the registry given)")


def _config(alone: Registry, spec: JobSpec, config: Any) -> dict[str, Any]:
    if config is None or isinstance(config, Mapping):
        return alone.configs({spec.name: config or {}})
    return {spec.name: config}


def _limiters(spec: JobSpec, declared: Mapping[str, str]) -> LocalLimiters:
    specs = {name: parse_rate(rate) for name, rate in declared.items()}
    named = spec.options.get("rate_limit")
    if named and named not in specs:
        specs[named] = _UNLIMITED
    return LocalLimiters(specs)


class _Seen(Middleware):
    """Hears how the message left (outermost, as the telemetry middleware is)."""

    event: Settled | None = None

    def settled(self, event: Settled) -> None:
        self.event = event


def _result(event: Settled | None, acks: FakeAcks, records: FakeDeadLetters) -> JobResult:
    assert event is not None, "the processor settles every message it is given"
    record = records.records[-1][1] if records.records else None
    return JobResult(
        label=event.label,
        acked=bool(acks.acked),
        delay=acks.modacked[-1][1] if acks.modacked and not acks.acked else None,
        error_type=record.error_type if record else None,
        error_message=record.error_message if record else None,
    )
