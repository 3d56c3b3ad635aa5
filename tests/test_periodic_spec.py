"""Periodic schedules as declared in the config: what is taken, and one line for a mistake."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.commands import run_command
from workerpool.config import Settings, load_settings
from workerpool.errors import ConfigError
from workerpool.periodic import with_jobs
from workerpool.registry import Registry

GOOD = """
[[schedules]]
name = "billing-export"
job = "billing.export"
cron = "0 2 * * *"
timezone = "Asia/Tokyo"
payload = { region = "jp" }
catch_up = "all"
catch_up_window = "2h"
overlap = "skip"
overlap_unclaimed = "2m"

[[schedules]]
name = "segments"
job = "segments.refresh"
every = "30s"
"""


def _load(tmp_path: Path, text: str) -> Settings:
    config = tmp_path / "workerpool.toml"
    config.write_text(text)
    return load_settings(str(config), env={})


def test_schedules_are_read_with_their_defaults(tmp_path: Path) -> None:
    billing, segments = _load(tmp_path, GOOD).schedules
    assert (billing.name, billing.job, dict(billing.payload)) == (
        "billing-export", "billing.export", {"region": "jp"}
    )  # fmt: skip
    assert (billing.catch_up, billing.catch_up_window, billing.overlap) == ("all", 7200.0, "skip")
    assert (billing.overlap_unclaimed, segments.overlap_unclaimed) == (120.0, 600.0)
    # 02:00 in Tokyo is 17:00 UTC the day before.
    assert billing.ticks.after(0) == 17 * 3600
    assert billing.job_id(17 * 3600) == "periodic:billing-export:1970-01-01T17:00:00.000Z"
    assert (segments.ticks.every, segments.catch_up, segments.overlap) == (30, "latest", "allow")
    assert str(segments.ticks.timezone) == "UTC"


_MISTAKES = [
    ('cron = "0 25 * * *"', "schedule 'x' (from {path}): cron '0 25 * * *': "),
    ('cron = "* * *"', "schedule 'x' (from {path}): cron '* * *' has 3 fields, not 5"),
    ('cron = "* * * * *"\ntimezone = "Mars/Olympus"',
     "schedule 'x' (from {path}): unknown timezone 'Mars/Olympus' (an IANA name)"),
    ('every = "1s"\ncron = "* * * * *"', "schedule 'x' (from {path}): give either cron or every"),
    ('every = "0.5s"', "schedule 'x' (from {path}): every must be a whole number of seconds"),
    ('every = "1s"\ncatch_up = "some"', "schedule 'x' (from {path}): catch_up must be one of"),
    ('every = "1s"\novrelap = "skip"', "schedule 'x' (from {path}): unknown setting ovrelap"),
    ('every = "1s"\noverlap = "bufer_one"',
     "schedule 'x' (from {path}): overlap must be one of skip, allow, buffer_one"),
]  # fmt: skip


@pytest.mark.parametrize(("lines", "message"), _MISTAKES)
def test_a_bad_schedule_is_one_line_naming_it(tmp_path: Path, lines: str, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        _load(tmp_path, f'[[schedules]]\nname = "x"\njob = "j"\n{lines}\n')
    text = str(error.value)
    assert text.startswith(message.format(path=tmp_path / "workerpool.toml")), text
    assert "\n" not in text


def test_a_name_declared_twice_is_refused(tmp_path: Path) -> None:
    twice = GOOD.replace('name = "segments"', 'name = "billing-export"')
    with pytest.raises(ConfigError, match=r"schedule 'billing-export' .* is declared twice"):
        _load(tmp_path, twice)


def test_the_worker_stops_with_exit_2_on_a_bad_schedule(tmp_path: Path) -> None:
    # Given a config whose schedule has an unknown timezone, when the worker starts, then exit 2.
    config = tmp_path / "workerpool.toml"
    config.write_text('[[schedules]]\nname = "x"\njob = "j"\ncron = "* * * * *"\ntimezone = "X"\n')
    result = run_command("run", "--config", str(config), "--project", "p", "--subscription", "s")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"workerpool: error: schedule 'x' (from {config}): unknown timezone 'X' (an IANA name)"
    ]


def test_job_schedules_join_the_config_and_every_job_is_checked(tmp_path: Path) -> None:
    jobs = Registry()

    @jobs.job("segments.refresh", schedule="*/5 * * * *")
    def refresh(ctx: object, payload: dict[str, object]) -> None: ...

    @jobs.job("billing.export")
    def export(ctx: object, payload: dict[str, object]) -> None: ...

    declared = _load(tmp_path, GOOD.replace("segments.refresh", "billing.export"))
    crons = {spec.name: spec.options.get("schedule") for spec in jobs.specs()}
    schedules = with_jobs(declared.schedules, crons)
    assert [s.name for s in schedules] == ["billing-export", "segments", "segments.refresh"]
    assert schedules[-1].ticks.after(0) == 300 and schedules[-1].catch_up == "latest"
    # Given a schedule naming a job no module registered, then one line naming both
    with pytest.raises(ConfigError, match="schedule 'segments': no job 'nope' is registered"):
        with_jobs(_load(tmp_path, GOOD.replace("segments.refresh", "nope")).schedules, crons)
    with pytest.raises(
        ConfigError, match=r"'segments.refresh' is declared twice \(config and @job"
    ):
        with_jobs(
            _load(tmp_path, GOOD.replace('"segments"', '"segments.refresh"')).schedules, crons
        )


def test_a_bad_cron_on_a_job_fails_at_registration() -> None:
    with pytest.raises(ValueError, match="job 'j': cron '61 \\* \\* \\* \\*'"):
        Registry().job("j", schedule="61 * * * *")


POOLS = """
[[pools]]
subscription = "reports-sub"
[[pools]]
subscription = "billing-sub"
[[schedules]]
name = "reports"
job = "j"
every = "1h"
[[schedules]]
name = "billing"
job = "j"
every = "1h"
pool = "{pool}"
"""


def test_each_pool_fires_the_schedules_that_name_it_the_first_the_others(tmp_path: Path) -> None:
    settings = _load(tmp_path, POOLS.format(pool="billing-sub"))
    fired = [[s.name for s in pool.schedules] for pool in settings.pool_settings()]
    assert fired == [["reports"], ["billing"]]


def test_a_schedule_naming_no_pool_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as error:
        _load(tmp_path, POOLS.format(pool="biling-sub"))
    assert str(error.value) == (
        "schedule 'billing': pool 'biling-sub' is not the subscription of a pool "
        "(reports-sub, billing-sub)"
    )
