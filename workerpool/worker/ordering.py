"""One message at a time per ordering key, in the order received (ordered subscriptions only).

On a subscription with message ordering, Pub/Sub delivers a key's messages in order and holds
the key back while any of them is outstanding, but one pull may bring many of one key at
once. The pool asks ``place`` where each admitted message goes: a message with no key, or
whose key has nothing here yet, may start now; a later one of a busy key waits here, holding
no slot, until the one before it has settled (``settled``).

One key holds at most ``per_key`` messages here (its share of the hold): a deep key's backlog
would otherwise fill the hold while the slots it leaves idle wait for other keys' messages
that can no longer be pulled. The pool pulls no more than ``per_key`` at once, and Pub/Sub
holds a key back while any of its messages is outstanding (measured on the emulator), so a
key does not come beyond its share; if one does, the excess is given back at once (``BACK``),
and so is every later one of its key while the key is here, so none is run before it. The
same holds for one the pool gives back because its hold is full (``refused``).

A message given back (a retry, a deferral, a drain, a lost claim) takes every later message of
its key held here with it, so no later message is ever acked before it. They go back by a
short lease, not a nack (``Settlement``): Pub/Sub redelivers a key from its first message
given back, either way; the emulator does so only for a lease that lapsed, and puts a nacked
message after the key's messages never delivered yet (measured). Not thread-safe: the pool
calls it under its lock.
"""

from __future__ import annotations

import collections
import enum

from workerpool.worker.delivery import Delivery


class Place(enum.Enum):
    START = "start"  # may start now
    WAIT = "wait"  # waits here for the one before it
    BACK = "back"  # given back at once: its key holds its share here


class Sequencer:
    def __init__(self, per_key: int) -> None:
        self.per_key = max(1, per_key)
        # By key: the messages after the one started (not started yet), oldest first. A key
        # is here exactly while one of its messages has started and not settled.
        self._keys: dict[str, collections.deque[Delivery]] = {}
        # The keys here that gave one back: their later ones go back too until they leave.
        self._full: set[str] = set()
        self.waiting = 0  # messages waiting here behind their key: none of them can start yet

    def place(self, delivery: Delivery) -> Place:
        key = delivery.ordering_key
        if not key:
            return Place.START
        waiting = self._keys.get(key)
        if waiting is None:
            self._keys[key] = collections.deque()
            return Place.START
        if key in self._full or 1 + len(waiting) >= self.per_key:
            self._full.add(key)
            return Place.BACK
        waiting.append(delivery)
        self.waiting += 1
        return Place.WAIT

    def refused(self, delivery: Delivery) -> None:
        """``delivery`` was given back before it was placed (the hold is full): as for one
        beyond its key's share, every later one of its key goes back while the key is here."""
        if delivery.ordering_key in self._keys:
            self._full.add(delivery.ordering_key)

    def settled(self, delivery: Delivery) -> tuple[Delivery | None, list[Delivery]]:
        """``delivery`` (started) settled: the next of its key to start, if it was acked, or
        every later one of its key held here, to give back with it."""
        key = delivery.ordering_key
        waiting = self._keys.get(key) if key else None
        if waiting is None:
            return None, []
        if delivery.returned or not waiting:
            del self._keys[key]
            self._full.discard(key)
            self.waiting -= len(waiting)
            return None, list(waiting)
        self.waiting -= 1
        return waiting.popleft(), []

    def release_all(self) -> list[Delivery]:
        """Every message waiting here (the pool goes quiet): none of them starts any more."""
        waiting = [d for queued in self._keys.values() for d in queued]
        for queued in self._keys.values():
            queued.clear()
        self.waiting = 0
        return waiting


class Unordered:
    """A subscription without message ordering: every message may start at once."""

    per_key: int | None = None
    waiting = 0

    def place(self, delivery: Delivery) -> Place:
        return Place.START

    def refused(self, delivery: Delivery) -> None:
        pass

    def settled(self, delivery: Delivery) -> tuple[Delivery | None, list[Delivery]]:
        return None, []

    def release_all(self) -> list[Delivery]:
        return []
