"""A periodic schedule as declared: a ``[[schedules]]`` entry of the config (the source of
truth: the store only remembers ticks) or ``@job(..., schedule="CRON")``. Every problem is a
``ConfigError`` of one line naming the schedule."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from workerpool.errors import ConfigError
from workerpool.periodic.ticks import Ticks, cron_expression
from workerpool.schedule.when import parse_delay

CATCH_UP = ("none", "latest", "all")
OVERLAP = ("skip", "allow", "buffer_one")
_KEYS = {"name", "job", "cron", "every", "timezone", "payload", "catch_up", "catch_up_window",
         "overlap", "overlap_unclaimed", "pool"}  # fmt: skip
_DEFAULTS: dict[str, Any] = {"timezone": "UTC", "payload": {}, "catch_up": "latest",
                             "catch_up_window": "1h", "overlap": "allow",
                             "overlap_unclaimed": "10m", "pool": ""}  # fmt: skip
# Ticks fired at once after a downtime with catch_up "all", at most: the latest ones.
MAX_CATCH_UP = 1000


@dataclass(frozen=True)
class Periodic:
    name: str
    job: str
    ticks: Ticks
    payload: Mapping[str, Any] = field(default_factory=dict)
    catch_up: str = "latest"
    catch_up_window: float = 3600.0  # seconds
    overlap: str = "allow"
    # The subscription of the ``[[pools]]`` entry that fires it, to its topic ("": the first).
    pool: str = ""
    # How long a tick published and not claimed yet counts as running (overlap "skip" and
    # "buffer_one"): past it, its message is taken as lost.
    overlap_unclaimed: float = 600.0  # seconds

    def job_id(self, tick: float) -> str:
        """The tick's job id: the same on every worker, so its job runs once."""
        when = datetime.fromtimestamp(tick, UTC).isoformat(timespec="milliseconds")
        return f"periodic:{self.name}:{when.replace('+00:00', 'Z')}"


def parse_schedules(entries: Iterable[Mapping[str, Any]], source: str) -> tuple[Periodic, ...]:
    """The ``[[schedules]]`` entries; ConfigError for a bad one or a name used twice."""
    schedules: dict[str, Periodic] = {}
    for index, entry in enumerate(entries):
        schedule = parse_schedule(entry, f"schedules[{index}]", source)
        if schedule.name in schedules:
            raise ConfigError(f"schedule {schedule.name!r} (from {source}) is declared twice")
        schedules[schedule.name] = schedule
    return tuple(schedules.values())


def with_jobs(declared: Iterable[Periodic], jobs: Mapping[str, str | None]) -> tuple[Periodic, ...]:
    """The schedules of the config and of ``@job(..., schedule=CRON)`` (``jobs``: each
    registered job's cron or None; such a schedule is named after its job and read in UTC),
    each checked to name a registered job; ConfigError otherwise."""
    schedules = {s.name: s for s in declared}
    for schedule in schedules.values():
        if schedule.job not in jobs:
            raise ConfigError(f"schedule {schedule.name!r}: no job {schedule.job!r} is registered")
    for job, cron in jobs.items():
        if cron is None:
            continue
        if job in schedules:
            raise ConfigError(f"schedule {job!r} is declared twice (config and @job)")
        schedules[job] = Periodic(job, job, Ticks(ZoneInfo("UTC"), cron_expression(cron)))
    return tuple(schedules.values())


def parse_schedule(entry: Mapping[str, Any], position: str, source: str) -> Periodic:
    """One schedule, ``position`` naming it while it has no name."""
    name = entry.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{position} (from {source}): a schedule needs a name")
    where = f"schedule {name!r} (from {source})"
    unknown = sorted(set(entry) - _KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown setting {unknown[0]}")
    values = {**_DEFAULTS, **entry}
    try:
        return Periodic(
            name, _text(values, "job"), _ticks(values), _payload(values["payload"]),
            _choice(values, "catch_up", CATCH_UP),
            parse_delay(str(values["catch_up_window"])).total_seconds(),
            _choice(values, "overlap", OVERLAP), _pool(values["pool"]),
            parse_delay(str(values["overlap_unclaimed"])).total_seconds(),
        )  # fmt: skip
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _text(values: Mapping[str, Any], key: str) -> str:
    value = values.get(key)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{key} must be a non-empty string, got {value!r}")
    return value.strip()


def _choice(values: Mapping[str, Any], key: str, choices: tuple[str, ...]) -> str:
    if values[key] not in choices:
        raise ValueError(f"{key} must be one of {', '.join(choices)}, got {values[key]!r}")
    return str(values[key])


def _pool(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"pool names a [[pools]] subscription (a string), got {value!r}")
    return value.strip()


def _payload(value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"payload must be a table, got {value!r}")
    return dict(value)


def _ticks(values: Mapping[str, Any]) -> Ticks:
    try:
        zone = ZoneInfo(_text(values, "timezone"))
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown timezone {values['timezone']!r} (an IANA name)") from None
    if ("cron" in values) == ("every" in values):
        raise ValueError("give either cron or every")
    if "cron" in values:
        return Ticks(zone, cron_expression(_text(values, "cron")))
    seconds = parse_delay(str(values["every"])).total_seconds()
    if seconds < 1 or seconds != int(seconds):
        raise ValueError(f"every must be a whole number of seconds, at least 1, got {seconds}")
    return Ticks(zone, every=int(seconds))
