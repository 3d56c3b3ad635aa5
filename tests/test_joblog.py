"""Job end lines: made on the log handler's thread without a record where that record would
reach the JSON lines handler alone, and through ``logging`` wherever anything else would see it.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any, cast

import pytest
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, TraceFlags

from workerpool.constants import Label
from workerpool.telemetry import handler as handler_module
from workerpool.telemetry import joblog
from workerpool.telemetry.handler import BackgroundHandler
from workerpool.telemetry.joblog import JobLog
from workerpool.telemetry.logs import json_lines_alone, setup_logging
from workerpool.worker.run import Run, Settled
from workerpool.worker.together import one_round

_JOBS = logging.getLogger("workerpool.jobs")
_LOGGED_AT = 1_790_000_000.123456
# What ``setup_logging`` turns off for every record of the process.
_RECORD_FLAGS = ("logThreads", "logProcesses", "logMultiprocessing")
_TRACED = SpanContext(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, False, TraceFlags(1))


@dataclass
class _Ran:
    """What an end line reads of a run."""

    span: Span
    started_at: float


def _events() -> list[Settled]:
    ran = cast(Run, _Ran(NonRecordingSpan(_TRACED), time.monotonic() - 0.25))
    untraced = cast(Run, _Ran(trace.INVALID_SPAN, time.monotonic()))
    return [
        Settled(Label.DONE, "t.ok", "id-1", "m-1", 1, ran),
        Settled(Label.DEAD_LETTERED, "t.bad", "id-2", "m-2", 5, untraced, "ValueError"),
        Settled(Label.DEFERRED, "t.wait", "id-3", "m-3", 4, ran, renewed=True),
        # a message that never ran, whose job name and id came from a hostile payload
        Settled(Label.DEAD_LETTERED, '"q\\\ud800', "\n}{", "m-4", 1, None, "BadJson"),
        Settled(Label.RETRIED, "", "", "m-5", 2, untraced),
    ]


@contextlib.contextmanager
def _worker_logging() -> Iterator[io.StringIO]:
    """The worker's JSON lines handler, alone on the root logger meanwhile (pytest's own
    capture handlers taken off and put back)."""
    root = logging.getLogger()
    others, level = list(root.handlers), root.level
    flags = {name: getattr(logging, name) for name in _RECORD_FLAGS}
    installed = handler_module.installed_handler()
    for other in others:
        root.removeHandler(other)
    stream = io.StringIO()
    handler = setup_logging(stream=stream, json_lines=True)
    try:
        yield stream
    finally:
        root.removeHandler(handler)
        handler.close()
        for other in others:
            root.addHandler(other)
        root.setLevel(level)
        for name, value in flags.items():
            setattr(logging, name, value)
        handler_module._installed = installed


def _no_record(*args: object) -> logging.LogRecord:
    raise AssertionError("an end line's record was made")


def _passes(record: logging.LogRecord) -> bool:
    return True


def _log(events: list[Settled], stream: io.StringIO) -> list[dict[str, Any]]:
    job_log = JobLog()
    written = len(stream.getvalue().splitlines())
    for event in events:
        job_log.settled(event)
    handler = logging.getLogger().handlers[0]
    handler.flush()
    return [json.loads(line) for line in stream.getvalue().splitlines()[written:]]


def test_end_lines_made_without_a_record_read_as_those_made_with_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events = _events()
    with _worker_logging() as stream:
        # Given the worker's JSON lines handler alone, so end lines are made without a record
        # (one made would fail), at a time the settling thread reads
        assert json_lines_alone(_JOBS, logging.INFO) is not None
        with monkeypatch.context() as patched:
            patched.setattr(joblog, "_record", _no_record)
            patched.setattr(joblog, "time", SimpleNamespace(time=lambda: _LOGGED_AT))
            # When the end lines of runs, failures and messages that never ran are logged,
            # within a span of the settling thread's own
            with trace.use_span(NonRecordingSpan(_TRACED)):
                made = _log(events, stream)
        # and the same again through logging (a filter on the logger, passing everything)
        _JOBS.addFilter(_passes)
        try:
            assert json_lines_alone(_JOBS, logging.INFO) is None
            with trace.use_span(NonRecordingSpan(_TRACED)):
                recorded = _log(events, stream)
        finally:
            _JOBS.removeFilter(_passes)
        text = stream.getvalue()
    # Then the lines are the same but for their time, which is when each was logged
    assert len(made) == len(events)
    times = {line.pop("time") for line in made}
    for line in recorded:
        line.pop("time")
    assert made == recorded
    assert times == {datetime.fromtimestamp(_LOGGED_AT, UTC).isoformat(timespec="microseconds")}
    # and they say what each event was: a failure as a warning, the trace of its run (or, for
    # a message that never ran, the settling thread's), the hostile text escaped
    assert [line["severity"] for line in made] == ["INFO", "WARNING", "INFO", "WARNING", "WARNING"]
    assert made[0]["duration"] >= 0.25 and made[0]["message"].startswith("job t.ok done in 0.2")
    assert made[1]["error_type"] == "ValueError" and made[2]["renewed"] is True
    assert (made[3]["job"], made[3]["job_id"]) == (events[3].job, events[3].job_id)
    text.encode()  # (a lone surrogate is written escaped: every line encodes)
    assert made[3]["duration"] is None and made[4]["message"] == "job ? retried in 0.000s"
    spans = [line.get("logging.googleapis.com/spanId") for line in made]
    assert spans == ["b7ad6b7169203331", None, "b7ad6b7169203331", "b7ad6b7169203331", None]


class _Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _on_jobs_logger(keep: _Keep) -> Callable[[], None]:
    _JOBS.addHandler(keep)
    return lambda: _JOBS.removeHandler(keep)


def _on_root(keep: _Keep) -> Callable[[], None]:
    logging.getLogger().addHandler(keep)
    return lambda: logging.getLogger().removeHandler(keep)


def _filter_on_the_handler(keep: _Keep) -> Callable[[], None]:
    handler = logging.getLogger().handlers[0]

    def filtered(record: logging.LogRecord) -> bool:
        keep.records.append(record)
        return True

    handler.addFilter(filtered)
    return lambda: handler.removeFilter(filtered)


def _record_factory(keep: _Keep) -> Callable[[], None]:
    factory = logging.getLogRecordFactory()

    def making(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = factory(*args, **kwargs)
        keep.records.append(record)
        return record

    logging.setLogRecordFactory(making)
    return lambda: logging.setLogRecordFactory(factory)


def _dispatch_patched(keep: _Keep, *, passing: bool = False) -> Callable[[], None]:
    """``Logger.callHandlers`` wrapped as an error tracker's logging integration does; if
    ``passing``, by a wrapper that copies the name and module of what it wraps."""
    original = logging.Logger.callHandlers

    def call_handlers(self: logging.Logger, record: logging.LogRecord) -> None:
        keep.records.append(record)
        original(self, record)

    wrapper = functools.wraps(original)(call_handlers) if passing else call_handlers
    logging.Logger.callHandlers = wrapper  # type: ignore[method-assign]
    return lambda: setattr(logging.Logger, "callHandlers", original)


def _dispatch_patched_on_the_logger(keep: _Keep) -> Callable[[], None]:
    original = _JOBS.handle

    def handle(record: logging.LogRecord) -> None:
        keep.records.append(record)
        original(record)

    _JOBS.handle = handle  # type: ignore[method-assign]
    return lambda: delattr(_JOBS, "handle")


@pytest.mark.parametrize(
    "watch",
    [
        _on_jobs_logger,
        _on_root,
        _filter_on_the_handler,
        _record_factory,
        _dispatch_patched,
        functools.partial(_dispatch_patched, passing=True),
        _dispatch_patched_on_the_logger,
    ],
)
def test_end_lines_go_through_logging_wherever_anything_else_would_see_them(
    watch: Callable[[_Keep], Callable[[], None]],
) -> None:
    keep = _Keep()
    with _worker_logging() as stream:
        # Given something of the application's that sees the records of end lines
        unwatch = watch(keep)
        try:
            # When end lines are logged
            lines = _log(_events(), stream)
        finally:
            unwatch()
    # Then it saw each one's record, and the JSON lines handler still wrote each line
    assert [r.getMessage().split()[1] for r in keep.records] == ["t.ok", "t.bad", "t.wait",
                                                                 '"q\\\ud800', "?"]  # fmt: skip
    assert [line["job_id"] for line in lines] == ["id-1", "id-2", "id-3", "\n}{", ""]


def test_end_lines_of_a_level_the_handler_drops_are_not_made() -> None:
    with _worker_logging() as stream:
        # Given a handler that writes warnings and above
        logging.getLogger().handlers[0].setLevel(logging.WARNING)
        # When end lines of both levels are logged
        lines = _log(_events(), stream)
    # Then only the failures' were written
    assert [line["outcome"] for line in lines] == ["dead_lettered", "dead_lettered", "retried"]


def test_a_line_that_cannot_be_made_is_reported_by_its_maker_never_what_it_holds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Given a line whose making fails, holding something private
    def fails(secret: str) -> str:
        raise ValueError("no line")

    with _worker_logging() as stream:
        handler = logging.getLogger().handlers[0]
        assert isinstance(handler, BackgroundHandler)
        # When it is written, then a good line
        handler.emit_line(functools.partial(fails, "someone@example.com"))
        handler.emit_line(lambda: '{"message": "after"}')
        handler.flush()
        written = stream.getvalue()
    # Then the error names the maker, not what it holds, and the next line is still written
    reported = capsys.readouterr().err
    assert "ValueError: no line" in reported and "a line made by" in reported
    assert "fails" in reported and "someone@example.com" not in reported
    assert written == '{"message": "after"}\n'


def test_the_end_lines_of_a_round_reach_the_handler_in_one_hand_off() -> None:
    events = _events()
    with _worker_logging() as stream:
        handler = logging.getLogger().handlers[0]
        assert isinstance(handler, BackgroundHandler)
        handed: list[Callable[[], str]] = []
        emit_line = handler.emit_line

        def counted(make: Callable[[], str]) -> None:
            handed.append(make)
            emit_line(make)

        handler.emit_line = counted  # type: ignore[method-assign]
        # When a round of settlements logs its end lines (as the completions thread settles
        # a recorded batch)
        job_log = JobLog()
        with one_round():
            for event in events:
                job_log.settled(event)
            assert handed == []  # (nothing is handed over before the round ends)
        handler.flush()
        lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    # Then they were handed to the handler's thread once, and written in order
    assert len(handed) == 1
    assert [line["job_id"] for line in lines] == [event.job_id for event in events]


def test_a_line_of_a_round_that_cannot_be_made_leaves_the_others_written(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    events = _events()
    json_line = joblog._json_line

    def fails_on_the_second(*parts: Any) -> str:
        if parts[2] is events[1]:
            raise ValueError("no line")
        return json_line(*parts)

    monkeypatch.setattr(joblog, "_json_line", fails_on_the_second)
    with _worker_logging() as stream:
        # When a round's lines are made and one of them fails
        with one_round():
            for event in events:
                JobLog().settled(event)
        logging.getLogger().handlers[0].flush()
        lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    # Then every other line is written, and the error names what made the line
    assert [line["job_id"] for line in lines] == ["id-1", "id-3", "\n}{", ""]
    reported = capsys.readouterr().err
    assert "ValueError: no line" in reported and "a line made by" in reported
    assert "fails_on_the_second" in reported
