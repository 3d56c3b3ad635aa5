"""Unit tests of the example jobs with run_job: no Pub/Sub, the worker's decisions."""

from __future__ import annotations

import pytest
import reports_jobs

from workerpool import ConfigError
from workerpool.testing import run_job

CONFIG = {"bucket": "example-reports"}


def test_a_report_of_a_past_day_is_built_and_acked() -> None:
    result = run_job(reports_jobs.build, {"report": "daily", "day": "2026-01-31"}, config=CONFIG)
    assert result.label == "done" and result.acked
    assert "gs://example-reports/daily/2026-01-31.csv" in reports_jobs.BUILT


def test_an_unknown_report_is_dead_lettered_and_a_bad_payload_too() -> None:
    unknown = run_job("reports.build", {"report": "hourly", "day": "2026-01-31"}, config=CONFIG)
    assert unknown.dead_lettered and unknown.error_type == "reports.unknown"
    bad = run_job("reports.build", {"report": "daily", "day": 20260131}, config=CONFIG)
    assert bad.dead_lettered and bad.error_type == "invalid_payload"
    assert bad.error_message == "day: expected str, got int"


def test_a_report_of_today_is_deferred_not_failed() -> None:
    import datetime as dt

    today = dt.date.today().isoformat()
    result = run_job("reports.build", {"report": "weekly", "day": today}, config=CONFIG)
    assert result.label == "deferred" and result.delay == 600 and not result.acked


def test_a_typo_in_the_config_is_caught_before_anything_runs() -> None:
    with pytest.raises(ConfigError, match="buckett: unexpected field"):
        run_job("reports.build", {"report": "daily", "day": "2026-01-31"}, config={"buckett": "x"})


def test_the_async_job_is_awaited() -> None:
    assert run_job(reports_jobs.announce, {"report": "daily"}).label == "done"
    assert reports_jobs.ANNOUNCED[-1] == "daily"
