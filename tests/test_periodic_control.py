"""Operating periodic schedules, in process: list, pause, resume, trigger and backfill on the
marks the fleet shares, and the commands' one-line refusals (the emulator test runs them
against real workers)."""

from __future__ import annotations

from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from click.testing import CliRunner, Result

from tests.test_periodic_firing import HOUR, NOW, hourly
from workerpool.cli import main
from workerpool.errors import ConfigError
from workerpool.periodic import MemoryMarks, Periodic, SqliteMarks, Ticks
from workerpool.periodic.control import Control
from workerpool.periodic.marks import PUBLISHED, REQUESTED, Mark, Pause

CONFIG = """
[worker]
jobs = ["workerpool_jobs.demo"]

[[schedules]]
name = "hourly"
job = "demo.echo"
every = "1h"

[[schedules]]
name = "nightly"
job = "demo.echo"
cron = "0 2 * * *"
timezone = "Asia/Tokyo"
"""


def _control(marks: MemoryMarks, now: float = NOW + 60) -> Control:
    nightly = Periodic("n", "demo.echo", Ticks(ZoneInfo("UTC"), "0 2 * * *"))
    return Control([hourly(), nightly], marks, clock=lambda: now)


def test_backfill_marks_each_tick_in_the_range_once() -> None:
    # Given the tick 3 hours ago fired already
    marks = MemoryMarks()
    marks.mark("h", NOW - 3 * HOUR, NOW - 3 * HOUR)
    control = _control(marks)
    # When the last ten hours are backfilled, both ends included, twice
    span = ("2027-01-14T22:00:00Z", "2027-01-15T07:00:00Z")  # NOW - 10 h .. NOW - 1 h
    assert control.backfill("h", *span) == (9, 1)
    assert control.backfill("h", *span) == (0, 10)
    # Then each tick not fired is marked for the next worker to publish at once
    requested = [m for m in marks.unpublished(1.0)]
    assert sorted(m.tick for m in requested) == [NOW - h * HOUR for h in range(10, 0, -1) if h != 3]
    assert {m.marked_at for m in requested} == {REQUESTED}


def test_trigger_marks_a_run_now_under_a_job_id_no_tick_has() -> None:
    marks = MemoryMarks()
    # On a whole second (where a tick could fall), and off it
    assert _control(marks).trigger("h") == "periodic:h:2027-01-15T08:01:00.001Z"
    assert _control(marks, NOW + 60.25).trigger("h") == "periodic:h:2027-01-15T08:01:00.250Z"
    assert marks.unpublished(1.0) == [
        Mark("h", NOW + 60.001, REQUESTED), Mark("h", NOW + 60.25, REQUESTED)
    ]  # fmt: skip


def test_pause_and_resume_are_records_and_list_shows_them() -> None:
    marks = MemoryMarks()
    control = _control(marks)
    control.pause("h", True)
    assert marks.pauses() == {"h": Pause(True, NOW + 60)}
    marks.mark("h", NOW, NOW)
    marks.published("h", NOW, 0)
    rows = {row.schedule.name: row for row in control.rows()}
    assert (rows["h"].next_tick, rows["h"].last_tick, rows["h"].paused) == (NOW + HOUR, NOW, True)
    assert str(rows["h"]).endswith("next 2027-01-15T09:00:00Z  last 2027-01-15T08:00:00Z "
                                   "published  paused")  # fmt: skip
    assert str(rows["n"]).endswith("last never  active") and "cron '0 2 * * *'" in str(rows["n"])
    control.pause("h", False)
    assert not control.rows()[0].paused and marks.latest("h") == (NOW, PUBLISHED)


@pytest.mark.parametrize(("call", "says"), [
    (lambda c: c.pause("nope", True), "no periodic schedule 'nope' (declared: h, n)"),
    (lambda c: c.backfill("h", "2027-01-15T07:00:00Z", "2027-01-15T06:00:00Z"), "--to comes"),
    (lambda c: c.backfill("h", "2027-01-15T07:00:00Z", "2027-01-16T06:00:00Z"), "the future"),
    (lambda c: c.backfill("h", "2026-01-01T00:00:00Z", "2027-01-15T06:00:00Z"), "than 1000"),
    (lambda c: c.backfill("h", "yesterday", "2027-01-15T06:00:00Z"), "--from: 'yesterday'"),
])  # fmt: skip
def test_bad_input_is_refused(call: object, says: str) -> None:
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        call(_control(MemoryMarks()))  # type: ignore[operator]


def _cli(tmp_path: Path, *args: str, store: str = "") -> Result:
    config = tmp_path / "workerpool.toml"
    config.write_text(CONFIG)
    store = store or f"sqlite:///{tmp_path}/fleet.db"
    return CliRunner().invoke(main, [*args, "--config", str(config), "--idempotency-store", store])


def test_the_commands_on_a_shared_store(tmp_path: Path) -> None:
    # Given a config with two schedules, when one is paused, triggered and backfilled
    assert _cli(tmp_path, "schedule", "pause", "nightly").output == "nightly: paused\n"
    triggered = _cli(tmp_path, "schedule", "trigger", "hourly")
    assert triggered.output.startswith("hourly: triggered periodic:hourly:"), triggered.output
    backfill = ["schedule", "backfill", "hourly", "--from", "2026-01-01T00:00:00Z",
                "--to", "2026-01-01T09:00:00Z"]  # fmt: skip
    assert _cli(tmp_path, *backfill).output == "hourly: 10 tick(s) to fire, 0 fired already\n"
    assert _cli(tmp_path, *backfill).output == "hourly: 0 tick(s) to fire, 10 fired already\n"
    # Then the store the workers share holds it all, and list shows the schedules
    marks = SqliteMarks(tmp_path / "fleet.db")
    assert len(marks.unpublished(1.0)) == 11 and marks.pauses()["nightly"].paused
    marks.close()
    listed = _cli(tmp_path, "schedule", "list").output.splitlines()
    assert listed[0] == "0 delayed job(s)" and listed[-1] == "2 periodic schedule(s)"
    assert listed[1].startswith("hourly  demo.echo  every 3600s  UTC  next ")
    assert listed[2].startswith("nightly  demo.echo  cron '0 2 * * *'  Asia/Tokyo  next ")
    assert listed[2].endswith("last never  paused") and "not published yet" in listed[1]
    assert _cli(tmp_path, "schedule", "resume", "nightly").output == "nightly: resumed\n"


@pytest.mark.parametrize("command", ["pause", "resume", "trigger"])
def test_a_store_no_worker_sees_is_refused_not_written(tmp_path: Path, command: str) -> None:
    # memory:// is the command's own: what it wrote there no worker would ever see
    result = _cli(tmp_path, "schedule", command, "hourly", store="memory://")
    assert result.exit_code == 2
    assert result.output == (
        "workerpool: error: idempotency_store memory://: no other process can see its ticks "
        "and pauses\n"
    )


@pytest.mark.parametrize("command", ["pause", "resume", "trigger", "backfill"])
def test_an_unknown_schedule_is_one_line_and_exit_2(tmp_path: Path, command: str) -> None:
    extra = ["--from", "2026-01-01T00:00:00Z", "--to", "2026-01-01T01:00:00Z"]
    extra = extra if command == "backfill" else []
    result = _cli(tmp_path, "schedule", command, "hourlly", *extra)
    assert result.exit_code == 2
    assert result.output == (
        "workerpool: error: no periodic schedule 'hourlly' (declared: hourly, nightly)\n"
    )
