"""The ``not_before`` attribute: an absolute RFC 3339 time in UTC (a relative delay would
drift with every redelivery and every hop)."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta, timezone

MAX_AHEAD = timedelta(days=365)

# RFC 3339 section 5.6's date-time, nothing looser: ISO 8601's other forms (week dates,
# no separators, no seconds, no offset) are refused, since another reader of the attribute
# may not take them. ASCII digits only (Python's \d takes any script's).
_RFC3339 = re.compile(
    r"([0-9]{4})-([0-9]{2})-([0-9]{2})[Tt]([0-9]{2}):([0-9]{2}):([0-9]{2})(\.[0-9]+)?"
    r"(?:([Zz])|([+-])([0-9]{2}):([0-9]{2}))"
)


def not_before_text(when: datetime | timedelta, now: datetime | None = None) -> str:
    """The attribute for a job that must not start before ``when`` (a timezone-aware time,
    or a delay from ``now``); ValueError for a naive time or one more than a year ahead."""
    now = now or datetime.now(UTC)
    if isinstance(when, timedelta):
        if when > MAX_AHEAD:  # (now + a huge delay would overflow before the check below)
            raise ValueError(f"not_before {when} from now is more than 365 days ahead")
        when = now + when
    if when.tzinfo is None:
        raise ValueError(f"not_before {when.isoformat()} has no timezone")
    if when - now > MAX_AHEAD:
        raise ValueError(f"not_before {when.isoformat()} is more than 365 days ahead")
    try:
        utc = when.astimezone(UTC)
    except OverflowError:  # (early on 0001-01-01 east of UTC: year 0 in UTC)
        raise ValueError(f"not_before {when.isoformat()} is out of range") from None
    return utc.isoformat(timespec="milliseconds").replace("+00:00", "Z")


_DELAY = re.compile(r"([0-9]+(?:\.[0-9]+)?)([smhd])")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_delay(text: str) -> timedelta:
    """``90s``, ``5m``, ``2h``, ``1.5d``: ValueError for anything else."""
    match = _DELAY.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"delay {text!r} is not a number of s, m, h or d (90s, 2h, ...)")
    try:
        return timedelta(seconds=float(match[1]) * _UNITS[match[2]])
    except OverflowError:
        raise ValueError(f"delay {text!r} is out of range") from None


def parse_rfc3339(text: str) -> datetime:
    """An RFC 3339 date-time (``2026-12-24T09:00:00Z``, ``2026-12-24t10:00:00.5+01:00``) as a
    timezone-aware datetime; ValueError saying what is wrong."""
    match = _RFC3339.fullmatch(text)
    if match is None:
        if _RFC3339.fullmatch(text + "Z"):
            raise ValueError(f"{text!r} has no timezone (end it in Z)")
        raise ValueError(f"{text!r} is not an RFC 3339 time (2026-12-24T09:00:00Z)")
    year, month, day, hour, minute, second = (int(part) for part in match.group(1, 2, 3, 4, 5, 6))
    fraction, sign, off_hour, off_minute = match.group(7, 9, 10, 11)
    offset = timedelta(hours=int(off_hour or 0), minutes=int(off_minute or 0))
    try:
        if int(off_hour or 0) > 23 or int(off_minute or 0) > 59:
            raise ValueError("the offset is not within -23:59..+23:59")
        zone = timezone(-offset if sign == "-" else offset)
        # A leap second (:60) is the instant the next minute starts.
        leap = int(second == 60)
        when = datetime(year, month, day, hour, minute, second - leap, tzinfo=zone)
        return when + timedelta(seconds=leap + float(f"0{fraction or ''}"))
    except (ValueError, OverflowError) as exc:
        raise ValueError(f"{text!r} is not a valid time: {exc}") from None


def parse_not_before(text: str, now: datetime | None = None) -> float:
    """The attribute's time as seconds since the epoch; ValueError saying what is wrong."""
    try:
        when = parse_rfc3339(text)
    except ValueError as exc:
        raise ValueError(f"not_before {exc}") from None
    if when - (now or datetime.now(UTC)) > MAX_AHEAD:
        raise ValueError(f"not_before {text!r} is more than 365 days ahead")
    return when.timestamp()


def span(seconds: float) -> str:
    """How long until something is due, short: 4.2s, 3.5m, 1.2h, 2.0d ("due": no time left)."""
    if seconds <= 0:
        return "due"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.1f}s"
