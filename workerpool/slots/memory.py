"""In-memory slot store: one process only (unit tests, a single worker)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from workerpool.slots.store import SlotStore, T, Table, TableMutation


class MemorySlots(SlotStore):
    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        super().__init__(clock=clock)
        self._tables: dict[str, Table] = {}
        self._lock = threading.Lock()

    def _mutate_many(self, items: Sequence[tuple[str, TableMutation[T]]]) -> list[T]:
        results = []
        with self._lock:
            for key, mutation in items:
                result, change = mutation(self._tables.get(key), self._clock())
                if change is not None:
                    self._tables[key] = change
                results.append(result)
        return results

    def _records(self, prefix: str) -> list[str]:
        with self._lock:
            return sorted(key for key in self._tables if key.startswith(prefix))

    def close(self) -> None:
        pass
