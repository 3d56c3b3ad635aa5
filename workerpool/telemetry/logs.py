"""Log setup: JSON lines in Cloud Logging's shape off a terminal, readable text on one.

On Cloud Run and GKE, stderr goes to Cloud Logging, which reads a JSON line's ``severity``,
``message``, ``time`` and ``logging.googleapis.com/*`` keys; every other key lands in
``jsonPayload``. Structured fields ride on a record as ``extra={"fields": {...}}`` and both
formats show them. A line written while a span is active (or naming one with
``extra={"span_context": ...}``) carries its trace, so Cloud Logging shows it with the trace.
``WORKERPOOL_LOG_FORMAT=json|text`` (or ``json_lines``) overrides the terminal check. The text
lines are ``workerpool.telemetry.textlog``'s, chosen once here: the JSON path never meets them.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import math
import os
import queue
import sys
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from json.encoder import encode_basestring
from typing import Any, TextIO, TypeVar

from opentelemetry import trace
from opentelemetry.trace import SpanContext

from workerpool import constants as c
from workerpool.errors import ConfigError
from workerpool.worker.text import safe_text

# Record attributes: structured fields, and the span a line belongs to when none is current.
FIELDS = "fields"
SPAN_CONTEXT = "span_context"
ENV_LOG_FORMAT = "WORKERPOOL_LOG_FORMAT"
LOG_FORMATS = ("json", "text")

_installed: logging.Handler | None = None
_project = ""


def set_trace_project(project: str) -> None:
    """The Google Cloud project that traces in JSON lines belong to
    (``projects/P/traces/T``); default ``GOOGLE_CLOUD_PROJECT``."""
    global _project
    _project = project


def setup_logging(
    *, level: int = logging.INFO, stream: TextIO | None = None, json_lines: bool | None = None
) -> logging.Handler:
    """Send the root logger to ``stream`` (stderr): JSON lines unless it is a terminal."""
    global _installed
    stream = stream or sys.stderr
    if json_lines is None:
        wanted = os.environ.get(ENV_LOG_FORMAT, "").strip().lower()
        if wanted not in ("", *LOG_FORMATS):
            raise ConfigError(f"{ENV_LOG_FORMAT} must be json or text, not {wanted!r}")
        json_lines = wanted == "json" if wanted else not _isatty(stream)
    handler = BackgroundHandler(stream) if json_lines else _console_handler(stream)
    if json_lines:
        handler.setFormatter(CloudLoggingFormatter())
    # Neither format shows the thread or the process: do not look them up for every record.
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    root = logging.getLogger()
    if _installed is not None:
        root.removeHandler(_installed)
        _installed.close()
    root.addHandler(handler)
    root.setLevel(level)
    _installed = handler
    return handler


def installed_handler() -> logging.Handler | None:
    """The handler the last ``setup_logging`` installed, if any."""
    return _installed


def _console_handler(stream: TextIO) -> logging.Handler:
    # Imported here: rich is loaded only by a process whose lines are text.
    from workerpool.telemetry.textlog import ConsoleHandler

    return ConsoleHandler(stream)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class BackgroundHandler(logging.Handler):
    """Formats and writes records on a thread of its own, as many lines per write as have
    queued meanwhile. A slot thread only queues its record: a write to stderr gives up the
    GIL, and in a process of a hundred slot threads winning it back cost more than the line
    (measured: a job log line was 0.2 ms of CPU at N = 100). What must be read where the
    record is made is fixed before it is queued: its message, its traceback, the current span.
    The thread lets lines gather for up to ``_LINGER`` after the first of a batch: woken for
    every line or two, its wake-ups and writes were most of the job log's cost (measured:
    83 us of CPU per job at N = 100, against 22 us to make and format the line).
    ``flush`` waits until what is queued is written, at once; ``close`` (``logging.shutdown``)
    too."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        self.stream = stream
        self._queue: queue.SimpleQueue[logging.LogRecord | threading.Event] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._starting = threading.Lock()
        self._hurry = threading.Event()  # a flush waits: write without lingering

    def handle(self, record: logging.LogRecord) -> bool:
        """``logging.Handler.handle`` without the handler's lock: ``emit`` only queues, and
        with a hundred slot threads queuing a line each, waits for that lock were 4 % of a
        job-log-only worker's samples (py-spy)."""
        checked = self.filter(record)
        if isinstance(checked, logging.LogRecord):  # Python 3.12: a filter may replace it
            record = checked
        if checked:
            self.emit(record)
        return bool(checked)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            queued = record
            fixed = isinstance(record.msg, str) and not record.args and not record.exc_info
            if not fixed or getattr(record, SPAN_CONTEXT, None) is None:
                queued = copy.copy(record)  # other handlers see the record as it was logged
                queued.msg, queued.args = queued.getMessage(), None  # args may change after
            if queued.exc_info:
                queued.exc_text = _PLAIN.formatException(queued.exc_info)
                queued.exc_info = None  # its traceback holds the caller's frames
            if getattr(queued, SPAN_CONTEXT, None) is None:
                setattr(queued, SPAN_CONTEXT, trace.get_current_span().get_span_context())
        except Exception:  # a bad log call must not raise where it was made
            self.handleError(record)
            return
        if self._thread is None:
            self._start()
        self._queue.put(queued)

    def _start(self) -> None:
        with self._starting:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._write, name="workerpool-logs", daemon=True
                )
                self._thread.start()

    def flush(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            written = threading.Event()
            self._queue.put(written)
            self._hurry.set()
            written.wait(5.0)

    def close(self) -> None:
        self.flush()
        super().close()

    def _write(self) -> None:
        while True:
            batch = [self._queue.get()]
            if not isinstance(batch[0], threading.Event):
                self._hurry.wait(_LINGER)
            self._hurry.clear()  # after it, what a flush queued before setting it is taken
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            records = [item for item in batch if isinstance(item, logging.LogRecord)]
            if records:
                try:
                    self._write_lines(records)
                except Exception:  # a closed or broken stream: logging must never stop the worker
                    self.handleError(records[-1])
            for item in batch:
                if isinstance(item, threading.Event):
                    item.set()

    def _write_lines(self, records: list[logging.LogRecord]) -> None:
        lines = formatted(records, self.format, self.handleError)
        self.stream.write("".join(line + "\n" for line in lines))
        self.stream.flush()


_Line = TypeVar("_Line")


def formatted(
    records: list[logging.LogRecord],
    format: Callable[[logging.LogRecord], _Line],
    failed: Callable[[logging.LogRecord], None],
) -> list[_Line]:
    """Each record's line; one that cannot be formatted is told to ``failed`` and left out."""
    lines = []
    for record in records:
        try:
            lines.append(format(record))
        except Exception:
            failed(record)
    return lines


_PLAIN = logging.Formatter()
_LINGER = 0.05  # seconds a line may wait for others to share its write
_JSON = json.JSONEncoder(default=str, ensure_ascii=False)  # made once, not once a line


def _object_encoder() -> Callable[[dict[str, Any]], str]:
    """``_JSON.encode`` for a dict, without the encoder object it makes per call (a third of
    its cost for a job line's fields). No check for circular references: one recurses until
    Python stops it, and the handler reports that error as it would the check's."""
    make_encoder = getattr(json.encoder, "c_make_encoder", None)  # not in typeshed's stubs
    if make_encoder is None:  # a Python built without the C accelerator
        return _JSON.encode
    encode = make_encoder(None, str, encode_basestring, None, ": ", ", ", False, False, True)
    return lambda obj: "".join(encode(obj, 0))


_encode_object = _object_encoder()
# The keys of a line's own parts, which a field of the same name replaces.
_OWN_KEYS = frozenset(
    {"severity", "message", "time", "logger", c.LOG_SOURCE_LOCATION, c.LOG_TRACE, c.LOG_SPAN_ID,
     c.LOG_TRACE_SAMPLED}
)  # fmt: skip


def _span_context(record: logging.LogRecord) -> SpanContext | None:
    named = getattr(record, SPAN_CONTEXT, None)
    context = named if named is not None else trace.get_current_span().get_span_context()
    return context if context.is_valid else None


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = dict(getattr(record, FIELDS, None) or {})
    job_id = getattr(record, c.LOG_JOB_ID, None)  # set by a job's ctx.logger
    if job_id is not None:
        fields.setdefault(c.LOG_JOB_ID, job_id)
    return fields


class CloudLoggingFormatter(logging.Formatter):
    """One JSON object per line, in the shape Cloud Logging reads from stdout/stderr.

    A line is put together from pieces already encoded where it can: what is the same for
    every line of one call site (severity, logger, source location), made once; the time of
    day, made once a second. Encoding the whole entry as one dict was 9 us of the 10 a job
    line cost to format (measured)."""

    def __init__(self) -> None:
        super().__init__()
        self._second = (-1, "")  # a whole second since the epoch, and its ISO 8601 text

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            message += "\n" + record.exc_text
        fields = record_fields(record)
        span = _span_context(record)
        parts = [
            _site(record.levelno, record.levelname, record.name, record.pathname, record.lineno,
                  record.funcName),
            f'"message": {encode_basestring(message)}, "time": "{self._time(record.created)}"',
        ]  # fmt: skip
        if fields:
            parts.append(_encode_object(fields)[1:-1])
        if span is not None:
            parts.append(_trace(span))
        line = f"{{{', '.join(parts)}}}"
        if not _OWN_KEYS.isdisjoint(fields):
            # A key twice: read back, the last one wins (a field over the line's own part of
            # that name, the trace over a field), and only that one is written.
            line = _JSON.encode(json.loads(line))
        # A handler may log text decoded from a hostile payload: the line must still encode.
        return safe_text(line)

    def _time(self, created: float) -> str:
        """``datetime.fromtimestamp(created, UTC).isoformat(timespec="microseconds")``: the
        microseconds rounded half to even, as ``datetime`` rounds them."""
        fraction, whole = math.modf(created)
        micros = round(fraction * 1e6)
        if micros >= 1_000_000:
            micros -= 1_000_000
            whole += 1
        second, text = self._second
        if second != int(whole):
            second = int(whole)
            text = datetime.fromtimestamp(second, UTC).isoformat(timespec="seconds")[:-6]
            self._second = (second, text)
        return f"{text}.{micros:06d}+00:00"


@functools.lru_cache(maxsize=1024)
def _site(levelno: int, levelname: str, name: str, pathname: str, line: int, function: str) -> str:
    """The encoded parts of a line that are the same for every line of one call site."""
    return _encode_object(
        {
            "severity": levelname if levelno else "DEFAULT",
            "logger": name,
            c.LOG_SOURCE_LOCATION: {"file": pathname, "line": str(line), "function": function},
        }
    )[1:-1]


def _trace(span: SpanContext) -> str:
    """The encoded parts of a line that name the trace it belongs to."""
    trace_id = f"{span.trace_id:032x}"
    project = _project or os.environ.get("GOOGLE_CLOUD_PROJECT", "")
    if project:
        trace_id = f"projects/{project}/traces/{trace_id}"
    sampled = "true" if span.trace_flags.sampled else "false"
    return (
        f'"{c.LOG_TRACE}": {encode_basestring(trace_id)}, "{c.LOG_SPAN_ID}": '
        f'"{span.span_id:016x}", "{c.LOG_TRACE_SAMPLED}": {sampled}'
    )
