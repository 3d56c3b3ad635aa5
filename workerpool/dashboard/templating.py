"""The pages' Jinja2 environment: the package's templates, every value escaped, and the
filters they format with (``span``: a length of time, ``utc``: a moment, ``progress``: a
running job's, as ``workerpool status --running`` shows it)."""

from __future__ import annotations

from datetime import UTC, datetime

import jinja2

from workerpool.progress.running import progress_text
from workerpool.schedule.when import span


def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("workerpool.dashboard", "templates"), autoescape=True
    )
    env.filters["span"] = span
    env.filters["utc"] = utc
    env.filters["progress"] = progress_text
    return env


def utc(when: float) -> str:
    return datetime.fromtimestamp(when, UTC).isoformat(timespec="seconds")
