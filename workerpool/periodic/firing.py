"""The worker's side of periodic jobs: every worker runs a ``Periodics`` thread, and no
leader is elected.

When ticks are due, each worker tries to mark them (a compare-and-set each in the store the
fleet shares: insert if absent; the ticks due at one instant, a burst, in one round trip);
the worker publishes the jobs of the ticks it marked, under the job id derived from the
schedule and the tick and with ``not_before`` = the tick, so none starts early: all of the
burst at once, then it waits for their message ids and marks those published in one
transaction. A worker that dies between the mark and that transaction leaves the marks
unpublished: after ``take_over_after`` seconds another takes each over (a second
compare-and-set, on the time it was marked) and publishes it; published twice, it still runs
once, since the idempotency store knows its job id. Nothing expires while its holder may
still be working.

With overlap "skip" or "buffer_one", a tick's run is running from the mark of its tick until
the idempotency store records its job completed or failed; a tick whose job no worker has
claimed counts for ``overlap_unclaimed`` seconds from its publish (then its message is taken
as lost).

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
from workerpool.publishing import JobMessage, confirmed, send
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
# Ticks marked and published together at most: a burst of more goes out in parts, so that
# each part is recorded published well within ``take_over_after`` of its mark.
_BURST = 500
# (a schedule, one of its ticks; for a publish, whether its lateness is measured)
Due = tuple[Periodic, float]


class Periodics(Middleware):
    """Fires the ticks of ``schedules`` to ``topic`` (see the module). ``on_late`` hears how
    late each tick was published, by schedule; ``on_ticks`` how many ticks of a schedule were
    "fired", "skipped" (overlap) or "missed" (catch_up), each counted by one worker.
    ``poll`` is the longest the thread sleeps between looks at ``clock``."""

    options = frozenset({SCHEDULE})

    def __init__(
        self,
        schedules: Sequence[Periodic],
        marks: Marks,
        topic: str,
        publisher: Any,
        *,
        take_over_after: float = 5.0,
        poll: float = 1.0,
        on_late: Callable[[str, float], None] = lambda name, seconds: None,
        on_ticks: Callable[[str, str, int], None] = lambda name, outcome, count: None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._schedules = {s.name: s for s in schedules}
        self._marks = marks
        self._topic = topic
        self._publisher = publisher
        self._take_over_after = take_over_after
        self._poll = poll
        self._on_late = on_late
        self._on_ticks = on_ticks
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pauses: dict[str, Pause] = {}  # as last read (kept while the store fails)
        # Where a job id's run is ("unclaimed", "running", "ended"), for overlap "skip" and
        # "buffer_one" (the launcher sets it from the idempotency store; without one, they
        # fire like "allow").
        self.run_state: Callable[[str], str] | None = None

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
            burst: list[Due] = []
            for name, schedule in self._schedules.items():
                while due[name] <= now:  # (a worker that was held up fires each tick it missed)
                    if not self._paused(name):
                        burst.append((schedule, due[name]))
                    due[name] = schedule.ticks.after(due[name])
            for start in range(0, len(burst), _BURST):
                self._guarded(partial(self._fire, burst[start : start + _BURST]))
            self._guarded(partial(self._take_over, now))
            # Awake at the next tick, and at least every poll (a second) to take over lost
            # publishes and to see a clock that moved.
            self._stop.wait(max(0.0, min(min(due.values()) - self._clock(), self._poll)))

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
            won = self._fire([(schedule, tick) for tick in kept])[-1]
        else:
            won = self._marks.mark(schedule.name, missed[-1], self._clock())
            if won:
                self._settle([(schedule, missed[-1])], MISSED)
        if won and len(missed) > len(kept):
            log.info("periodic %s: %d ticks missed while the fleet was down",
                     schedule.name, len(missed) - len(kept))  # fmt: skip
            self._on_ticks(schedule.name, "missed", len(missed) - len(kept))

    def _fire(self, burst: Sequence[Due]) -> list[bool]:
        """Mark the ticks and publish their jobs (or skip some, or leave them waiting); for
        each, whether this worker marked it. The overlap policy is applied once a tick, by
        the worker that marked it."""
        marked_at = self._clock()
        won = self._marks.mark_many([(s.name, tick) for s, tick in burst], marked_at)
        publish: list[Due] = []
        for (schedule, tick), marked in zip(burst, won, strict=True):
            if not marked:
                continue
            blocked = self._blocked(schedule, tick)
            if blocked is None:
                publish.append((schedule, tick))
            elif blocked == "runs" and schedule.overlap == "buffer_one":
                log.info("periodic %s: tick %s waits for the previous one to end",
                         schedule.name, tick)  # fmt: skip
                self._marks.take_over(Mark(schedule.name, tick, marked_at), BUFFERED)
            else:
                log.info("periodic %s: tick %s skipped: the previous one %s", schedule.name,
                         tick, "still runs" if blocked == "runs" else "waits already")  # fmt: skip
                self._settle([(schedule, tick)], SKIPPED)
                self._on_ticks(schedule.name, "skipped", 1)
        self._publish(publish, late=True)
        return won

    def _settle(self, ticks: Sequence[Due], state: int) -> None:
        forget: dict[str, float] = {}
        for schedule, tick in ticks:
            forget[schedule.name] = max(
                forget.get(schedule.name, 0.0), self._forget(schedule, tick)
            )
        self._marks.published_many([(s.name, tick) for s, tick in ticks], forget, state)

    def _blocked(self, schedule: Periodic, tick: float) -> str | None:
        """Unless overlap is "allow": "runs" if the run of the last tick before ``tick`` has
        not ended, "waits" if that tick waits for the one before it to end (overlap
        "buffer_one", or a schedule changed from it); None if the tick may fire."""
        if schedule.overlap == "allow" or self.run_state is None:
            return None
        previous = self._marks.last_run(schedule.name, tick)
        if previous is None:
            return None
        # Decided on this one read of the previous mark: another worker may publish a waiting
        # tick a moment later, and a second read would miss both its wait and its run.
        if previous.marked_at == BUFFERED:
            return "waits"
        return "runs" if self._runs(schedule, previous) else None

    def _runs(self, schedule: Periodic, previous: Mark) -> bool:
        """Whether the run of the tick ``previous`` has not ended: claimed and not completed
        or failed, or published (or about to be: its worker marked it) and not claimed yet,
        for ``overlap_unclaimed`` seconds from its mark (then its message is taken as lost).
        A tick still waiting (marked at BUFFERED) or an operator's run not taken over yet
        (REQUESTED) was not published: it does not run."""
        if self.run_state is None:  # no idempotency store: nothing known runs
            return False
        state = self.run_state(schedule.job_id(previous.tick))
        if state != "unclaimed":
            return state == "running"
        queued = previous.marked_at > REQUESTED
        return queued and self._clock() - previous.marked_at < schedule.overlap_unclaimed

    def _still_blocked(self, schedule: Periodic, mark: Mark) -> bool:
        """Whether a tick waiting for the previous run (overlap "buffer_one") still waits:
        that run has not ended, or that tick waits too (two wait when a tick was marked while
        the one before it was being set waiting), whichever order the workers look in."""
        return mark.marked_at == BUFFERED and self._blocked(schedule, mark.tick) is not None

    def _take_over(self, now: float) -> None:
        taken: list[tuple[Due, bool]] = []
        for mark in self._marks.unpublished(now - self._take_over_after):
            schedule = self._schedules.get(mark.schedule)
            if schedule is None or self._still_blocked(schedule, mark):
                continue
            if self._marks.take_over(mark, now):
                left = _LEFT.get(mark.marked_at, "another worker left")
                log.info("periodic %s: publishing the tick %s %s", *_named(mark), left)
                taken.append(((schedule, mark.tick), mark.marked_at != REQUESTED))
        self._publish([due for due, late in taken if late], late=True)
        self._publish([due for due, late in taken if not late], late=False)

    def _publish(self, ticks: Sequence[Due], *, late: bool) -> None:
        """Publish the ticks' jobs all at once, wait for their message ids, and mark those
        published in one transaction; ``late``: their lateness is measured (not for an
        operator's run, which is as late as it was asked). A tick whose publish failed stays
        unpublished, and is taken over after a while."""
        sent = [(schedule, tick, self._send(schedule, tick)) for schedule, tick in ticks]
        out = [(s, tick) for s, tick, future in sent if self._confirmed(s, tick, future)]
        for schedule, tick in out:
            if late:
                self._on_late(schedule.name, self._clock() - tick)
            self._on_ticks(schedule.name, "fired", 1)
        if out:
            self._settle(out, PUBLISHED)

    def _send(self, schedule: Periodic, tick: float) -> Any:
        """Start publishing the tick's job: its future, or the error the client raised."""
        when = datetime.fromtimestamp(tick, UTC)
        message = JobMessage(
            schedule.job, dict(schedule.payload), schedule.job_id(tick), {},
            not_before_text(when, when),
        )  # fmt: skip
        data, attributes = message.encode()
        try:
            return send(self._publisher, self._topic, data, attributes, message.ordering_key)
        except Exception as exc:  # (e.g. a client closed): handled as a failed future is
            return exc

    def _confirmed(self, schedule: Periodic, tick: float, future: Any) -> bool:
        """Whether the publish ``future`` was confirmed (no ordering key: none to resume)."""
        try:
            if isinstance(future, Exception):
                raise future
            confirmed(self._publisher, self._topic, "", future, _PUBLISH_TIMEOUT)
        except Exception as exc:  # left unpublished: taken over after a while
            log.warning("periodic %s: tick %s not published yet: %s", schedule.name, tick, exc)
            return False
        return True

    @staticmethod
    def _forget(schedule: Periodic, tick: float) -> float:
        return tick - max(_KEEP, schedule.catch_up_window)


def _named(mark: Mark) -> tuple[str, str]:
    return mark.schedule, datetime.fromtimestamp(mark.tick, UTC).isoformat()
