"""One thread that runs callbacks at given times, so a job's timeout or a claim's watch costs
no thread of its own.

Callbacks must be quick (set an event, hand work to another thread): they run on this thread.
Cancelling only marks a timer; the heap is swept of cancelled timers every so often, so it
never holds many more than the live ones.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

_SWEEP_EVERY = 1024  # timers scheduled between sweeps of cancelled ones


class Timer:
    __slots__ = ("callback", "cancelled", "when")

    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True  # one store of a bool: no lock on the hot path


class Timers:
    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._heap: list[tuple[float, int, Timer]] = []
        self._counter = itertools.count()
        self._lock = threading.Lock()  # entered directly on the hot path: a Condition's
        self._cond = threading.Condition(self._lock)  # __enter__ is a Python call
        self._closed = False
        self._scheduled = 0
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="workerpool-timers", daemon=True)
        self._thread.start()

    def call_after(self, seconds: float, callback: Callable[[], None]) -> Timer:
        return self.call_at(self._clock() + seconds, callback)

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        timer = Timer(when, callback)
        with self._lock:
            heapq.heappush(self._heap, (when, next(self._counter), timer))
            self._scheduled += 1
            if self._scheduled % _SWEEP_EVERY == 0:
                self._sweep()
            if self._heap[0][2] is timer:  # the thread sleeps until the earliest: wake it
                self._cond.notify()
        return timer

    def _sweep(self) -> None:
        self._heap = [entry for entry in self._heap if not entry[2].cancelled]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return sum(1 for _, _, timer in self._heap if not timer.cancelled)

    def close(self, timeout: float | None = None) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                due = self._wait_for_due()
            if due is None:
                return
            for timer in due:
                try:
                    timer.callback()
                except Exception:  # one bad callback must not stop every other timer
                    log.exception("timer callback %r failed", timer.callback)

    def _wait_for_due(self) -> list[Timer] | None:
        while not self._closed:
            now = self._clock()
            due = []
            while self._heap and self._heap[0][0] <= now:
                timer = heapq.heappop(self._heap)[2]
                if not timer.cancelled:
                    due.append(timer)
            if due:
                return due
            self._cond.wait(self._heap[0][0] - now if self._heap else None)
        return None
