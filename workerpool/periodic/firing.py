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
ticks older than ``take_over_after``, which a running fleet would have marked; marked at
``LEFT_OUT``, so that a worker taking the mark over sets it missed too). Ticks the store could
not mark are looked back for the same way once it answers, and so are the ticks a worker held
up for more than ``take_over_after`` (frozen, suspended, its clock stepped) slept through. A
look-back the store did not answer is tried again at each look.

A worker that takes over a mark its marker left decides on it again: the overlap policy, and
whether its job was claimed already (published: recorded as such). Unless overlap is "allow",
a mark left as the whole fleet went down (none took it over for ``overlap_unclaimed``: the
store out of reach as long counts the same) is skipped once a later tick was fired to run:
the first worker back looks back first.

A paused schedule fires nothing (each worker reads the pauses when a tick is due; a tick
whose pauses the store could not read is looked back for once it can, as one it could not
mark), and the ticks that fell while it was paused are never caught up: a worker looks back
no further than the schedule's last pause or resume. Runs an operator asked for (trigger,
backfill) are marks left for the next worker to take over.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from functools import partial
from typing import Any

from workerpool.options import SCHEDULE
from workerpool.periodic.marks import (
    BUFFERED,
    END_OF_TIME,
    LEFT_OUT,
    MISSED,
    PUBLISHED,
    REQUESTED,
    SKIPPED,
    Mark,
    Marks,
    Pause,
)  # fmt: skip
from workerpool.periodic.spec import MAX_CATCH_UP, Periodic
from workerpool.publishing import JobMessage, confirm_all, send
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
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock`` tells the ticks; ``monotonic``, beside it, tells a worker held up (see
        ``_run``)."""
        self._schedules = {s.name: s for s in schedules}
        self._marks = marks
        self._topic = topic
        self._publisher = publisher
        self._take_over_after = take_over_after
        self._poll = poll
        self._on_late = on_late
        self._on_ticks = on_ticks
        self._clock = clock
        self._monotonic = monotonic
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
        started, looked = self._clock(), self._monotonic()
        due = {name: s.ticks.after(started) for name, s in self._schedules.items()}
        # The look-backs still to make, by schedule: the ticks missed after ``since`` (None:
        # the last one the fleet marked), which catch_up decides about. One at the start; one
        # for the ticks the store could not mark (it was out of reach: the fleet missed them
        # as it would while down); and one for a worker held up for more than a take-over (a
        # wait that overran: it was frozen; or its clock moved on by more than the monotonic
        # one: it was suspended, or its clock stepped), which looks back as a worker just
        # started would, not tick by tick. A pass slowed by the store is no such thing: the
        # ticks that fell meanwhile fire late. Until its look-back is made, a schedule fires
        # nothing else, and the look-back reaches up to the last look: a tick fired
        # meanwhile would move the last one marked.
        behind: dict[str, float | None] = dict.fromkeys(self._schedules)
        wake_at, last_look = looked, (started, looked)
        while not self._stop.is_set():
            now, looked = self._clock(), self._monotonic()
            stepped = (now - last_look[0]) - (looked - last_look[1])
            held_up = max(looked - wake_at, stepped) > self._take_over_after
            last_look = (now, looked)
            unread = False  # the pauses, wanted, could not be read: what is due waits
            if behind or min(due.values()) <= now:
                unread = self._guarded(self._read_pauses)
            self._fall_behind(due, behind, now, held_up=held_up)
            for name, since in list(behind.items()):
                if not self._guarded(partial(self._look_back, self._schedules[name], since, now)):
                    del behind[name]
            self._fire_due(due, behind, now, pauses_read=not unread)
            self._guarded(partial(self._take_over, now))
            # Awake at the next tick, and at least every poll (a second) to take over lost
            # publishes, to look back again where the store did not answer, and to see a
            # clock that moved.
            soonest = min((due[name] for name in due if name not in behind), default=math.inf)
            wait = min(max(0.0, soonest - self._clock()), self._poll)
            wake_at = self._monotonic() + wait
            self._stop.wait(wait)

    def _fall_behind(
        self, due: dict[str, float], behind: dict[str, float | None], now: float, *,
        held_up: bool,
    ) -> None:  # fmt: skip
        """Schedules that look back (see ``_run``) reach up to ``now``; so does any whose
        tick fell more than a take-over ago while this worker was ``held_up``."""
        for name, schedule in self._schedules.items():
            if name in behind or (held_up and due[name] < now - self._take_over_after):
                # (``between`` takes the ticks after ``since``: due[name] is one of them)
                since = behind[name] = behind[name] if name in behind else due[name] - 1.0
                # At the start, ticks a look-back leaves out are the running fleet's to fire;
                # else they fire late here.
                resume = now if since is None else self._looked_back_to(schedule, now)
                due[name] = schedule.ticks.after(resume)

    def _fire_due(
        self, due: dict[str, float], behind: dict[str, float | None], now: float, *,
        pauses_read: bool,
    ) -> None:  # fmt: skip
        """Fire the ticks due by ``now`` of the schedules not looking back (a worker held up
        a little fires each); those the store could not mark, or whose pauses it could not
        read (the last read may say paused, or not, wrongly now), are looked back for."""
        burst: list[Due] = []
        for name, schedule in self._schedules.items():
            if not pauses_read and name not in behind and due[name] <= now:
                behind[name] = due[name] - 1.0  # (``between`` takes the ticks after it)
                continue
            while name not in behind and due[name] <= now:
                if not self._paused(name):
                    burst.append((schedule, due[name]))
                due[name] = schedule.ticks.after(due[name])
        for start in range(0, len(burst), _BURST):
            part = burst[start : start + _BURST]
            if self._guarded(partial(self._fire, part)):
                for schedule, tick in part:  # from the earliest of each schedule's ticks
                    behind.setdefault(schedule.name, tick - 1.0)

    def _guarded(self, step: Callable[[], object]) -> bool:
        """Run ``step``: True if the store was not reached, and it is to be tried again (a
        bug is logged, and not tried again: it would fail the same way)."""
        try:
            step()
        except StoreError as exc:
            log.warning("periodic schedules: store not reached (%s); trying again", exc)
            return True
        except Exception:  # a bug: keep firing the others
            log.exception("periodic schedules: firing failed")
        return False

    def _read_pauses(self) -> None:
        self._pauses = self._marks.pauses()

    def _paused(self, name: str) -> bool:
        pause = self._pauses.get(name)
        return pause is not None and pause.paused

    def _look_back(self, schedule: Periodic, since: float | None, until: float) -> None:
        """Fire what catch_up keeps of the ticks missed after ``since`` (None: the last the
        fleet marked; none marked yet, nothing is missed) up to ``until``. (Pauses are read
        with it: not knowing them, a paused schedule may not look back.)"""
        self._read_pauses()
        if since is None:
            since = self._marks.last(schedule.name)
        if since is None or self._paused(schedule.name):
            return
        pause = self._pauses.get(schedule.name)
        start = max(since, until - schedule.catch_up_window, pause.since if pause else since)
        end = self._looked_back_to(schedule, until)
        self._catch_up_ticks(schedule, schedule.ticks.between(start, end, MAX_CATCH_UP))

    def _looked_back_to(self, schedule: Periodic, until: float) -> float:
        """Where a look-back up to ``until`` ends, and firing goes on from: with catch_up
        "none", a take-over before it (the ticks after that may be another worker's to fire
        now, or fire late here; none of them is missed)."""
        return until - self._take_over_after if schedule.catch_up == "none" else until

    def _catch_up_ticks(self, schedule: Periodic, missed: list[float]) -> None:
        """Fire what catch_up keeps of the ``missed`` ticks; the worker that marks the latest
        counts the ticks left out."""
        if not missed:
            return
        kept = {"all": missed, "latest": missed[-1:], "none": []}[schedule.catch_up]
        if kept:
            for start in range(0, len(kept), _BURST):  # each part recorded well within a take-over
                won = self._fire([(schedule, tick) for tick in kept[start : start + _BURST]])[-1]
        else:
            won = self._marks.mark(schedule.name, missed[-1], LEFT_OUT)
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
        publish = [
            (schedule, tick)
            for (schedule, tick), marked in zip(burst, won, strict=True)
            if marked and self._may_publish(schedule, tick, marked_at)
        ]
        self._publish(publish, late=True)
        return won

    def _may_publish(self, schedule: Periodic, tick: float, marked_at: float) -> bool:
        """The overlap policy, applied to a tick this worker marked at ``marked_at``: whether
        to publish it now; else it is left waiting for the previous run, or skipped."""
        blocked = self._blocked(schedule, tick)
        if blocked is None:
            return True
        if blocked == "runs" and schedule.overlap == "buffer_one":
            log.info("periodic %s: tick %s waits for the previous one to end",
                     schedule.name, tick)  # fmt: skip
            self._marks.take_over(Mark(schedule.name, tick, marked_at), BUFFERED)
        else:
            log.info("periodic %s: tick %s skipped: the previous one %s", schedule.name,
                     tick, "still runs" if blocked == "runs" else "waits already")  # fmt: skip
            self._settle([(schedule, tick)], SKIPPED)
            self._on_ticks(schedule.name, "skipped", 1)
        return False

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
        return self._queued_lately(schedule, previous)

    def _queued_lately(self, schedule: Periodic, mark: Mark) -> bool:
        """Whether ``mark`` was marked (or taken over) by a worker less than
        ``overlap_unclaimed`` ago: its job, not claimed yet, counts as on its way; after that
        it is taken as lost. Read now: the workers that decide on a mark read it as they look."""
        return (
            mark.marked_at > REQUESTED
            and self._clock() - mark.marked_at < schedule.overlap_unclaimed
        )

    def _still_blocked(self, schedule: Periodic, mark: Mark) -> bool:
        """Whether a tick waiting for the previous run (overlap "buffer_one") still waits:
        that run has not ended, or that tick waits too (two wait when a tick was marked while
        the one before it was being set waiting), whichever order the workers look in."""
        return mark.marked_at == BUFFERED and self._blocked(schedule, mark.tick) is not None

    def _take_over(self, now: float) -> None:
        taken: list[tuple[Due, bool]] = []
        try:
            for mark in self._marks.unpublished(now - self._take_over_after):
                if (due := self._take_over_one(mark, now)) is not None:
                    taken.append(due)
        finally:
            # Also when the store failed part way: those taken over already go out now, or
            # they would wait a take-over more (an operator's then taken for a worker's).
            self._publish([due for due, late in taken if late], late=True)
            self._publish([due for due, late in taken if not late], late=False)

    def _take_over_one(self, mark: Mark, now: float) -> tuple[Due, bool] | None:
        """Take ``mark`` over, and decide on it: its tick to publish, and whether its lateness
        is measured (None: nothing to publish, or another worker took it)."""
        schedule = self._schedules.get(mark.schedule)
        if schedule is None or self._still_blocked(schedule, mark):
            return None
        if self._left_behind(schedule, mark):
            # One compare-and-set makes it a tick left out: another worker's overlap
            # check, reading it meanwhile, sees it lost (as before) or not run, never
            # queued anew.
            if self._marks.take_over(mark, LEFT_OUT):
                log.info("periodic %s: tick %s skipped: left unpublished as the fleet "
                         "went down, and a later one fired since", *_named(mark))  # fmt: skip
                self._settle([(schedule, mark.tick)], SKIPPED)
                self._on_ticks(schedule.name, "skipped", 1)
            return None
        if not self._marks.take_over(mark, now):
            return None
        due = (schedule, mark.tick)
        if mark.marked_at == LEFT_OUT:  # its marker died before saying it was missed
            self._settle([due], MISSED)
            return None
        left = _LEFT.get(mark.marked_at)
        if left is None:
            # A worker's, which died (or met a store error) before it published the tick,
            # or before it recorded that the tick waits or is skipped: decided again here.
            if self._published_already(schedule, mark.tick):
                self._settle([due], PUBLISHED)
                return None
            if not self._may_publish(schedule, mark.tick, now):
                return None
            left = "another worker left"
        log.info("periodic %s: publishing the tick %s %s", *_named(mark), left)
        return due, mark.marked_at != REQUESTED

    def _left_behind(self, schedule: Periodic, mark: Mark) -> bool:
        """Unless overlap is "allow": whether ``mark``, a worker's, was left unpublished as the
        whole fleet went down, and a later tick was fired to run since (by the first worker
        back, looking back): published now, the two could run at once. Left: nobody took it
        over for ``overlap_unclaimed`` (the overlap check then takes its run as lost), where
        a running fleet takes a mark over within seconds (a failed publish too: its take-over
        marks it anew). Not if its job was claimed: its marker published it."""
        if schedule.overlap == "allow" or self.run_state is None or mark.marked_at <= REQUESTED:
            return False  # (an operator's, waiting or left out: marked at a sentinel)
        if self._queued_lately(schedule, mark):  # (as another worker's overlap check reads it)
            return False
        later = self._marks.last_run(schedule.name, END_OF_TIME)
        while later is not None and later.tick > mark.tick and later.marked_at <= REQUESTED:
            # Waiting for a run, left out, or an operator's not taken over yet: not fired to
            # run yet; one before it may have been.
            later = self._marks.last_run(schedule.name, later.tick)
        if later is None or later.tick <= mark.tick:
            return False
        return not self._published_already(schedule, mark.tick)

    def _published_already(self, schedule: Periodic, tick: float) -> bool:
        """Whether the tick's job was claimed: its marker published it before it died."""
        return self.run_state is not None and self.run_state(schedule.job_id(tick)) != "unclaimed"

    def _publish(self, ticks: Sequence[Due], *, late: bool) -> None:
        """Publish the ticks' jobs all at once, wait for their message ids, and mark those
        published in one transaction; ``late``: their lateness is measured (not for an
        operator's run, which is as late as it was asked). A tick whose publish failed stays
        unpublished, and is taken over after a while (``confirm_all``: a Pub/Sub that does not
        answer holds the thread 30 s, not 30 s for each of 500 ticks)."""
        sent = [(self._topic, "", self._send(schedule, tick)) for schedule, tick in ticks]
        results = confirm_all(self._publisher, sent, _PUBLISH_TIMEOUT, monotonic=self._monotonic)
        out = []
        for (schedule, tick), result in zip(ticks, results, strict=True):
            if isinstance(result, Exception):  # left unpublished: taken over after a while
                log.warning("periodic %s: tick %s not published yet: %s",
                            schedule.name, tick, result)  # fmt: skip
            else:
                out.append((schedule, tick))
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

    @staticmethod
    def _forget(schedule: Periodic, tick: float) -> float:
        return tick - max(_KEEP, schedule.catch_up_window)


def _named(mark: Mark) -> tuple[str, str]:
    return mark.schedule, datetime.fromtimestamp(mark.tick, UTC).isoformat()
