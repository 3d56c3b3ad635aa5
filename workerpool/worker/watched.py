"""A condition whose ``notify_all`` costs nothing while nobody waits.

The pool wakes the puller (and a drain's ``wait_idle``) at every job's end, twice a job,
though they wait only now and then: ``threading.Condition.notify_all`` checks that its lock is
held and looks at its waiters in three Python calls even then. This one counts its waiters
and notifies only if there are any. Both are done under the lock, so none is missed.
"""

from __future__ import annotations

import threading


class Watched:
    __slots__ = ("_cond", "_waiting")

    def __init__(self, lock: threading.Lock) -> None:
        self._cond = threading.Condition(lock)
        self._waiting = 0

    def wait(self, timeout: float) -> bool:
        """(Under the lock.) Wait until notified (True) or ``timeout`` passes (False)."""
        self._waiting += 1
        try:
            return self._cond.wait(timeout)
        finally:
            self._waiting -= 1

    def notify_all(self) -> None:
        """(Under the lock.) Wake every waiter, if any."""
        if self._waiting:
            self._cond.notify_all()
