"""One structured log line when a job run starts and one when its delivery is settled.

Fields: job, job_id, message_id, attempt; the end line adds duration (seconds) and outcome
(and error_type when dead-lettered). Payloads are never logged: they may hold personal data.
The end line carries the run's trace although its span is no longer current by then.
"""

from __future__ import annotations

import logging

from workerpool import constants as c
from workerpool.telemetry.logs import FIELDS, SPAN_CONTEXT
from workerpool.worker.middleware import Middleware, Next
from workerpool.worker.outcome import Outcome
from workerpool.worker.run import Run, Settled

log = logging.getLogger("workerpool.jobs")


class JobLog(Middleware):
    """The start line (``run``) and the end line (``settled``)."""

    def run(self, run: Run, call_next: Next) -> Outcome:
        job = run.job
        fields = {
            c.LOG_JOB: job.name,
            c.LOG_JOB_ID: job.job_id,
            c.LOG_MESSAGE_ID: job.message_id,
            c.LOG_ATTEMPT: job.delivery_attempt,
        }
        log.info("job %s started", job.name, extra={FIELDS: fields})
        return call_next(run)

    def settled(self, event: Settled) -> None:
        duration = event.duration
        fields: dict[str, object] = {
            c.LOG_JOB: event.job,
            c.LOG_JOB_ID: event.job_id,
            c.LOG_MESSAGE_ID: event.message_id,
            c.LOG_ATTEMPT: event.attempt,
            c.LOG_DURATION: None if duration is None else round(duration, 6),
            c.LOG_OUTCOME: event.label,
        }
        if event.error_type:
            fields[c.LOG_ERROR_TYPE] = event.error_type
        level = logging.WARNING if event.label in c.FAILED_LABELS else logging.INFO
        took = "" if duration is None else f" in {duration:.3f}s"
        span = event.run.span.get_span_context() if event.run is not None else None
        log.log(
            level,
            "job %s %s%s",
            event.job or "?",
            event.label,
            took,
            extra={FIELDS: fields, SPAN_CONTEXT: span},
        )
