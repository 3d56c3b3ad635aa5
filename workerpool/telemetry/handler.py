"""The handler log lines are written through, whichever their format, and the one installed.

Below both formats (``logs`` chooses one, ``textlog`` makes the text one), so that neither
imports the other for it.
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TextIO, TypeVar

from opentelemetry import trace

from workerpool import constants as c

# Record attributes: structured fields, and the span a line belongs to when none is current.
FIELDS = "fields"
SPAN_CONTEXT = "span_context"

_installed: logging.Handler | None = None


def install(handler: logging.Handler, level: int) -> None:
    """Send the root logger to ``handler`` alone of ours, at ``level``."""
    global _installed
    root = logging.getLogger()
    if _installed is not None:
        root.removeHandler(_installed)
        _installed.close()
    root.addHandler(handler)
    root.setLevel(level)
    _installed = handler


def installed_handler() -> logging.Handler | None:
    """The handler the last ``setup_logging`` installed, if any."""
    return _installed


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
    too. A caller that knows its record would reach this handler alone may queue the making
    of its line instead (``emit_line``), and make no record at all."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        self.stream = stream
        self._queue: queue.SimpleQueue[Queued] = queue.SimpleQueue()
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

    def emit_line(self, make: Callable[[], str]) -> None:
        """Write the line ``make`` returns (or lines, one a row; none for ""), made on this
        handler's thread, in its turn with the records emitted: for a caller whose records
        would reach this handler alone, and whose lines need nothing read where they are
        logged (``logs.json_lines_alone``)."""
        if self._thread is None:
            self._start()
        self._queue.put(make)

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
            lines = [item for item in batch if not isinstance(item, threading.Event)]
            if lines:
                try:
                    self._write_lines(lines)
                except Exception:  # a closed or broken stream: logging must never stop the worker
                    self.failed(lines[-1])
            for item in batch:
                if isinstance(item, threading.Event):
                    item.set()

    def _write_lines(self, lines: list[Line]) -> None:
        texts = formatted(lines, self._format, self.failed)
        self.stream.write("".join(text + "\n" for text in texts if text))
        self.stream.flush()

    def _format(self, line: Line) -> str:
        return self.format(line) if isinstance(line, logging.LogRecord) else line()

    def failed(self, line: Line) -> None:
        """``handleError`` for a line that could not be made or written. A line's maker is
        named, never shown: what it holds (a job's run) may hold a payload."""
        if not isinstance(line, logging.LogRecord):
            maker = getattr(line, "func", line)
            name = getattr(maker, "__qualname__", type(maker).__qualname__)
            line = logging.makeLogRecord({"msg": "a line made by %s", "args": (name,)})
        self.handleError(line)


# A line to write: a record, or the making of its text (``emit_line``).
Line = logging.LogRecord | Callable[[], str]
Queued = Line | threading.Event  # or a flush, waiting for what came before it
_Text = TypeVar("_Text")


def formatted(
    lines: list[Line],
    format: Callable[[Line], _Text],
    failed: Callable[[Line], None],
) -> list[_Text]:
    """Each line's text; one that cannot be made is told to ``failed`` and left out."""
    texts = []
    for line in lines:
        try:
            texts.append(format(line))
        except Exception:
            failed(line)
    return texts


_PLAIN = logging.Formatter()
_LINGER = 0.05  # seconds a line may wait for others to share its write


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = dict(getattr(record, FIELDS, None) or {})
    job_id = getattr(record, c.LOG_JOB_ID, None)  # set by a job's ctx.logger
    if job_id is not None:
        fields.setdefault(c.LOG_JOB_ID, job_id)
    return fields
