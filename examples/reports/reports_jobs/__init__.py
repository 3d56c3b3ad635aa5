"""Example jobs: ``reports.build`` (a plain def) and ``reports.announce`` (an async def).

Published as ``workerpool publish --job reports.build --data '{"report": "daily", "day":
"2026-12-01"}'``; configured in the worker's ``workerpool.toml``::

    [jobs."reports.build"]
    bucket = "my-reports"
"""

from __future__ import annotations

import asyncio
import datetime as dt
from dataclasses import dataclass, field

from workerpool import AsyncJobContext, Defer, JobContext, PermanentError, job

# What the jobs produced, for the example's tests (a real job would write to its bucket).
BUILT: list[str] = []
ANNOUNCED: list[str] = []


@dataclass(frozen=True)
class ReportsConfig:
    # Defaults for every setting: a worker that has this package installed but no section
    # for it still starts (a required setting without one would stop every such worker).
    bucket: str = "reports"
    reports: list[str] = field(default_factory=lambda: ["daily", "weekly"])


@dataclass
class ReportRequest:
    report: str
    day: str  # YYYY-MM-DD


@job("reports.build", timeout=600, max_attempts=3, payload=ReportRequest, config=ReportsConfig)
def build(ctx: JobContext, request: ReportRequest) -> None:
    config: ReportsConfig = ctx.config
    if request.report not in config.reports:
        raise PermanentError(f"no report named {request.report!r}", error_type="reports.unknown")
    day = dt.date.fromisoformat(request.day)
    if day >= dt.date.today():
        raise Defer(f"{day} is not over yet", delay=600)  # not a failure: runs later
    BUILT.append(f"gs://{config.bucket}/{request.report}/{day}.csv")


@job("reports.announce", timeout=30)
async def announce(ctx: AsyncJobContext, payload: dict[str, str]) -> None:
    await asyncio.sleep(0.01)  # an await on an async client, in a real job
    ANNOUNCED.append(payload["report"])
