"""``workerpool status --running``: the jobs running in the fleet now, from the progress
records in the shared store (a run shows there once it has run about a second)."""

from __future__ import annotations

import time
from datetime import UTC, datetime

from workerpool.errors import ConfigError
from workerpool.progress import job_state_opener
from workerpool.progress.store import Report
from workerpool.stores import StoreError, require_shared

_HEADER = ("JOB", "JOB ID", "REPLICA", "STARTED (UTC)", "PROGRESS", "NOTE")


def running_now(url: str) -> list[str]:
    """The table of the jobs running in the fleet whose store ``url`` names; ConfigError for
    a URL that keeps no progress, or a store that cannot be read."""
    try:
        opener = job_state_opener(url)
        if opener is None:
            raise ConfigError(f"idempotency_store {url}: keeps no progress")
        require_shared(url, "progress")
        store = opener()
        try:
            reports = store.running(time.time())
        finally:
            store.close()
    except (ValueError, ImportError, StoreError) as exc:
        raise ConfigError(f"idempotency_store (for progress): {exc}") from None
    return running_lines(reports)


def running_lines(reports: list[Report]) -> list[str]:
    """A table of ``reports``, a column each, and a count."""
    rows = [_HEADER, *(_row(r) for r in reports)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_HEADER))]
    widths[-1] = 0  # the note, last, is not padded
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
             for row in rows]  # fmt: skip
    return [*lines, f"{len(reports)} job(s) running"]


def _row(report: Report) -> tuple[str, str, str, str, str, str]:
    started = datetime.fromtimestamp(report.started, UTC).strftime("%Y-%m-%d %H:%M:%S")
    return (report.job, report.job_id, report.replica, started, progress_text(report), report.note)


def progress_text(report: Report) -> str:
    """``57/100 (57%)``, ``57`` without a total, ``-`` before the first report."""
    if report.done is None:
        return "-"
    if not report.total:
        return f"{report.done:g}"
    return f"{report.done:g}/{report.total:g} ({100 * report.done / report.total:.0f}%)"
