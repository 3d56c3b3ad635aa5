"""SQLite slot store: several worker processes on one host, in the idempotency store's file."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Sequence

from workerpool.slots.codec import decode, encode
from workerpool.slots.store import SlotStore, T, Table, TableMutation
from workerpool.stores.sqlite import connect, immediate, translated

_LABEL = "slot store"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS slots (
    key TEXT PRIMARY KEY,
    record TEXT NOT NULL
)
"""


class SqliteSlots(SlotStore):
    """Each call is one ``BEGIN IMMEDIATE`` transaction: every key it touches is read,
    decided and written under the database's write lock, so processes sharing the file see
    one order of grants. A key's record is one JSON column: a key has a handful of slots and
    waiters, and one row per key makes a grant one read and one write."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        clock: Callable[[], float] = time.time,
        busy_timeout: float = 5.0,
    ) -> None:
        super().__init__(clock=clock)
        self._lock = threading.Lock()  # one connection: one transaction at a time
        self._conn = connect(path, busy_timeout, _LABEL, lambda conn: conn.execute(_SCHEMA))

    def _mutate_many(self, items: Sequence[tuple[str, TableMutation[T]]]) -> list[T]:
        with self._lock, translated(_LABEL), immediate(self._conn):
            return [self._mutate(key, mutation) for key, mutation in items]

    def _mutate_recent(self, key: str, mutation: TableMutation[T]) -> T:
        # A waiter's ask, most of the time, changes nothing: decided on a plain read (WAL
        # readers never wait for a writer), it needs no write lock, which four processes'
        # waiters polling every 20-50 ms took from the claims and the grants otherwise.
        with self._lock, translated(_LABEL):
            result, change = mutation(self._read(key), self._clock())
        if change is None:
            return result
        return self._mutate_many([(key, mutation)])[0]

    def _read(self, key: str) -> Table | None:
        row = self._conn.execute("SELECT record FROM slots WHERE key = ?", (key,)).fetchone()
        return None if row is None else decode(json.loads(row[0]))

    def _mutate(self, key: str, mutation: TableMutation[T]) -> T:
        result, change = mutation(self._read(key), self._clock())
        if change is not None:
            self._conn.execute(
                "INSERT OR REPLACE INTO slots VALUES (?, ?)", (key, json.dumps(encode(change)))
            )
        return result

    def _records(self, prefix: str) -> list[str]:
        # substr, not LIKE: a key may hold LIKE's wildcards.
        with self._lock, translated(_LABEL):
            rows = self._conn.execute(
                "SELECT key FROM slots WHERE substr(key, 1, ?) = ? ORDER BY key",
                (len(prefix), prefix),
            ).fetchall()
        return [row[0] for row in rows]

    def close(self) -> None:
        with self._lock:
            self._conn.close()
