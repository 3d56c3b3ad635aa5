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

import functools
import json
import logging
import math
import os
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from json.encoder import encode_basestring
from types import FunctionType
from typing import Any, TextIO

from opentelemetry import trace
from opentelemetry.trace import SpanContext

from workerpool import constants as c
from workerpool.errors import ConfigError
from workerpool.telemetry.handler import (
    SPAN_CONTEXT,
    BackgroundHandler,
    install,
    installed_handler,
    record_fields,
)
from workerpool.worker.text import safe_text

ENV_LOG_FORMAT = "WORKERPOOL_LOG_FORMAT"
LOG_FORMATS = ("json", "text")

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
    install(handler, level)
    return handler


def _console_handler(stream: TextIO) -> logging.Handler:
    # Imported here: rich is loaded only by a process whose lines are text.
    from workerpool.telemetry.textlog import ConsoleHandler

    return ConsoleHandler(stream)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


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
    return traced(getattr(record, SPAN_CONTEXT, None))


def traced(named: SpanContext | None) -> SpanContext | None:
    """The span a line belongs to: ``named``, else the current one; None if not valid."""
    context = named if named is not None else trace.get_current_span().get_span_context()
    return context if context.is_valid else None


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
        site = call_site(record.levelno, record.levelname, record.name, record.pathname,
                         record.lineno, record.funcName)  # fmt: skip
        return self.line(site, message, record.created, record_fields(record),
                         _span_context(record))  # fmt: skip

    def line(
        self,
        site: str,
        message: str,
        created: float,
        fields: dict[str, Any],
        span: SpanContext | None,
    ) -> str:
        """The line of a record: ``site`` as ``call_site`` encodes it, ``created`` its time
        (``time.time()``), ``fields`` its structured fields, ``span`` its valid span or None."""
        encoded = _encode_object(fields)[1:-1] if fields else ""
        line = self.assemble(site, encode_basestring(message), created, encoded, span)
        if not _OWN_KEYS.isdisjoint(fields):
            # A key twice: read back, the last one wins (a field over the line's own part of
            # that name, the trace over a field), and only that one is written.
            line = _JSON.encode(json.loads(line))
        # A handler may log text decoded from a hostile payload: the line must still encode.
        return safe_text(line)

    def assemble(
        self, site: str, message: str, created: float, fields: str, span: SpanContext | None
    ) -> str:
        """A line from parts encoded already: ``message`` a JSON string, ``fields`` the
        members of a JSON object without its braces ("" for none), none of them a key of the
        line's own. Not made safe yet (``safe_text``)."""
        parts = [site, f'"message": {message}, "time": "{self._time(created)}"']
        if fields:
            parts.append(fields)
        if span is not None:
            parts.append(_trace(span))
        return f"{{{', '.join(parts)}}}"

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
def call_site(
    levelno: int, levelname: str, name: str, pathname: str, line: int, function: str
) -> str:
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


# The last of the methods a record is passed on by (``_dispatched_by_logging``) found on
# ``logging.Logger`` to be the logging module's own.
_own_dispatch: tuple[object, ...] = ()


def _dispatched_by_logging(logger: logging.Logger) -> bool:
    """Whether a record of ``logger`` (a ``logging.Logger``) is passed on by the logging
    module's own ``handle``, ``callHandlers`` and ``filter``: none replaced on the class (an
    error tracker's or an APM agent's logging integration wraps ``callHandlers``, say),
    whenever that was done, before this module was imported too, nor on the logger itself.
    A method is the module's own if it is a plain function of its globals: a wrapper may
    copy its name and module (``functools.wraps``) or pass for it (``wrapt``), not that."""
    global _own_dispatch
    own = vars(logger)
    if "handle" in own or "callHandlers" in own or "filter" in own:
        return False
    handle, call, filter_ = (
        logging.Logger.handle,
        logging.Logger.callHandlers,
        logging.Logger.filter,
    )
    known = _own_dispatch
    if known and handle is known[0] and call is known[1] and filter_ is known[2]:
        return True
    if not (_of_logging(handle) and _of_logging(call) and _of_logging(filter_)):
        return False
    _own_dispatch = (handle, call, filter_)
    return True


def _of_logging(method: object) -> bool:
    return type(method) is FunctionType and method.__globals__ is vars(logging)


def json_lines_alone(
    logger: logging.Logger, level: int
) -> tuple[BackgroundHandler, CloudLoggingFormatter] | None:
    """The installed JSON lines handler and its formatter, where a record ``logger`` logs at
    ``level`` (one it is enabled for) reaches that handler alone, unchanged on its way: no
    filter, no other handler, no record factory, logger class or dispatch of the
    application's (``_dispatched_by_logging``). There a caller may hand the handler a line to
    format without making its record (``BackgroundHandler.emit_line``); None otherwise."""
    handler = installed_handler()
    formatter = None if handler is None else handler.formatter
    if (
        type(handler) is not BackgroundHandler
        or type(formatter) is not CloudLoggingFormatter
        or level < handler.level
        or handler.filters
        or logger.filters
        or logger.disabled
        or type(logger) is not logging.Logger
        or not _dispatched_by_logging(logger)
        or logging.getLogRecordFactory() is not logging.LogRecord
    ):
        return None
    reached: list[logging.Handler] = []
    current: logging.Logger | None = logger
    while current is not None:
        reached += current.handlers
        current = current.parent if current.propagate else None
    return (handler, formatter) if reached == [handler] else None
