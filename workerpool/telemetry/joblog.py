"""One structured log line when a job run starts and one when its delivery is settled.

Fields: job, job_id, message_id, attempt; the end line adds duration (seconds) and outcome
(and error_type when dead-lettered). Payloads are never logged: they may hold personal data.
The end line carries the run's trace although its span is no longer current by then.
"""

from __future__ import annotations

import logging

from opentelemetry import trace
from opentelemetry.trace import SpanContext

from workerpool import constants as c
from workerpool.context import JobContext
from workerpool.envelope import Job
from workerpool.listeners import Settled
from workerpool.logs import FIELDS, SPAN_CONTEXT
from workerpool.middleware import Middleware, Next
from workerpool.outcome import Outcome
from workerpool.telemetry.runs import PerRun

log = logging.getLogger("workerpool.jobs")


class JobLog(Middleware):
    """The start line (a middleware) and the end line (``settled``, a settle listener)."""

    def __init__(self) -> None:
        self._spans: PerRun[SpanContext] = PerRun()

    def run(self, job: Job, ctx: JobContext, call_next: Next) -> Outcome:
        span = trace.get_current_span().get_span_context()
        if span.is_valid:
            self._spans.put(job, span)
        fields = {
            c.LOG_JOB: job.name,
            c.LOG_JOB_ID: job.job_id,
            c.LOG_MESSAGE_ID: job.message_id,
            c.LOG_ATTEMPT: job.delivery_attempt,
        }
        log.info("job %s started", job.name, extra={FIELDS: fields})
        return call_next(job, ctx)

    def settled(self, event: Settled) -> None:
        span = self._spans.pop(event)
        fields: dict[str, object] = {
            c.LOG_JOB: event.job,
            c.LOG_JOB_ID: event.job_id,
            c.LOG_MESSAGE_ID: event.message_id,
            c.LOG_ATTEMPT: event.attempt,
            c.LOG_DURATION: None if event.duration is None else round(event.duration, 6),
            c.LOG_OUTCOME: event.label,
        }
        if event.error_type:
            fields[c.LOG_ERROR_TYPE] = event.error_type
        level = logging.WARNING if event.label in c.FAILED_LABELS else logging.INFO
        took = "" if event.duration is None else f" in {event.duration:.3f}s"
        log.log(
            level,
            "job %s %s%s",
            event.job or "?",
            event.label,
            took,
            extra={FIELDS: fields, SPAN_CONTEXT: span},
        )
