"""One message at a time per ordering key, in the order received (ordered subscriptions only).

On a subscription with message ordering, Pub/Sub delivers a key's messages in order and holds
the key back while any of them is outstanding, but one pull may bring many of one key at
once. The pool asks ``place`` where each admitted message goes: a message with no key, or
whose key has nothing here yet, may start now; a later one of a busy key waits here, holding
no slot, until the one before it has settled (``settled``). A key keeps at most
``waiting_per_key`` messages waiting, so one key's backlog never fills the prefetch while
other keys have work: the rest are given back at once, and Pub/Sub delivers them again only
after those held are settled (measured on the emulator), still in order.

A message given back (a retry, a deferral, a drain, a lost claim) takes every later message of
its key held here with it, so Pub/Sub redelivers the key from that message on, in order, and
no later message is ever acked before it. Not thread-safe: the pool calls it under its lock.
"""

from __future__ import annotations

import collections
import enum

from workerpool.worker.delivery import Delivery


class Place(enum.Enum):
    START = "start"  # may start now
    WAIT = "wait"  # waits here for the one before it
    RELEASE = "release"  # its key has enough waiting: give it back now


class Sequencer:
    def __init__(self, waiting_per_key: int) -> None:
        if waiting_per_key < 0:
            raise ValueError(f"waiting_per_key must be 0 or more, got {waiting_per_key}")
        self._waiting_per_key = waiting_per_key
        # By key: the messages after the one started (not started yet), oldest first. A key
        # is here exactly while one of its messages has started and not settled.
        self._keys: dict[str, collections.deque[Delivery]] = {}

    def place(self, delivery: Delivery) -> Place:
        key = delivery.ordering_key
        if not key:
            return Place.START
        waiting = self._keys.get(key)
        if waiting is None:
            self._keys[key] = collections.deque()
            return Place.START
        if len(waiting) >= self._waiting_per_key:
            return Place.RELEASE
        waiting.append(delivery)
        return Place.WAIT

    def settled(self, delivery: Delivery) -> tuple[Delivery | None, list[Delivery]]:
        """``delivery`` (started) settled: the next of its key to start, if it was acked, or
        every later one of its key held here, to give back with it."""
        key = delivery.ordering_key
        waiting = self._keys.get(key) if key else None
        if waiting is None:
            return None, []
        if delivery.returned:
            del self._keys[key]
            return None, list(waiting)
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
