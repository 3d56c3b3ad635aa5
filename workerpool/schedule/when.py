"""The ``not_before`` attribute: an absolute RFC 3339 time in UTC (a relative delay would
drift with every redelivery and every hop)."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

MAX_AHEAD = timedelta(days=365)
# A worker whose clock runs ahead of the publisher's still takes a time this far beyond
# MAX_AHEAD.
_SKEW = timedelta(days=1)


def not_before_text(when: datetime | timedelta, now: datetime | None = None) -> str:
    """The attribute for a job that must not start before ``when`` (a timezone-aware time,
    or a delay from ``now``); ValueError for a naive time or one more than a year ahead."""
    now = now or datetime.now(UTC)
    if isinstance(when, timedelta):
        when = now + when
    if when.tzinfo is None:
        raise ValueError(f"not_before {when.isoformat()} has no timezone")
    if when - now > MAX_AHEAD:
        raise ValueError(f"not_before {when.isoformat()} is more than 365 days ahead")
    return when.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


_DELAY = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_delay(text: str) -> timedelta:
    """``90s``, ``5m``, ``2h``, ``1.5d``: ValueError for anything else."""
    match = _DELAY.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"delay {text!r} is not a number of s, m, h or d (90s, 2h, ...)")
    return timedelta(seconds=float(match[1]) * _UNITS[match[2]])


def parse_not_before(text: str, now: datetime | None = None) -> float:
    """The attribute's time as seconds since the epoch; ValueError saying what is wrong."""
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"not_before {text!r} is not an RFC 3339 time") from None
    if when.tzinfo is None:
        raise ValueError(f"not_before {text!r} has no timezone (end it in Z)")
    if when - (now or datetime.now(UTC)) > MAX_AHEAD + _SKEW:
        raise ValueError(f"not_before {text!r} is more than 365 days ahead")
    return when.timestamp()
