"""A job that declares its schedule on ``@job`` (not in the config), for ``--jobs
tests.scheduled_jobs``."""

from __future__ import annotations

from workerpool import JobContext, job


@job("reports.nightly", schedule="0 2 * * *")
def nightly(ctx: JobContext, payload: dict[str, object]) -> None:
    """Does nothing: only its schedule matters here."""
