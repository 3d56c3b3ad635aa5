"""A slot thread's permit to run (``run.Permit``), and its states; the pool keeps the count.

A permit is none yet, held (its run may run), parked (its run waits without it), or ahead (an
async run made ready without one, in the pool's line of ready runs). ``state`` and ``ticket``
(when a run made ready ahead came) change under the pool's lock, but for a permit's first
step to ahead, which no other thread sees yet (``Pool._go_ahead``). Threads waiting for a
permit get free ones in the order they came, and a run made ready ahead takes one unless
threads that came before it wait (``came_before``); such runs are started by a ``Starter``,
on the thread that granted the permit (or their own, when one was free at once).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Protocol

log = logging.getLogger(__name__)

# How a run made ready ahead starts once granted a permit (True), or ends unstarted (False).
Start = Callable[[bool], None]

NONE, HELD, PARKED, AHEAD = "none", "held", "parked", "ahead"


class Permits(Protocol):
    """The pool, as its permits see it."""

    def put_down(self, permit: SlotPermit) -> bool: ...

    def pick_up(self, permit: SlotPermit) -> bool: ...

    def start_when_held(self, permit: SlotPermit, start: Start) -> None: ...


class SlotPermit:
    __slots__ = ("_permits", "state", "ticket")

    def __init__(self, permits: Permits) -> None:
        self._permits = permits
        self.state = NONE
        self.ticket = 0

    def put_down(self) -> bool:
        return self._permits.put_down(self)

    def pick_up(self) -> bool:
        return self._permits.pick_up(self)

    def start_when_held(self, start: Start) -> None:
        self._permits.start_when_held(self, start)


def came_before(ticket: int, waiting: Mapping[SlotPermit, int]) -> int:
    """How many of the ``waiting`` tickets, in the order they came, came before ``ticket``."""
    before = 0
    for other in waiting.values():
        if other >= ticket:
            break
        before += 1
    return before


class Starter:
    """Starts runs granted a permit, one after another on the calling thread. A start that
    ends at once (its message was handed back while it waited) frees its permit for the next
    ready run: that one is queued here, not started inside it, so a long line of such runs
    never nests."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queued = threading.local()

    def launch(self, starts: list[Start]) -> None:
        if not starts:
            return
        queued: collections.deque[Start] | None = getattr(self._queued, "starts", None)
        if queued is not None:
            queued.extend(starts)  # a start below launches it when this one returns
            return
        self._queued.starts = queued = collections.deque(starts)
        try:
            while queued:
                start = queued.popleft()
                try:
                    start(True)
                except Exception:  # a bug; the runs queued after it must still start
                    log.exception("%s: starting a run made ready ahead failed", self._name)
        finally:
            self._queued.starts = None
