"""A slot thread's permit to run (``run.Permit``), and its states; the pool keeps the count.

A permit is none yet, held (its run may run), parked (its run waits without it), or ahead (an
async run made ready without one, counted with the parked). ``state`` and ``ticket`` (when a
run made ready ahead came) are guarded by the pool's lock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

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
