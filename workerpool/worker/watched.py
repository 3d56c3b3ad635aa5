"""A condition on a pool's hold that wakes its waiters only when they want to look.

The pool's hold falls at every job's end, and the puller waits on it most of the time (until
half the hold is free), but each notify of a waiting thread wakes it: with no-op jobs at N =
100 the puller was woken twice a job, to find it still had too little room and wait again
(``threading.Condition.notify_all`` also checks its lock and looks at its waiters in three
Python calls even with nobody waiting). So a waiter says at what hold it wants to look again
(``look_at``: the puller's is the hold that leaves it room for a pull), and a fall of the hold
wakes the waiters only at or below the highest of those. Other changes (few messages left to
start, a run parked, the pool quiet) wake them whatever the hold. Every call is made under the
pool's lock, so no wake-up is missed.
"""

from __future__ import annotations

import math
import threading


class Watched:
    __slots__ = ("_cond", "_look_at", "_looks")

    def __init__(self, lock: threading.Lock) -> None:
        self._cond = threading.Condition(lock)
        self._looks: list[float] = []  # each waiter's look_at
        self._look_at = -math.inf  # the highest of them: none, nobody is woken

    def wait(self, timeout: float, *, look_at: float = math.inf) -> bool:
        """(Under the lock.) Wait until notified (True) or ``timeout`` passes (False); by a
        fall of the hold, only once it is at most ``look_at`` (default: at every change)."""
        self._looks.append(look_at)
        self._look_at = max(self._looks)
        try:
            return self._cond.wait(timeout)
        finally:
            self._looks.remove(look_at)
            self._look_at = max(self._looks, default=-math.inf)

    @property
    def waiting(self) -> int:
        """(Under the lock.) How many threads wait."""
        return len(self._looks)

    def held(self, hold: int) -> None:
        """(Under the lock.) The hold is now ``hold`` (or the runs changed, the hold not):
        wake the waiters if one wants to look at it."""
        if hold <= self._look_at:
            self._cond.notify_all()

    def notify_all(self) -> None:
        """(Under the lock.) Wake every waiter, if any, whatever the hold."""
        if self._looks:
            self._cond.notify_all()
