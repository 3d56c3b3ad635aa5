"""Operating periodic schedules (``workerpool schedule list|pause|resume|trigger|backfill``):
what the commands do, on the marks the fleet shares, the click commands staying thin.

Pause and resume are records every worker reads before firing a tick. Trigger and backfill
set marks unpublished, marked at ``REQUESTED``: the next worker to look takes each over (the
compare-and-set that already guards a tick whose worker died) and publishes it, so a run
fires once however many workers see it, to the topic the schedule's pool fires to, and
nothing here needs Pub/Sub. A tick marked already (fired, or backfilled before) is not marked
again."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from workerpool.errors import ConfigError
from workerpool.options import SCHEDULE
from workerpool.periodic import marks_opener
from workerpool.periodic.marks import MISSED, PUBLISHED, REQUESTED, SKIPPED, Marks
from workerpool.periodic.spec import MAX_CATCH_UP, Periodic, with_jobs
from workerpool.registry import Registry
from workerpool.schedule.when import parse_rfc3339
from workerpool.stores import StoreError, require_shared

if TYPE_CHECKING:  # (the config imports the periodic package)
    from workerpool.config import Settings

_STATES = {PUBLISHED: "published", SKIPPED: "skipped (overlap)", MISSED: "missed (catch_up)"}


def declared(
    schedules: Sequence[Periodic], jobs: Registry, *, crons: bool = True
) -> tuple[Periodic, ...]:
    """The schedules of the config and (``crons``) of the jobs' ``@job(schedule=)``
    (ConfigError for one naming no registered job)."""
    return with_jobs(
        schedules,
        {spec.name: spec.options.get(SCHEDULE) if crons else None for spec in jobs.specs()},
    )


@dataclass(frozen=True)
class Row:
    """One line of ``schedule list``."""

    schedule: Periodic
    next_tick: float
    last_tick: float | None
    last_state: str
    paused: bool

    def __str__(self) -> str:
        s = self.schedule
        when = f"every {s.ticks.every}s" if s.ticks.every else f"cron {s.ticks.expression!r}"
        last = "never" if self.last_tick is None else f"{_iso(self.last_tick)} {self.last_state}"
        state = "paused" if self.paused else "active"
        return (
            f"{s.name}  {s.job}  {when}  {s.ticks.timezone.key}  next {_iso(self.next_tick)}  "
            f"last {last}  {state}"
        )


class Control:
    """The operations on ``schedules`` (as declared), through ``marks``."""

    def __init__(
        self, schedules: Sequence[Periodic], marks: Marks, clock: Callable[[], float] = time.time
    ) -> None:
        self._schedules = {s.name: s for s in schedules}
        self._marks = marks
        self._clock = clock

    def rows(self) -> list[Row]:
        now = self._clock()
        pauses = self._marks.pauses()
        rows = []
        for name, schedule in self._schedules.items():
            latest = self._marks.latest(name)
            pause = pauses.get(name)
            state = "" if latest is None else _STATES.get(latest[1], "not published yet")
            rows.append(
                Row(schedule, schedule.ticks.after(now), None if latest is None else latest[0],
                    state, pause is not None and pause.paused)
            )  # fmt: skip
        return rows

    def pause(self, name: str, paused: bool) -> None:
        """Pause (or resume) the schedule: no worker fires its ticks while it is paused, and
        none fires the ticks that fell while it was, whatever its catch_up."""
        self._find(name)
        self._marks.pause(name, paused, self._clock())

    def trigger(self, name: str) -> str:
        """One run now, under a job id of its own (its instant, in milliseconds, never a
        tick's: ticks fall on whole seconds); the job id."""
        schedule = self._find(name)
        tick = round(self._clock(), 3)
        if tick == int(tick):
            tick += 0.001
        if not self._marks.mark(name, tick, REQUESTED):
            raise ConfigError(f"schedule {name!r}: triggered at this instant already")
        return schedule.job_id(tick)

    def backfill(self, name: str, start: str, end: str) -> tuple[int, int]:
        """Fire each tick from ``start`` to ``end`` (RFC 3339, both included) not marked yet:
        how many it marked, and how many were marked already."""
        schedule = self._find(name)
        first, last = _time("--from", start), _time("--to", end)
        if last < first:
            raise ConfigError("--to comes before --from")
        if last > self._clock():
            raise ConfigError("--to is in the future: its ticks will fire in their time")
        # Ticks fall on whole seconds: just before ``first`` includes a tick at ``first``.
        ticks = schedule.ticks.between(first - 0.5, last, MAX_CATCH_UP + 1)
        if len(ticks) > MAX_CATCH_UP:
            raise ConfigError(f"more than {MAX_CATCH_UP} ticks from --from to --to")
        fired = sum(self._marks.mark(name, tick, REQUESTED) for tick in ticks)
        return fired, len(ticks) - fired

    def _find(self, name: str) -> Periodic:
        schedule = self._schedules.get(name)
        if schedule is None:
            known = ", ".join(sorted(self._schedules)) or "none"
            raise ConfigError(f"no periodic schedule {name!r} (declared: {known})")
        return schedule


def _time(option: str, text: str) -> float:
    try:
        return parse_rfc3339(text).timestamp()
    except ValueError as exc:
        raise ConfigError(f"{option}: {exc}") from None


def _iso(tick: float) -> str:
    return datetime.fromtimestamp(tick, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


@contextmanager
def operating(settings: Settings, jobs: Registry) -> Iterator[Control]:
    """The operations on the schedules ``settings`` and ``jobs`` declare, on the store the
    fleet shares (ConfigError if it keeps no marks or cannot be opened)."""
    open_marks = marks_opener(settings.idempotency_store)
    if open_marks is None:
        raise ConfigError(f"idempotency_store {settings.idempotency_store}: keeps no ticks")
    require_shared(settings.idempotency_store, "ticks and pauses")
    schedules = declared(settings.schedules, jobs)
    try:
        marks = open_marks()
    except StoreError as exc:
        raise ConfigError(f"idempotency_store (for periodic schedules): {exc}") from None
    try:
        yield Control(schedules, marks)
    finally:
        marks.close()
