"""Firestore slot store: one document per key, shared by replicas on many hosts."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from workerpool.slots.store import Holding, SlotStore, T, Table, TableMutation
from workerpool.stores import firestore as docs


class FirestoreSlots(SlotStore):
    """A key's holders are one document, changed by one preconditioned write each time, so
    grants of one key are serialised by Firestore. That is what makes the limit exact, and
    also what bounds one key's rate: a document sustains about one write per second in
    production (more in bursts), far above what a limit of a few long jobs needs."""

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

    def _deciding(self, key: str, mutation: TableMutation[T]) -> docs.Decision[T]:
        def decide(data: dict[str, Any] | None) -> tuple[T, docs.DocChange]:
            result, change = mutation(None if data is None else _decode(data), self._clock())
            return result, None if change is None else _encode(key, change)

        return decide

    def close(self) -> None:
        self._docs.close()


def _encode(key: str, table: Table) -> dict[str, Any]:
    # A list, not a map keyed by holder: map keys would be read as field paths by update().
    holders = [
        {"holder": holder, "until": float(lease.until), "token": lease.token}
        for holder, lease in table.holders.items()
    ]
    return {"key": key, "holders": holders, "next_token": table.next_token}


def _decode(data: dict[str, Any]) -> Table:
    holders = {
        entry["holder"]: Holding(float(entry["until"]), int(entry["token"]))
        for entry in data.get("holders", [])
    }
    return Table(holders, int(data.get("next_token", 1)))
