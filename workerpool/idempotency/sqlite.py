"""SQLite backend: the embedded default, shared safely by several worker processes on one host."""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from workerpool.idempotency.base import (
    DEFAULT_RETENTION,
    DELETE,
    IdempotencyStore,
    Mutation,
    Record,
    StoreUnavailable,
    T,
)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS idempotency (
    job_id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    message_id TEXT NOT NULL,
    until REAL NOT NULL,
    completed_at REAL,
    expire_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS idempotency_expire_at ON idempotency (expire_at);
"""
_PURGE_EVERY = 1000  # mutations between purges; the expire_at index keeps each purge cheap


class SqliteStore(IdempotencyStore):
    """One connection per store behind a lock; every operation is a BEGIN IMMEDIATE transaction.

    WAL lets readers and the single writer proceed together; the busy timeout bounds how long
    a call waits for another process's write lock before raising ``StoreUnavailable``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        retention: float = DEFAULT_RETENTION,
        clock: Callable[[], float] = time.time,
        busy_timeout: float = 5.0,
    ) -> None:
        super().__init__(retention=retention, clock=clock)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._mutations = 0
        with _translated():
            # isolation_level=None: we issue BEGIN IMMEDIATE ourselves instead of the module's
            # deferred BEGIN, which would take the write lock only at the first write and
            # could then fail with "database is locked" mid-transaction.
            self._conn = sqlite3.connect(
                path, timeout=busy_timeout, isolation_level=None, check_same_thread=False
            )
            try:
                _enable_wal(self._conn, busy_timeout)
                self._conn.executescript(_SCHEMA)
                self._purge()
            except BaseException:
                self._conn.close()
                raise

    def _mutate(self, job_id: str, mutation: Mutation[T]) -> T:
        with self._lock, _translated():
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                result = self._apply(job_id, mutation)
                self._conn.execute("COMMIT")
            except BaseException:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise
            self._mutations += 1
            if self._mutations % _PURGE_EVERY == 0:
                self._purge()
            return result

    def _apply(self, job_id: str, mutation: Mutation[T]) -> T:
        row = self._conn.execute(
            "SELECT owner, message_id, until, completed_at FROM idempotency WHERE job_id = ?",
            (job_id,),
        ).fetchone()
        result, change = mutation(Record(*row) if row else None, self._clock())
        if change == DELETE:
            self._conn.execute("DELETE FROM idempotency WHERE job_id = ?", (job_id,))
        elif isinstance(change, Record):
            self._conn.execute(
                "INSERT OR REPLACE INTO idempotency VALUES (?, ?, ?, ?, ?, ?)",
                (
                    job_id,
                    change.owner,
                    change.message_id,
                    change.until,
                    change.completed_at,
                    change.expire_at(self.retention),
                ),
            )
        return result

    def _purge(self) -> None:
        # Autocommit statement: it takes the write lock only for its own short duration.
        self._conn.execute("DELETE FROM idempotency WHERE expire_at <= ?", (self._clock(),))

    def close(self) -> None:
        with self._lock:
            self._conn.close()


@contextmanager
def _translated() -> Iterator[None]:
    # OperationalError is SQLite's class for environmental failures: locked/busy past the
    # busy timeout, I/O errors, a file that cannot be opened. Programming errors stay as they are.
    try:
        yield
    except sqlite3.OperationalError as exc:
        raise StoreUnavailable(f"SQLite idempotency store: {exc}") from exc


def _enable_wal(conn: sqlite3.Connection, busy_timeout: float) -> None:
    """Switch to WAL, waiting out other processes doing the same to a new file: SQLite
    answers "database is locked" to this pragma at once instead of honouring the busy timeout
    (two workers opening a fresh store together failed 35 times in 80)."""
    deadline = time.monotonic() + busy_timeout
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                raise
            time.sleep(0.05)
