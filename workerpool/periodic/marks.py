"""The ticks a fleet fired: one mark per (schedule, tick), set by the one worker that won the
compare-and-set, ``published`` once its message is confirmed. A mark left unpublished (its
worker died between the mark and the publish) is taken over by another worker with a second
compare-and-set on the time it was marked. The config stays the source of truth: a mark only
remembers that a tick fired.

An operator's run (``workerpool schedule trigger`` or ``backfill``) is a mark set unpublished
and marked at ``REQUESTED``, long ago: the next worker to look takes it over and publishes it.
Pauses are records beside the marks, read by every worker."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# A mark's state.
# (MISSED: the latest tick catch_up left out after a downtime, marked to count them once.)
UNPUBLISHED, PUBLISHED, SKIPPED, MISSED = 0, 1, 2, 3
# The states of a tick that did not run.
NOT_RUN = (SKIPPED, MISSED)
# The time an operator's mark was marked at: before any worker's, so taken over at once.
REQUESTED = 0.0
# The time a tick waiting for the previous run to end is marked at (overlap "buffer_one"):
# before REQUESTED, so told apart; taken over once that run ends.
BUFFERED = -1.0
# The time the latest tick catch_up "none" left out is marked at: a worker that takes it over
# (its marker died before setting it MISSED) sets it MISSED, never publishes it.
LEFT_OUT = -2.0
# Later than any tick (seconds since the epoch, below the 10^13 a Firestore key sorts by):
# ``last_run(schedule, END_OF_TIME)`` is the schedule's latest tick marked to run.
END_OF_TIME = 9e12


@dataclass(frozen=True)
class Mark:
    schedule: str
    tick: float  # seconds since the epoch, UTC
    marked_at: float


@dataclass(frozen=True)
class Pause:
    """A schedule paused (or resumed, no longer paused) at ``since``."""

    paused: bool
    since: float


# (schedule, tick): a tick of a schedule.
Tick = tuple[str, float]


class Marks(ABC):
    """Every method may raise ``StoreError``, and nothing else."""

    def mark(self, schedule: str, tick: float, now: float) -> bool:
        """Mark the tick unless it is marked already: True for the one caller that marked it."""
        return self.mark_many([(schedule, tick)], now)[0]

    @abstractmethod
    def mark_many(self, ticks: Sequence[Tick], now: float) -> list[bool]:
        """``mark`` each of ``ticks`` (a compare-and-set each, in as few round trips as the
        backend can): for each, in order, whether this caller marked it."""

    @abstractmethod
    def take_over(self, mark: Mark, now: float) -> bool:
        """Mark again, at ``now``, a tick still unpublished and marked at ``mark.marked_at``:
        True for the one caller that did."""

    def published(
        self, schedule: str, tick: float, forget_before: float, state: int = PUBLISHED
    ) -> None:
        """The tick's message is out (or, SKIPPED or MISSED, will never be); marks of the
        schedule before ``forget_before`` go."""
        self.published_many([(schedule, tick)], {schedule: forget_before}, state)

    @abstractmethod
    def published_many(
        self, ticks: Sequence[Tick], forget_before: Mapping[str, float], state: int = PUBLISHED
    ) -> None:
        """``published`` for each of ``ticks``, in one transaction where the backend can; the
        marks of each schedule in ``forget_before`` before its time go."""

    @abstractmethod
    def last_run(self, schedule: str, before: float) -> Mark | None:
        """The latest tick of the schedule before ``before`` marked and not skipped or
        missed, with the time it was marked (or taken over) at."""

    @abstractmethod
    def unpublished(self, marked_before: float) -> list[Mark]:
        """The marks still unpublished that were marked before ``marked_before``."""

    @abstractmethod
    def latest(self, schedule: str) -> tuple[float, int] | None:
        """The latest tick of the schedule marked and its state (None: none yet)."""

    def last(self, schedule: str) -> float | None:
        """The latest tick of the schedule marked (None: none yet)."""
        found = self.latest(schedule)
        return None if found is None else found[0]

    @abstractmethod
    def pause(self, schedule: str, paused: bool, now: float) -> None:
        """Pause the schedule, or resume it, from ``now``."""

    @abstractmethod
    def pauses(self) -> dict[str, Pause]:
        """The schedules ever paused, and whether they still are."""

    @abstractmethod
    def close(self) -> None:
        """Release connections; the store must not be used afterwards."""


class MemoryMarks(Marks):
    """The marks of one process, for tests and the in-process worker."""

    def __init__(self) -> None:
        # (schedule, tick) -> (marked_at, state): UNPUBLISHED, PUBLISHED or SKIPPED
        self._marks: dict[tuple[str, float], tuple[float, int]] = {}
        self._pauses: dict[str, Pause] = {}
        self._lock = threading.Lock()

    def mark_many(self, ticks: Sequence[Tick], now: float) -> list[bool]:
        with self._lock:
            won = []
            for tick in ticks:
                won.append(tick not in self._marks)
                self._marks.setdefault(tick, (now, UNPUBLISHED))
            return won

    def take_over(self, mark: Mark, now: float) -> bool:
        with self._lock:
            if self._marks.get((mark.schedule, mark.tick)) != (mark.marked_at, UNPUBLISHED):
                return False
            self._marks[mark.schedule, mark.tick] = (now, UNPUBLISHED)
            return True

    def published_many(
        self, ticks: Sequence[Tick], forget_before: Mapping[str, float], state: int = PUBLISHED
    ) -> None:
        with self._lock:
            for tick in ticks:
                self._marks[tick] = (self._marks[tick][0], state)
            for key in [k for k in self._marks if k[1] < forget_before.get(k[0], k[1])]:
                if self._marks[key][1] != UNPUBLISHED:
                    del self._marks[key]

    def unpublished(self, marked_before: float) -> list[Mark]:
        with self._lock:
            return [
                Mark(schedule, tick, at)
                for (schedule, tick), (at, state) in self._marks.items()
                if state == UNPUBLISHED and at < marked_before
            ]

    def latest(self, schedule: str) -> tuple[float, int] | None:
        with self._lock:
            ticks = [tick for s, tick in self._marks if s == schedule]
            return (max(ticks), self._marks[schedule, max(ticks)][1]) if ticks else None

    def pause(self, schedule: str, paused: bool, now: float) -> None:
        with self._lock:
            self._pauses[schedule] = Pause(paused, now)

    def pauses(self) -> dict[str, Pause]:
        with self._lock:
            return dict(self._pauses)

    def last_run(self, schedule: str, before: float) -> Mark | None:
        with self._lock:
            tick = max(
                (t for (s, t), (_, state) in self._marks.items()
                 if s == schedule and t < before and state not in NOT_RUN),
                default=None,
            )  # fmt: skip
            return None if tick is None else Mark(schedule, tick, self._marks[schedule, tick][0])

    def close(self) -> None:
        pass
