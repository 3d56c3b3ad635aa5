"""One structured log line per job, when its message leaves the pool (INFO; a warning when
the run failed); with DEBUG on, one more when a run starts.

Fields: job, job_id, message_id, attempt, duration (seconds), outcome, error_type when
dead-lettered, and renewed when the message was published again on its last delivery.
Payloads are never logged: they may hold personal data. The line carries the run's trace
although its span is no longer current by then. Nothing is formatted for a level
that is off: two lines a job, always formatted, were most of the job log's cost.
"""

from __future__ import annotations

import functools
import logging
import time
from json.encoder import encode_basestring

from opentelemetry.trace import SpanContext

from workerpool import constants as c
from workerpool.telemetry.handler import FIELDS, SPAN_CONTEXT, BackgroundHandler
from workerpool.telemetry.logs import CloudLoggingFormatter, call_site, json_lines_alone, traced
from workerpool.worker.middleware import Middleware
from workerpool.worker.run import Run, Settled
from workerpool.worker.text import safe_text
from workerpool.worker.together import together

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
        # A recorded batch's lines are made together: one hand-off to the log handler's
        # thread a batch, not one a line (measured: the completions thread took 17.6-18.9
        # against 20.2-20.7 us of CPU a no-op job at N = 100).
        together(self._log, event)

    def _log(self, events: list[Settled]) -> None:
        created = time.time()
        alone_at: dict[int, tuple[BackgroundHandler, CloudLoggingFormatter] | None] = {}
        made: list[_Made] = []
        handler: BackgroundHandler | None = None
        for event in events:
            level = logging.WARNING if event.label in c.FAILED_LABELS else logging.INFO
            if not log.isEnabledFor(level):
                continue
            span = event.run.span.get_span_context() if event.run is not None else None
            if level not in alone_at:
                alone_at[level] = json_lines_alone(log, level)
            alone = alone_at[level]
            if alone is not None:
                # The line's record would reach the JSON lines handler alone: the line is
                # made on that handler's thread, with no record, from the event and what
                # may change after it (its run's start) read here (measured: 7.7 us of the
                # settling thread's CPU a line to make the record and pass it through
                # logging, 3.2 this way).
                handler, formatter = alone
                made.append((formatter, level, event, event.duration, created, traced(span)))
                continue
            # makeRecord + handle, not log.log: its source is always this line, so the stack
            # walk that finds the caller (a tenth of the line's cost) is left out. The
            # message is complete, with no arguments, so the log handler need not copy the
            # record to fix it.
            message, fields = _end_line(event, event.duration)
            log.handle(_record(level, message, {FIELDS: fields, SPAN_CONTEXT: span}))
        if handler is not None:
            handler.emit_line(functools.partial(_json_lines, handler, made))


def _end_line(event: Settled, duration: float | None) -> tuple[str, dict[str, object]]:
    """An end line's message and fields."""
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
    return f"job {event.job or '?'} {event.label}{took}", fields


# ``_json_line``'s arguments.
_Made = tuple[CloudLoggingFormatter, int, Settled, float | None, float, SpanContext | None]


def _json_lines(handler: BackgroundHandler, made: list[_Made]) -> str:
    """The lines of ``made`` (``_json_line``'s arguments each), one a row; one that cannot be
    made is told to ``handler`` and left out."""
    lines = []
    for parts in made:
        try:
            lines.append(_json_line(*parts))
        except Exception:
            handler.failed(functools.partial(_json_line, *parts))
    return "\n".join(lines)


def _json_line(
    formatter: CloudLoggingFormatter,
    level: int,
    event: Settled,
    duration: float | None,
    created: float,
    span: SpanContext | None,
) -> str:
    """An end line as ``formatter`` formats its record logged at ``created``: its fields
    encoded here, as ``_end_line`` names them and JSON writes them (measured: 4.0 against
    2.2 us a line, where encoding the fields' dict was half of it)."""
    job = event.job
    took = "" if duration is None else f" in {duration:.3f}s"
    fields = (
        f'"{c.LOG_JOB}": {encode_basestring(job)}, '
        f'"{c.LOG_JOB_ID}": {encode_basestring(event.job_id)}, '
        f'"{c.LOG_MESSAGE_ID}": {encode_basestring(event.message_id)}, '
        f'"{c.LOG_ATTEMPT}": {int(event.attempt)}, '
        f'"{c.LOG_DURATION}": {"null" if duration is None else repr(round(duration, 6))}, '
        f'"{c.LOG_OUTCOME}": {encode_basestring(event.label)}'
    )
    if event.error_type:
        fields += f', "{c.LOG_ERROR_TYPE}": {encode_basestring(event.error_type)}'
    if event.renewed:
        fields += f', "{c.LOG_RENEWED}": true'
    message = encode_basestring(f"job {job or '?'} {event.label}{took}")
    line = formatter.assemble(_sites[level], message, created, fields, span)
    return safe_text(line)


# Where the end lines say they come from (Cloud Logging's sourceLocation), and that
# encoded, by level.
_SETTLED_LINE = JobLog.settled.__code__.co_firstlineno
_sites = {
    level: call_site(level, logging.getLevelName(level), log.name, __file__, _SETTLED_LINE,
                     "settled")
    for level in (logging.INFO, logging.WARNING)
}  # fmt: skip
# By level, an end line's record as ``makeRecord`` made it, and when logging started (in ms).
_templates: dict[int, tuple[dict[str, object], float]] = {}


def _record(level: int, message: str, extra: dict[str, object]) -> logging.LogRecord:
    """An end line's record, as ``makeRecord`` makes it. But for its time, message and
    extra, every end line of a level has the same attributes, so they are copied from the
    first one's (measured: 2.0 -> 0.9 us a line); not where records come from a factory or
    a logger class of the application's, nor where they name their thread or process, which
    may differ."""
    made = _templates.get(level)
    if made is None or not _records_alike():
        record = log.makeRecord(
            log.name, level, __file__, _SETTLED_LINE, message, (), None, "settled", extra
        )
        if made is None and _records_alike():
            start = record.created * 1000 - record.relativeCreated
            _templates[level] = ({k: v for k, v in vars(record).items() if k not in extra}, start)
        return record
    template, start = made
    record = logging.LogRecord.__new__(logging.LogRecord)
    now = time.time()
    # The time as ``LogRecord.__init__`` sets it.
    vars(record).update(
        template, created=now, msecs=int((now - int(now)) * 1000) + 0.0,
        relativeCreated=now * 1000 - start, msg=message, **extra,
    )  # fmt: skip
    return record


def _records_alike() -> bool:
    return (
        logging.getLogRecordFactory() is logging.LogRecord
        # (a logger class of the application's may add to each record)
        and getattr(log.makeRecord, "__func__", None) is logging.Logger.makeRecord
        and not (logging.logThreads or logging.logProcesses or logging.logMultiprocessing)
    )
