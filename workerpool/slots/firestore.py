"""Firestore slot store: one document per key, shared by replicas on many hosts."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any

from workerpool.slots.codec import decode, encode
from workerpool.slots.store import SlotStore, T, TableMutation
from workerpool.stores import firestore as docs


class FirestoreSlots(SlotStore):
    """A key's holders are one document, changed by one preconditioned write each time, so
    grants of one key are serialised by Firestore. That is what makes the limit exact, and
    also what bounds one key's rate: a document sustains about one write per second in
    production (more in bursts), far above what a limit of a few long jobs needs."""

    # A waiter's ask is decided on a copy of the key's document that a real-time listener
    # keeps (a grant or release reaches it within milliseconds), not a round trip: asking
    # often costs this process a little CPU, and Firestore nothing.
    poll_every = 0.02

    def __init__(
        self,
        project: str,
        collection: str,
        *,
        clock: Callable[[], float] = time.time,
        timeout: float = 5.0,
    ) -> None:
        super().__init__(clock=clock)
        self._docs = docs.Documents(project, collection, timeout=timeout, label="slot store")

    def _mutate_many(self, items: Sequence[tuple[str, TableMutation[T]]]) -> list[T]:
        return self._docs.mutate_many([(key, self._deciding(key, m)) for key, m in items])

    def _mutate_recent(self, key: str, mutation: TableMutation[T]) -> T:
        return self._docs.mutate(key, self._deciding(key, mutation), recent=True)

    def _deciding(self, key: str, mutation: TableMutation[T]) -> docs.Decision[T]:
        def decide(data: dict[str, Any] | None) -> tuple[T, docs.DocChange]:
            table = None if data is None else decode(json.loads(data["record"]))
            result, change = mutation(table, self._clock())
            # One string field, not nested maps: the emulator took seconds per write of a
            # record with a few hundred bookings as nested values.
            return result, None if change is None else {
                "key": key,
                "record": json.dumps(encode(change)),
            }

        return decide

    def on_change(self, key: str, callback: Callable[[], None]) -> None:
        self._docs.on_push(key, callback)

    def _records(self, prefix: str) -> list[str]:
        return self._docs.keys(prefix)

    def close(self) -> None:
        self._docs.close()
