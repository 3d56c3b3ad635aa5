"""Short log lines for a person at a terminal, written through a rich ``Console``.

A job's line reads ``12:04:05.123 INFO    demo.sleep sleep-3 done 0.412s``: its job, job id,
outcome (coloured) and duration, then an error type, a later attempt or a renewal when there is
one. Any other line is its time, level and message, then those of its fields whose values the
message does not already show. The console decides colour: on a terminal or with
``FORCE_COLOR``, never with ``NO_COLOR``. Lines only take colours, no bold or dim, so that
``NO_COLOR`` leaves plain text. ``setup_logging`` picks this handler once, at start, and only
for text: the JSON lines never pass through here.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from typing import Any, TextIO

from rich.console import Console
from rich.text import Text

from workerpool import constants as c
from workerpool.constants import Label
from workerpool.telemetry.handler import (
    BackgroundHandler,
    Line,
    formatted,
    installed_handler,
    record_fields,
)
from workerpool.worker.text import safe_text

_OUTCOME_STYLES: dict[str, str] = {
    Label.DONE: "green",
    Label.RETRIED: "yellow",
    Label.DEAD_LETTERED: "red",
    Label.ACK_FAILED: "red",
    Label.DEFERRED: "blue",
    Label.SCHEDULED: "blue",
    Label.DUPLICATE: "cyan",
    Label.DRAINED: "magenta",
    Label.RELEASED: "magenta",
    Label.CANCELLED: "magenta",
}
_LEVEL_STYLES = {
    "DEBUG": "bright_black",
    "INFO": "blue",
    "WARNING": "yellow",
    "ERROR": "red",
    "CRITICAL": "bright_red",
}
_TIME_STYLE = "bright_black"
_STARTED = "started"  # a job's start line (DEBUG) has no outcome yet


class TextFormatter(logging.Formatter):
    """A record as a short styled ``Text`` (``text``), or as plain text (``format``)."""

    def text(self, record: logging.LogRecord) -> Text:
        when = datetime.fromtimestamp(record.created).strftime("%H:%M:%S")
        line = Text()
        line.append(f"{when}.{int(record.msecs):03d} ", style=_TIME_STYLE)
        line.append(f"{record.levelname:<8}", style=_LEVEL_STYLES.get(record.levelname, ""))
        fields = record_fields(record)
        if c.LOG_JOB in fields and c.LOG_JOB_ID in fields:
            _job_line(line, fields)
        else:
            message = record.getMessage()
            line.append(safe_text(message))
            shown = " ".join(
                f"{key}={_value(value)}"
                for key, value in fields.items()
                if _value(value) not in message
            )
            if shown:
                line.append(f"  {safe_text(shown)}", style=_TIME_STYLE)
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            line.append(f"\n{safe_text(record.exc_text)}")
        return line

    def format(self, record: logging.LogRecord) -> str:
        return self.text(record).plain


def _job_line(line: Text, fields: dict[str, Any]) -> None:
    """A job's start or end line: what ran and how it ended, each value once, no names."""
    outcome = str(fields.get(c.LOG_OUTCOME) or _STARTED)
    line.append(safe_text(f"{fields[c.LOG_JOB] or '?'} {fields[c.LOG_JOB_ID]} "))
    line.append(outcome, style=_OUTCOME_STYLES.get(outcome, ""))
    duration = fields.get(c.LOG_DURATION)
    if duration is not None:
        line.append(f" {duration:.3f}s")
    extras = [str(fields[c.LOG_ERROR_TYPE])] if fields.get(c.LOG_ERROR_TYPE) else []
    attempt = fields.get(c.LOG_ATTEMPT)
    if isinstance(attempt, int) and attempt > 1:
        extras.append(f"attempt {attempt}")
    if fields.get(c.LOG_RENEWED):
        extras.append("renewed")
    if extras:
        line.append(safe_text("  " + " ".join(extras)), style=_TIME_STYLE)


def _value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    text = str(value)
    return json.dumps(text) if not text or any(ch.isspace() for ch in text) else text


def make_console(stream: TextIO) -> Console:
    """A console writing ``stream`` as it is: no markup, emoji or highlighting read into the
    text, long lines left to the terminal to wrap, and in a notebook still to ``stream``."""
    return Console(
        file=stream,
        markup=False,
        emoji=False,
        highlight=False,
        soft_wrap=True,
        force_jupyter=False,
    )


class ConsoleHandler(BackgroundHandler):
    """``BackgroundHandler`` whose thread prints styled lines through a rich ``Console``: a live
    display on the same console (``live_console``) keeps itself below them."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__(stream)
        self.console = make_console(stream)
        self._formatter = TextFormatter()
        self.setFormatter(self._formatter)

    def _write_lines(self, lines: list[Line]) -> None:
        texts = formatted(lines, self._text, self.failed)
        if texts:
            self.console.print(Text("\n").join(texts))

    def _text(self, line: Line) -> Text:
        if isinstance(line, logging.LogRecord):
            return self._formatter.text(line)
        return Text(line())  # made by its caller: shown as it is


def live_console() -> Console | None:
    """The console the log lines go to when it is a terminal, for a live display to share."""
    handler = installed_handler()
    if isinstance(handler, ConsoleHandler) and handler.console.is_terminal:
        return handler.console
    return None
