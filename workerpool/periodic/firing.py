"""The worker's side of periodic jobs: every worker runs a ``Periodics`` thread, and no
leader is elected.

When a tick is due, each worker tries to mark it (one compare-and-set in the store the fleet
shares: insert if absent); the one that marked it publishes the job, under the job id derived
from the schedule and the tick and with ``not_before`` = the tick, so it never starts early,
then marks it published. A worker that dies between the mark and the publish leaves the mark
unpublished: after ``take_over_after`` seconds another takes it over (a second compare-and-set,
on the time it was marked) and publishes it; published twice, it still runs once, since the
idempotency store knows its job id. Nothing expires while its holder may still be working.

On start a worker looks back for ticks missed while the whole fleet was down, from the last
tick marked (none marked yet: nothing is missed) but no further than ``catch_up_window``:
``catch_up`` "all" fires each, "latest" the last one, "none" none. The worker that marks the
latest of them counts the ticks left out as missed (with "none", it marks it missed: only
ticks older than ``take_over_after``, which a running fleet would have marked).

A paused schedule fires nothing (each worker reads the pauses when a tick is due), and the
ticks that fell while it was paused are never caught up: a worker looks back no further than
the schedule's last pause or resume. Runs an operator asked for (trigger, backfill) are
marks left for the next worker to take over.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from functools import partial
from typing import Any

from workerpool.options import SCHEDULE
from workerpool.periodic.marks import (
    BUFFERED,
    MISSED,
    PUBLISHED,
    REQUESTED,
    SKIPPED,
    Mark,
    Marks,
    Pause,
)  # fmt: skip
from workerpool.periodic.spec import MAX_CATCH_UP, Periodic
from workerpool.publishing import JobMessage, publish
from workerpool.schedule.when import not_before_text
from workerpool.stores import StoreError
from workerpool.worker.middleware import Middleware

log = logging.getLogger(__name__)

_PUBLISH_TIMEOUT = 30.0
# Marks of a schedule are forgotten this long after a later tick was published (at least:
# longer for a longer catch-up window, which reads the last one).
_KEEP = 86400.0
# Why a mark is taken over, by the time it was marked at.
_LEFT = {REQUESTED: "an operator asked for", BUFFERED: "that waited for the previous run"}


class Periodics(Middleware):
    """Fires the ticks of ``schedules`` to ``topic`` (see the module). ``on_late`` hears how
    late each tick was published, by schedule; ``on_ticks`` how many ticks of a schedule were
    "fired", "skipped" (overlap) or "missed" (catch_up), each counted by one worker."""

    options = frozenset({SCHEDULE})

    def __init__(
        self,
        schedules: Sequence[Periodic],
        marks: Marks,
        topic: str,
        publisher: Any,
        *,
        take_over_after: float = 5.0,
        on_late: Callable[[str, float], None] = lambda name, seconds: None,
        on_ticks: Callable[[str, str, int], None] = lambda name, outcome, count: None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._schedules = {s.name: s for s in schedules}
        self._marks = marks
        self._topic = topic
        self._publisher = publisher
        self._take_over_after = take_over_after
        self._on_late = on_late
        self._on_ticks = on_ticks
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pauses: dict[str, Pause] = {}  # as last read (kept while the store fails)
        # Whether a job id holds a live claim, for overlap "skip" (the launcher sets it from
        # the idempotency store; without one, "skip" fires like "allow").
        self.running: Callable[[str], bool] | None = None

    def start(self) -> None:
        if not self._schedules:
            return
        self._thread = threading.Thread(target=self._run, name="workerpool-periodic", daemon=True)
        self._thread.start()

    def close(self, timeout: float) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._marks.close()

    def _run(self) -> None:
        now = self._clock()
        due = {name: s.ticks.after(now) for name, s in self._schedules.items()}
        self._guarded(partial(self._catch_up, now))
        while not self._stop.is_set():
            now = self._clock()
            if min(due.values()) <= now:
                self._guarded(self._read_pauses)
            for name, schedule in self._schedules.items():
                while due[name] <= now:  # (a worker that was held up fires each tick it missed)
                    tick = due[name]
                    if not self._paused(name):
                        self._guarded(partial(self._fire, schedule, tick))
                    due[name] = schedule.ticks.after(tick)
            self._guarded(partial(self._take_over, now))
            # Awake at the next tick, and at least every second to take over lost publishes.
            self._stop.wait(max(0.0, min(min(due.values()) - self._clock(), 1.0)))

    def _guarded(self, step: Callable[[], object]) -> None:
        try:
            step()
        except StoreError as exc:  # another worker may fire it; else it is missed
            log.warning("periodic schedules: store not reached (%s)", exc)
        except Exception:  # a bug: keep firing the others
            log.exception("periodic schedules: firing failed")

    def _read_pauses(self) -> None:
        self._pauses = self._marks.pauses()

    def _paused(self, name: str) -> bool:
        pause = self._pauses.get(name)
        return pause is not None and pause.paused

    def _catch_up(self, now: float) -> None:
        self._read_pauses()
        for schedule in self._schedules.values():
            last = self._marks.last(schedule.name)
            if last is None or self._paused(schedule.name):
                continue
            pause = self._pauses.get(schedule.name)
            start = max(last, now - schedule.catch_up_window, pause.since if pause else last)
            end = now - self._take_over_after if schedule.catch_up == "none" else now
            self._catch_up_ticks(schedule, schedule.ticks.between(start, end, MAX_CATCH_UP))

    def _catch_up_ticks(self, schedule: Periodic, missed: list[float]) -> None:
        """Fire what catch_up keeps of the ``missed`` ticks; the worker that marks the latest
        counts the ticks left out."""
        if not missed:
            return
        kept = {"all": missed, "latest": missed[-1:], "none": []}[schedule.catch_up]
        if kept:
            won = [self._fire(schedule, tick) for tick in kept][-1]
        else:
            won = self._marks.mark(schedule.name, missed[-1], self._clock())
            if won:
                self._settle(schedule, missed[-1], MISSED)
        if won and len(missed) > len(kept):
            log.info("periodic %s: %d ticks missed while the fleet was down",
                     schedule.name, len(missed) - len(kept))  # fmt: skip
            self._on_ticks(schedule.name, "missed", len(missed) - len(kept))

    def _fire(self, schedule: Periodic, tick: float) -> bool:
        """Mark the tick and publish its job (or skip it, or leave it waiting); whether this
        worker marked it. The overlap policy is applied once, by the worker that marked it."""
        marked_at = self._clock()
        if not self._marks.mark(schedule.name, tick, marked_at):
            return False
        blocked = self._blocked(schedule, tick)
        if blocked is None:
            self._publish(schedule, tick)
        elif blocked == "runs" and schedule.overlap == "buffer_one":
            log.info("periodic %s: tick %s waits for the previous one to end", schedule.name, tick)
            self._marks.take_over(Mark(schedule.name, tick, marked_at), BUFFERED)
        else:
            log.info("periodic %s: tick %s skipped: the previous one %s", schedule.name, tick,
                     "still runs" if blocked == "runs" else "waits already")  # fmt: skip
            self._settle(schedule, tick, SKIPPED)
            self._on_ticks(schedule.name, "skipped", 1)
        return True

    def _settle(self, schedule: Periodic, tick: float, state: int) -> None:
        self._marks.published(schedule.name, tick, self._forget(schedule, tick), state)

    def _blocked(self, schedule: Periodic, tick: float) -> str | None:
        """Unless overlap is "allow": "runs" if the job of the last tick run before ``tick``
        still holds its claim, "waits" if that tick waits for the one before it to end
        (overlap "buffer_one"); None if the tick may fire."""
        if schedule.overlap == "allow" or self.running is None:
            return None
        previous = self._marks.last_run(schedule.name, tick)
        if previous is None:
            return None
        if self.running(schedule.job_id(previous)):
            return "runs"
        waiting = Mark(schedule.name, previous, BUFFERED)
        if schedule.overlap == "buffer_one" and waiting in self._marks.unpublished(REQUESTED):
            return "waits"
        return None

    def _still_blocked(self, schedule: Periodic, mark: Mark) -> bool:
        """Whether a tick waiting for the previous run (overlap "buffer_one") still waits."""
        if mark.marked_at != BUFFERED or self.running is None:
            return False
        previous = self._marks.last_run(schedule.name, mark.tick)
        return previous is not None and self.running(schedule.job_id(previous))

    def _take_over(self, now: float) -> None:
        for mark in self._marks.unpublished(now - self._take_over_after):
            schedule = self._schedules.get(mark.schedule)
            if schedule is None or self._still_blocked(schedule, mark):
                continue
            if self._marks.take_over(mark, now):
                left = _LEFT.get(mark.marked_at, "another worker left")
                log.info("periodic %s: publishing the tick %s %s", *_named(mark), left)
                self._publish(schedule, mark.tick, late=mark.marked_at != REQUESTED)

    def _publish(self, schedule: Periodic, tick: float, *, late: bool = True) -> None:
        """Publish the tick's job; ``late``: its lateness is measured (not for an operator's
        run, which is as late as it was asked)."""
        when = datetime.fromtimestamp(tick, UTC)
        message = JobMessage(
            schedule.job, dict(schedule.payload), schedule.job_id(tick), {},
            not_before_text(when, when),
        )  # fmt: skip
        try:
            publish(self._publisher, self._topic, message, timeout=_PUBLISH_TIMEOUT)
        except Exception as exc:  # left unpublished: taken over after a while
            log.warning("periodic %s: tick %s not published yet: %s", schedule.name, tick, exc)
            return
        if late:
            self._on_late(schedule.name, self._clock() - tick)
        self._on_ticks(schedule.name, "fired", 1)
        self._settle(schedule, tick, PUBLISHED)

    @staticmethod
    def _forget(schedule: Periodic, tick: float) -> float:
        return tick - max(_KEEP, schedule.catch_up_window)


def _named(mark: Mark) -> tuple[str, str]:
    return mark.schedule, datetime.fromtimestamp(mark.tick, UTC).isoformat()
