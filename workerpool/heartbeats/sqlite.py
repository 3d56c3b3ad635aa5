"""Heartbeats of the worker processes of one host: a table in the idempotency store's file."""

from __future__ import annotations

import os
import threading

from workerpool.heartbeats.store import FORGET_AFTER, Beat, HeartbeatStore, decode, encode
from workerpool.stores.sqlite import connect, immediate, translated

_LABEL = "heartbeats"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS heartbeats (
    replica TEXT PRIMARY KEY,
    subscription TEXT NOT NULL,
    until REAL NOT NULL,
    beat TEXT NOT NULL
)
"""


class SqliteHeartbeats(HeartbeatStore):
    def __init__(self, path: str | os.PathLike[str], *, busy_timeout: float = 5.0) -> None:
        self._lock = threading.Lock()  # one connection: one statement at a time
        self._conn = connect(path, busy_timeout, _LABEL, lambda conn: conn.execute(_SCHEMA))

    def beat(self, beat: Beat) -> None:
        with self._lock, translated(_LABEL):
            self._conn.execute(
                "INSERT OR REPLACE INTO heartbeats VALUES (?, ?, ?, ?)",
                (beat.replica, beat.subscription, beat.until, encode(beat)),
            )

    def gone(self, replica: str) -> None:
        with self._lock, translated(_LABEL):
            self._conn.execute("DELETE FROM heartbeats WHERE replica = ?", (replica,))

    def live(self, subscription: str, now: float) -> list[Beat]:
        with self._lock, translated(_LABEL):
            rows = self._conn.execute(
                "SELECT beat FROM heartbeats WHERE subscription = ? AND until > ? ORDER BY replica",
                (subscription, now),
            ).fetchall()
            # A read most of the time: the write lock the claims need is taken only when
            # there is something to forget.
            (stale,) = self._conn.execute(
                "SELECT COUNT(*) FROM heartbeats WHERE until < ?", (now - FORGET_AFTER,)
            ).fetchone()
            if stale:
                with immediate(self._conn):
                    self._conn.execute(
                        "DELETE FROM heartbeats WHERE until < ?", (now - FORGET_AFTER,)
                    )
        return [decode(row[0]) for row in rows]

    def close(self) -> None:
        with self._lock:
            self._conn.close()
