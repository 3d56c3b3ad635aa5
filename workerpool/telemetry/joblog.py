"""One structured log line per job, when its message leaves the pool (INFO; a warning when
the run failed); with DEBUG on, one more when a run starts.

Fields: job, job_id, message_id, attempt, duration (seconds), outcome, error_type when
dead-lettered, and renewed when the message was published again on its last delivery.
Payloads are never logged: they may hold personal data. The line carries the run's trace
although its span is no longer current by then. Nothing is formatted for a level
that is off: two lines a job, always formatted, were most of the job log's cost.
"""

from __future__ import annotations

import logging

from workerpool import constants as c
from workerpool.telemetry.handler import FIELDS, SPAN_CONTEXT
from workerpool.worker.middleware import Middleware
from workerpool.worker.run import Run, Settled

log = logging.getLogger("workerpool.jobs")


class JobLog(Middleware):
    """The start line (``run``, DEBUG) and the line of how it ended (``settled``)."""

    def before(self, run: Run) -> None:
        if log.isEnabledFor(logging.DEBUG):
            job = run.job
            fields = {
                c.LOG_JOB: job.name,
                c.LOG_JOB_ID: job.job_id,
                c.LOG_MESSAGE_ID: job.message_id,
                c.LOG_ATTEMPT: job.delivery_attempt,
            }
            log.debug("job %s started", job.name, extra={FIELDS: fields})

    def settled(self, event: Settled) -> None:
        level = logging.WARNING if event.label in c.FAILED_LABELS else logging.INFO
        if not log.isEnabledFor(level):
            return
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
        if event.renewed:
            fields[c.LOG_RENEWED] = True
        took = "" if duration is None else f" in {duration:.3f}s"
        span = event.run.span.get_span_context() if event.run is not None else None
        # makeRecord + handle, not log.log: its source is always this line, so the stack walk
        # that finds the caller (a tenth of the line's cost) is left out. The message is
        # complete, with no arguments, so the log handler need not copy the record to fix it.
        message = f"job {event.job or '?'} {event.label}{took}"
        extra = {FIELDS: fields, SPAN_CONTEXT: span}
        record = log.makeRecord(
            log.name, level, __file__, _SETTLED_LINE, message, (), None, "settled", extra
        )
        log.handle(record)


# Where the end lines say they come from (Cloud Logging's sourceLocation).
_SETTLED_LINE = JobLog.settled.__code__.co_firstlineno
