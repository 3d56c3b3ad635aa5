"""When a periodic schedule's ticks fall: instants in UTC (seconds since the epoch).

A cron expression is read in the schedule's timezone by ``cronsim``, chosen over ``croniter``
(7.0) because it gets daylight saving time right where croniter does not: with a fixed hour
and minute (5 fields, or 6 whose seconds field is ``0``), a local time skipped by
spring-forward fires once, at the first instant after the gap, and a local time repeated by
fall-back fires once, at its first occurrence (croniter fires ``30 1 * * *`` twice on
2027-11-07 in New York). Both follow Debian cron; schedules with ``*`` or a step in the hour or
minute field keep to the clock as it runs: an hourly tick fires every hour, the repeated one
included. Both take 6 fields with the seconds first (croniter only with
``second_at_beginning``).

An ``every`` interval counts whole seconds from the Unix epoch, whatever the timezone, so
every worker computes the same ticks and no clock change moves them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime
from zoneinfo import ZoneInfo

from cronsim import CronSim, CronSimError


def cron_expression(text: str) -> str:
    """The expression as cronsim takes it; ValueError saying what is wrong. Six fields with
    seconds ``0`` become five, so a daily time gets the daylight-saving rules above."""
    fields = text.split()
    if len(fields) not in (5, 6):
        raise ValueError(f"cron {text!r} has {len(fields)} fields, not 5 (or 6, seconds first)")
    if len(fields) == 6 and set(fields[0]) == {"0"}:  # ("00" too)
        fields = fields[1:]
    expression = " ".join(fields)
    try:
        CronSim(expression, datetime(2000, 1, 1, tzinfo=UTC))
    except CronSimError as exc:
        raise ValueError(f"cron {text!r}: {exc}") from None
    return expression


@dataclass(frozen=True)
class Ticks:
    """A cron ``expression`` (from ``cron_expression``) read in ``timezone``, or ``every``
    whole seconds; exactly one of the two."""

    timezone: ZoneInfo
    expression: str = ""
    every: int = 0

    def after(self, when: float) -> float:
        """The first tick strictly after ``when``."""
        if self.every:
            return float((math.floor(when / self.every) + 1) * self.every)
        # Started inside a repeated hour, cronsim may answer the first occurrence of a local
        # time, before ``when``: that one fired already.
        for tick in CronSim(self.expression, datetime.fromtimestamp(when, self.timezone)):
            if tick.timestamp() > when:
                return tick.timestamp()
        raise ValueError(f"cron {self.expression!r} has no tick after {when}")

    def between(self, start: float, end: float, limit: int) -> list[float]:
        """The ticks after ``start`` up to ``end`` included, at most the last ``limit``."""
        ticks: list[float] = []
        if self.every:
            first = self.after(max(start, end - limit * self.every))
            return [float(t) for t in range(int(first), int(end) + 1, self.every)][-limit:]
        tick = self.after(start)
        while tick <= end:
            ticks.append(tick)
            ticks = ticks[-limit:]
            tick = self.after(tick)
        return ticks
