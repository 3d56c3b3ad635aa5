"""Log lines for a terminal: short, each value once, coloured only where the console allows."""

from __future__ import annotations

import io
import logging
import re
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
from click.testing import CliRunner

from workerpool import constants as c
from workerpool.cli import main
from workerpool.errors import ConfigError
from workerpool.telemetry.handler import BackgroundHandler, installed_handler
from workerpool.telemetry.logs import setup_logging
from workerpool.telemetry.textlog import ConsoleHandler, TextFormatter, live_console

_JOB_FIELDS = {
    c.LOG_JOB: "demo.sleep",
    c.LOG_JOB_ID: "sleep-3",
    c.LOG_MESSAGE_ID: "1234567",
    c.LOG_ATTEMPT: 1,
    c.LOG_DURATION: 0.412345,
    c.LOG_OUTCOME: "done",
}


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _record(message: str, level: int = logging.INFO, **fields: Any) -> logging.LogRecord:
    record = logging.LogRecord("workerpool.jobs", level, __file__, 7, message, (), None)
    record.fields = fields
    return record


def _clock(record: logging.LogRecord) -> str:
    return datetime.fromtimestamp(record.created).strftime("%H:%M:%S.") + f"{int(record.msecs):03d}"


@pytest.fixture
def terminal_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "WORKERPOOL_LOG_FORMAT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")


@pytest.fixture
def logging_restored() -> Iterator[None]:
    root = logging.getLogger()
    level = root.level
    yield
    root.removeHandler(setup_logging(stream=io.StringIO(), json_lines=True))
    root.setLevel(level)


def _written(stream: io.StringIO, *records: logging.LogRecord) -> str:
    handler = ConsoleHandler(stream)
    for record in records:
        handler.handle(record)
    handler.close()
    return stream.getvalue()


def test_a_job_line_is_time_level_job_id_outcome_duration_without_names() -> None:
    # Given a job's end line with its structured fields
    record = _record("job demo.sleep done in 0.412s", **_JOB_FIELDS)
    # When it is formatted as text, Then each value shows once, with no key=value pairs
    assert (
        TextFormatter().format(record) == f"{_clock(record)} INFO    demo.sleep sleep-3 done 0.412s"
    )


def test_a_failed_job_line_adds_its_error_type_and_attempt() -> None:
    # Given a dead-lettered job on its third attempt
    fields = {**_JOB_FIELDS, c.LOG_OUTCOME: "dead_lettered", c.LOG_ATTEMPT: 3}
    record = _record("job x", logging.WARNING, **fields, error_type="permanent_error")
    # Then its line says so after the duration
    assert (
        TextFormatter()
        .format(record)
        .endswith("WARNING demo.sleep sleep-3 dead_lettered 0.412s  permanent_error attempt 3")
    )


def test_a_job_start_line_says_started() -> None:
    # Given a job's start line (DEBUG): no outcome or duration yet
    fields = {k: v for k, v in _JOB_FIELDS.items() if k not in (c.LOG_OUTCOME, c.LOG_DURATION)}
    record = _record("job demo.sleep started", logging.DEBUG, **fields)
    # Then it names the job and says it started
    assert TextFormatter().format(record) == f"{_clock(record)} DEBUG   demo.sleep sleep-3 started"


def test_other_lines_show_only_the_fields_their_message_does_not() -> None:
    # Given a line whose message names one of its two fields
    record = _record(
        "pulling projects/p/subscriptions/s", subscription="projects/p/subscriptions/s"
    )
    record.fields["prefetch"] = 2
    # Then the named field is left out and the other follows the message
    assert TextFormatter().format(record) == (
        f"{_clock(record)} INFO    pulling projects/p/subscriptions/s  prefetch=2"
    )


@pytest.mark.usefixtures("terminal_env")
def test_outcomes_are_coloured_on_a_terminal_only() -> None:
    # Given a done and a dead-lettered job line
    done = _record("job done", **_JOB_FIELDS)
    failed = _record("job failed", logging.WARNING, **{**_JOB_FIELDS, "outcome": "dead_lettered"})
    # When they are written to a terminal, Then the outcomes are green and red
    on_tty = _written(_Tty(), done, failed)
    assert "\x1b[32mdone\x1b[0m" in on_tty and "\x1b[31mdead_lettered\x1b[0m" in on_tty
    # When they are written to a pipe, Then there is no control code at all
    piped = _written(io.StringIO(), done, failed)
    assert "\x1b" not in piped
    assert re.sub(r"\x1b\[[0-9;]*m", "", on_tty) == piped


def test_force_color_colours_a_pipe_and_no_color_wins_on_a_terminal(
    terminal_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    done = _record("job done", **_JOB_FIELDS)
    # Given FORCE_COLOR, When a line is written to a pipe, Then it is coloured
    monkeypatch.setenv("FORCE_COLOR", "1")
    assert "\x1b[32mdone" in _written(io.StringIO(), done)
    # Given NO_COLOR, When a line is written to a terminal, Then it is plain text
    monkeypatch.delenv("FORCE_COLOR")
    monkeypatch.setenv("NO_COLOR", "1")
    assert "\x1b" not in _written(_Tty(), done)


def test_lines_with_lone_surrogates_and_markup_are_written_as_they_are() -> None:
    # Given a message with a lone surrogate, rich markup and an emoji code
    record = _record("field \ud800 [red]x[/red] :smile:", subscription="s")
    # When it is written, Then it encodes, with the text as logged
    written = _written(io.StringIO(), record)
    written.encode("utf-8")
    assert "field \\ud800 [red]x[/red] :smile:" in written


@pytest.mark.usefixtures("terminal_env", "logging_restored")
def test_the_format_follows_the_terminal_and_a_live_display_gets_its_console(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a terminal, When logging is set up, Then lines are text and its console is live
    handler = setup_logging(stream=_Tty())
    assert isinstance(handler, ConsoleHandler)
    assert live_console() is handler.console
    # Given a pipe, Then lines are JSON on the plain handler, and nothing is live
    handler = setup_logging(stream=io.StringIO())
    assert type(handler) is BackgroundHandler and live_console() is None
    # Given text chosen on a pipe, Then lines are text but no live display draws on it
    assert isinstance(setup_logging(stream=io.StringIO(), json_lines=False), ConsoleHandler)
    assert live_console() is None
    monkeypatch.setenv("WORKERPOOL_LOG_FORMAT", "text")
    assert isinstance(setup_logging(stream=io.StringIO()), ConsoleHandler)


@pytest.mark.usefixtures("terminal_env", "logging_restored")
def test_a_bad_log_format_is_one_line_and_exit_2(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given WORKERPOOL_LOG_FORMAT set to neither json nor text
    monkeypatch.setenv("WORKERPOOL_LOG_FORMAT", "xml")
    # When logging is set up, Then it is a configuration error naming the variable
    with pytest.raises(ConfigError, match="WORKERPOOL_LOG_FORMAT must be json or text, not 'xml'"):
        setup_logging(stream=io.StringIO())
    # When the command starts, Then it says so in one line and exits 2
    result = CliRunner().invoke(main, ["jobs"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "workerpool: error: WORKERPOOL_LOG_FORMAT must be json or text, not 'xml'"
    ]


@pytest.mark.usefixtures("terminal_env", "logging_restored")
def test_log_format_option_overrides_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given WORKERPOOL_LOG_FORMAT=json, When run is given --log-format text (and no project)
    monkeypatch.setenv("WORKERPOOL_LOG_FORMAT", "json")
    result = CliRunner().invoke(main, ["run", "--log-format", "text", "--subscription", "s"])
    # Then its lines were text (the run itself stops at the missing project)
    assert result.exit_code == 2, result.output
    assert isinstance(installed_handler(), ConsoleHandler)


def test_json_lines_never_load_the_text_path() -> None:
    # Given a fresh process, When it logs JSON lines, Then rich was never imported
    script = (
        "import io, logging, sys\n"
        "from workerpool.telemetry.logs import setup_logging\n"
        "setup_logging(stream=io.StringIO()).flush()\n"
        "logging.getLogger('t').info('line')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('rich', 'pygments')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "[]", result.stderr


def test_a_line_made_by_its_caller_is_printed_as_it_is_between_records() -> None:
    # Given the console handler
    stream = io.StringIO()
    handler = ConsoleHandler(stream)
    # When a line made by its caller comes between two records
    handler.handle(_record("before"))
    handler.emit_line(lambda: "made [bold]as is[/bold]")
    handler.handle(_record("after"))
    handler.close()
    # Then it is printed in its turn, as it is (not read as markup)
    lines = stream.getvalue().splitlines()
    assert [line.split("  ")[-1].strip() for line in lines] == [
        "before",
        "made [bold]as is[/bold]",
        "after",
    ]
