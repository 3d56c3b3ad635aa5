"""Cancels of the worker processes of one host: a table in the idempotency store's file."""

from __future__ import annotations

import os
import threading
from collections.abc import Collection

from workerpool.control.store import Cancel, CancelStore
from workerpool.stores.sqlite import connect, immediate, translated

_LABEL = "cancels"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS cancels (
    job_id TEXT PRIMARY KEY,
    reason TEXT NOT NULL,
    at REAL NOT NULL
)
"""
# SQLite's default bound on the parameters of one statement is 32766 (999 before 3.32): the
# job ids a worker holds are far fewer, but a query never risks it.
_CHUNK = 500


class SqliteCancels(CancelStore):
    def __init__(
        self, path: str | os.PathLike[str], *, retention: float, busy_timeout: float = 5.0
    ) -> None:
        super().__init__(retention=retention)
        self._lock = threading.Lock()  # one connection: one statement at a time
        self._conn = connect(path, busy_timeout, _LABEL, lambda conn: conn.execute(_SCHEMA))

    def add(self, cancel: Cancel) -> Cancel:
        with self._lock, translated(_LABEL), immediate(self._conn):
            # Cancels past their retention go as a new one comes: a write, which holds the
            # write lock already; the job ids' primary key serves every read.
            self._conn.execute("DELETE FROM cancels WHERE at <= ?", (cancel.at - self.retention,))
            self._conn.execute(
                "INSERT OR IGNORE INTO cancels VALUES (?, ?, ?)",
                (cancel.job_id, cancel.reason, cancel.at),
            )
            row = self._conn.execute(
                "SELECT job_id, reason, at FROM cancels WHERE job_id = ?", (cancel.job_id,)
            ).fetchone()
        return Cancel(*row)

    def find(self, job_ids: Collection[str], now: float) -> dict[str, Cancel]:
        ids = list(job_ids)
        found: dict[str, Cancel] = {}
        with self._lock, translated(_LABEL):
            for start in range(0, len(ids), _CHUNK):
                chunk = ids[start : start + _CHUNK]
                rows = self._conn.execute(
                    "SELECT job_id, reason, at FROM cancels WHERE at > ? AND job_id IN "
                    f"({','.join('?' * len(chunk))})",
                    (now - self.retention, *chunk),
                ).fetchall()
                found.update((row[0], Cancel(*row)) for row in rows)
        return found

    def close(self) -> None:
        with self._lock:
            self._conn.close()
