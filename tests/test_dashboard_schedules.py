"""The Schedules page of a real ``workerpool dashboard`` process shows and operates the
schedules declared on ``@job`` in the job modules it is given (``--jobs``, or the config's
``jobs``), as ``workerpool run`` fires them, beside the config's ``[[schedules]]``."""

from __future__ import annotations

import contextlib
import re
import urllib.parse
import urllib.request
from pathlib import Path

from tests.commands import run_command
from tests.support import dashboard_process, http_get
from workerpool.periodic import marks_opener

TOKEN = "sesame"
CONFIG = """
[worker]
project = "p"
subscription = "jobs"
idempotency_store = "{store}"

[[schedules]]
name = "hourly"
job = "demo.echo"
every = "1h"
"""


def _dashboard(config: Path, log: Path, *args: str) -> contextlib.AbstractContextManager[str]:
    return dashboard_process(config, log, "--token", TOKEN, *args)


def _shown(url: str) -> dict[str, str]:
    """Each schedule on the page: its job."""
    page = http_get(url + "/schedules")[1]
    return dict(re.findall(r'<tr data-schedule="([^"]+)"><td>[^<]*</td><td>([^<]*)</td>', page))


def _pause(url: str, name: str) -> str:
    """Pause ``name`` from the page's form, confirmed: the result page."""
    with urllib.request.urlopen(url + "/schedules") as response:
        cookie = response.headers["set-cookie"].split(";", 1)[0]
    csrf = cookie.split("=", 1)[1]
    form = {"csrf_token": csrf, "page": "schedules", "action": "pause", "one": name,
            "confirmed": "yes", "token": TOKEN}  # fmt: skip
    request = urllib.request.Request(
        url + "/control/apply", data=urllib.parse.urlencode(form).encode(),
        headers={"cookie": cookie, "origin": url},
    )  # fmt: skip
    with urllib.request.urlopen(request) as response:
        return str(response.read().decode())


def test_schedules_declared_on_job_show_and_pause_from_the_page(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'fleet.db'}"
    config = tmp_path / "workerpool.toml"
    config.write_text(CONFIG.format(store=store))
    # Given the dashboard given the job modules the workers run
    modules = ("--jobs", "workerpool_jobs.demo", "--jobs", "tests.scheduled_jobs")
    with _dashboard(config, tmp_path / "dashboard.log", *modules) as url:
        # Then it shows the config's schedule and the one declared on @job
        assert _shown(url) == {"hourly": "demo.echo", "reports.nightly": "reports.nightly"}
        assert "T02:00:00+00:00" in http_get(url + "/schedules")[1]
        # and pausing the @job one from the page pauses it for the fleet
        assert "reports.nightly: paused" in _pause(url, "reports.nightly")
    marks = marks_opener(store)
    assert marks is not None
    opened = marks()
    try:
        assert opened.pauses()["reports.nightly"].paused
    finally:
        opened.close()


def test_without_the_job_modules_only_the_config_schedules_show(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'fleet.db'}"
    config = tmp_path / "workerpool.toml"
    config.write_text(CONFIG.format(store=store))
    with _dashboard(config, tmp_path / "dashboard.log") as url:
        assert _shown(url) == {"hourly": "demo.echo"}


def test_a_job_module_that_cannot_be_imported_is_one_line_and_exit_2(tmp_path: Path) -> None:
    config = tmp_path / "workerpool.toml"
    config.write_text(CONFIG.format(store=f"sqlite:///{tmp_path / 'fleet.db'}"))
    done = run_command("dashboard", "--config", str(config), "--jobs", "no_such_jobs_module")
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "no_such_jobs_module" in done.stderr
