"""One thread that sets events at deadlines, so a job timeout costs no thread of its own.

Entries are removed when their job ends, so the heap never holds more than the running jobs.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time

_Entry = tuple[float, int, threading.Event]


class Deadlines:
    def __init__(self) -> None:
        self._heap: list[_Entry] = []
        self._counter = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="workerpool-deadlines", daemon=True)
        self._thread.start()

    def set_after(self, seconds: float, event: threading.Event) -> _Entry:
        entry = (time.monotonic() + seconds, next(self._counter), event)
        with self._cond:
            heapq.heappush(self._heap, entry)
            self._cond.notify()
        return entry

    def discard(self, entry: _Entry) -> None:
        with self._cond:
            try:
                self._heap.remove(entry)
            except ValueError:
                return  # already fired
            heapq.heapify(self._heap)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                while self._heap and self._heap[0][0] <= now:
                    heapq.heappop(self._heap)[2].set()
                timeout = self._heap[0][0] - now if self._heap else None
                self._cond.wait(timeout)
