"""Checkpoints and progress of the worker processes of one host: two tables in the
idempotency store's file."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

from workerpool.progress.store import FORGET_AFTER, JobStateStore, Report, decode, encode
from workerpool.stores.sqlite import connect, immediate, translated

_LABEL = "checkpoints"
_MAX_IN = 500  # job ids a statement binds: under SQLite's historical limit of 999
_SCHEMA = """
CREATE TABLE IF NOT EXISTS checkpoints (
    job_id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS progress (
    key TEXT PRIMARY KEY,
    started REAL NOT NULL,
    until REAL NOT NULL,
    report TEXT NOT NULL
);
"""


class SqliteJobState(JobStateStore):
    def __init__(self, path: str | os.PathLike[str], *, busy_timeout: float = 5.0) -> None:
        self._lock = threading.Lock()  # one connection: one statement at a time
        self._conn = connect(path, busy_timeout, _LABEL, lambda conn: conn.executescript(_SCHEMA))

    def save(self, job_id: str, state: str, at: float) -> None:
        # Autocommit: the row is in the file (the OS's cache: it survives a kill -9) once
        # the statement returns.
        with self._lock, translated(_LABEL):
            self._conn.execute(
                "INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?)", (job_id, state, at)
            )

    def load(self, job_id: str) -> str | None:
        with self._lock, translated(_LABEL):
            row = self._conn.execute(
                "SELECT state FROM checkpoints WHERE job_id = ?", (job_id,)
            ).fetchone()
        return None if row is None else str(row[0])

    def load_many(self, job_ids: Sequence[str]) -> dict[str, str]:
        found: dict[str, str] = {}
        with self._lock, translated(_LABEL):
            for at in range(0, len(job_ids), _MAX_IN):
                chunk = job_ids[at : at + _MAX_IN]
                marks = ", ".join("?" * len(chunk))
                found.update(
                    self._conn.execute(
                        f"SELECT job_id, state FROM checkpoints WHERE job_id IN ({marks})", chunk
                    ).fetchall()
                )
        return found

    def forget(self, job_ids: Sequence[str]) -> None:
        with self._lock, translated(_LABEL), immediate(self._conn):
            self._conn.executemany(
                "DELETE FROM checkpoints WHERE job_id = ?", [(job_id,) for job_id in job_ids]
            )

    def report(self, reports: Sequence[Report]) -> None:
        with self._lock, translated(_LABEL), immediate(self._conn):
            self._conn.executemany(
                "INSERT OR REPLACE INTO progress VALUES (?, ?, ?, ?)",
                [(r.key, r.started, r.until, encode(r)) for r in reports],
            )

    def ended(self, keys: Sequence[str]) -> None:
        with self._lock, translated(_LABEL), immediate(self._conn):
            self._conn.executemany("DELETE FROM progress WHERE key = ?", [(k,) for k in keys])

    def running(self, now: float) -> list[Report]:
        with self._lock, translated(_LABEL):
            rows = self._conn.execute(
                "SELECT report FROM progress WHERE until > ? ORDER BY started, key", (now,)
            ).fetchall()
            # A read most of the time: the write lock is taken only when there is something
            # to forget.
            (stale,) = self._conn.execute(
                "SELECT COUNT(*) FROM progress WHERE until < ?", (now - FORGET_AFTER,)
            ).fetchone()
            if stale:
                with immediate(self._conn):
                    self._conn.execute(
                        "DELETE FROM progress WHERE until < ?", (now - FORGET_AFTER,)
                    )
        return [decode(row[0]) for row in rows]

    def close(self) -> None:
        with self._lock:
            self._conn.close()
