"""One message at a time per ordering key, in the order received (ordered subscriptions only).

On a subscription with message ordering, Pub/Sub delivers a key's messages in order and holds
the key back while any of them is outstanding, but one pull may bring many of one key at
once. The pool asks ``place`` where each admitted message goes: a message with no key, or
whose key has nothing here yet, may start now; a later one of a busy key waits here, holding
no slot, until the one before it has settled (``settled``). A key keeps all it was brought
(the pool's hold bounds them): giving the rest back to spare the prefetch for other keys made
the emulator redeliver them out of order and, given back again and again, pushed them to
their last delivery (measured).

A message given back (a retry, a deferral, a drain, a lost claim) takes every later message of
its key held here with it, so no later message is ever acked before it. Pub/Sub redelivers a
key from its first message given back, in order; the emulator does not (measured: it delivers
the key's messages never delivered yet first, then those given back, in the order they were
given back). So a key keeps the messages this worker gave back, in the key's order, as owed:
until the first of them comes back, any other message of the key is given back again (one
never seen before is owed after them). On Pub/Sub the first owed one comes first, and nothing
is given back for it; on the emulator, each given back goes behind it. Only this worker knows
what it owes: another worker on the emulator may run those never delivered first. A key's
owed messages are forgotten after ``owed_for`` seconds without one coming back (another
worker may have them). Not thread-safe: the pool calls it under its lock.
"""

from __future__ import annotations

import collections
import enum
import time
from collections.abc import Callable

from workerpool.worker.delivery import Delivery
from workerpool.worker.envelope import first_message_id


class Place(enum.Enum):
    START = "start"  # may start now
    WAIT = "wait"  # waits here for the one before it
    RELEASE = "release"  # give it back now: the key owes an earlier one


class _Owed:
    """A key's messages given back by this worker, in the key's order, by message id."""

    __slots__ = ("ids", "since")

    def __init__(self, now: float) -> None:
        self.ids: collections.deque[str] = collections.deque()
        self.since = now  # when the first of them last changed


class Sequencer:
    def __init__(
        self, owed_for: float = 600.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._owed_for = owed_for
        self._clock = clock
        # By key: the messages after the one started (not started yet), oldest first. A key
        # is here exactly while one of its messages has started and not settled.
        self._keys: dict[str, collections.deque[Delivery]] = {}
        self._owed: dict[str, _Owed] = {}

    def place(self, delivery: Delivery) -> Place:
        key = delivery.ordering_key
        if not key:
            return Place.START
        # A copy published for a message on its last delivery is owed in the message's place.
        if not self._may_place(key, first_message_id(delivery.attributes, delivery.message_id)):
            return Place.RELEASE
        waiting = self._keys.get(key)
        if waiting is None:
            self._keys[key] = collections.deque()
            return Place.START
        waiting.append(delivery)
        return Place.WAIT

    def _may_place(self, key: str, message_id: str) -> bool:
        """Whether a message of ``key`` may be placed: the key owes nothing, or this is the
        first message it owes (then it owes it no more). Any other is given back (again), and
        keeps its place among those owed, in the key's order."""
        owed = self._owed.get(key)
        if owed is None:
            return True
        now = self._clock()
        if now - owed.since > self._owed_for:
            del self._owed[key]  # another worker may have them: wait no longer
            return True
        if owed.ids[0] == message_id:
            owed.ids.popleft()
            owed.since = now
            if not owed.ids:
                del self._owed[key]
            return True
        if message_id not in owed.ids:  # never here before: it comes after all the key owes
            owed.ids.append(message_id)
        return False

    def _owe_first(self, key: str, message_ids: list[str]) -> None:
        """The key owes these (given back now, in its order) before anything it owed."""
        owed = self._owed.get(key)
        if owed is None:
            owed = self._owed[key] = _Owed(self._clock())
        owed.ids.extendleft(reversed(message_ids))
        owed.since = self._clock()

    def settled(self, delivery: Delivery) -> tuple[Delivery | None, list[Delivery]]:
        """``delivery`` (started) settled: the next of its key to start, if it was acked, or
        every later one of its key held here, to give back with it (both then owed first)."""
        key = delivery.ordering_key
        waiting = self._keys.get(key) if key else None
        if waiting is None:
            return None, []
        if delivery.returned:
            del self._keys[key]
            back = list(waiting)
            given = [first_message_id(d.attributes, d.message_id) for d in (delivery, *back)]
            self._owe_first(key, given)
            return None, back
        if not waiting:
            del self._keys[key]
            return None, []
        return waiting.popleft(), []

    def release_all(self) -> list[Delivery]:
        """Every message waiting here (the pool goes quiet): none of them starts any more."""
        waiting = [d for queued in self._keys.values() for d in queued]
        for queued in self._keys.values():
            queued.clear()
        return waiting
