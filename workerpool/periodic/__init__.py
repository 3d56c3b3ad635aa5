"""Periodic jobs: schedules declared in the config or on ``@job``, whose ticks any worker may
fire, each exactly once (``spec`` the declaration, ``ticks`` when they fall)."""

from __future__ import annotations

from workerpool.periodic.spec import Periodic, parse_schedule, parse_schedules
from workerpool.periodic.ticks import Ticks, cron_expression

__all__ = ["Periodic", "Ticks", "cron_expression", "parse_schedule", "parse_schedules"]
