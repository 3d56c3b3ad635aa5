"""The batches of the worker processes of one host: two tables in the idempotency store's
file, the batch records (each with its counts: the batch's one tally) and their ledger (one
row per child), each batch deleted once kept ``KEPT_AFTER_DEADLINE`` past its deadline."""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from workerpool.batches import store
from workerpool.batches.store import PENDING, Batch, BatchStore, T, Tally, Transaction
from workerpool.stores import StoreError
from workerpool.stores.sqlite import add_column, connect, immediate, translated

log = logging.getLogger(__name__)

_LABEL = "batch store"
_PURGE_EVERY = 1000  # calls between purges
_PURGED_BATCHES = 10  # batches a purge deletes at most
_PURGED_ROWS = 10_000  # and ledger rows
_SCHEMA = (
    """
    CREATE TABLE IF NOT EXISTS batches (
        batch_id TEXT PRIMARY KEY,
        topic TEXT NOT NULL,
        on_complete TEXT NOT NULL,
        total INTEGER NOT NULL,
        deadline REAL NOT NULL,
        committed INTEGER NOT NULL,
        done INTEGER NOT NULL,
        failed INTEGER NOT NULL,
        finalized_by TEXT NOT NULL,
        completion_sent INTEGER NOT NULL,
        trace TEXT NOT NULL DEFAULT '',
        children_digest TEXT NOT NULL DEFAULT ''
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS batch_children (
        batch_id TEXT NOT NULL,
        job_id TEXT NOT NULL,
        outcome TEXT NOT NULL,
        PRIMARY KEY (batch_id, job_id)
    )
    """,
    "CREATE INDEX IF NOT EXISTS batch_children_outcome ON batch_children (batch_id, outcome)",
)
_COLUMNS = (
    "batch_id, topic, on_complete, total, deadline, committed, done, failed, finalized_by, "
    "completion_sent, trace, children_digest"
)


def _batch(row: Any) -> Batch:
    batch_id, topic, on_complete, total, deadline, committed, done, failed, by, sent, *rest = row
    trace, digest = rest
    return Batch(
        batch_id, topic, on_complete, total, deadline, bool(committed), done, failed, by,
        bool(sent), trace, digest,
    )  # fmt: skip


class _Tables:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def batch(self, batch_id: str) -> Batch | None:
        row = self._conn.execute(
            f"SELECT {_COLUMNS} FROM batches WHERE batch_id = ?", (batch_id,)
        ).fetchone()
        return None if row is None else _batch(row)

    def put_batch(self, batch: Batch) -> None:
        self._conn.execute(
            f"INSERT OR REPLACE INTO batches ({_COLUMNS}) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                batch.batch_id, batch.topic, batch.on_complete, batch.total, batch.deadline,
                int(batch.committed), batch.done, batch.failed, batch.finalized_by,
                int(batch.completion_sent), batch.trace, batch.children_digest,
            ),
        )  # fmt: skip

    def batches(self, limit: int) -> list[Batch]:
        rows = self._conn.execute(
            f"SELECT {_COLUMNS} FROM batches ORDER BY deadline, batch_id LIMIT ?", (limit,)
        ).fetchall()
        return [_batch(row) for row in rows]

    def child(self, batch_id: str, job_id: str) -> tuple[str, Tally] | None:
        row = self._conn.execute(
            "SELECT outcome FROM batch_children WHERE batch_id = ? AND job_id = ?",
            (batch_id, job_id),
        ).fetchone()
        batch = self.batch(batch_id)
        return None if row is None or batch is None else (str(row[0]), Tally.of(batch))

    def put_child(self, batch_id: str, job_id: str, outcome: str, tally: Tally) -> None:
        self._conn.execute(
            "UPDATE batch_children SET outcome = ? WHERE batch_id = ? AND job_id = ?",
            (outcome, batch_id, job_id),
        )
        self._conn.execute(
            "UPDATE batches SET done = ?, failed = ? WHERE batch_id = ?",
            (tally.done, tally.failed, batch_id),
        )

    def tally(self, batch: Batch) -> Tally:
        return Tally.of(batch)

    def add_children(self, batch: Batch, job_ids: Sequence[str]) -> None:
        self._conn.executemany(
            "INSERT OR IGNORE INTO batch_children VALUES (?, ?, ?)",
            [(batch.batch_id, job_id, PENDING) for job_id in job_ids],
        )

    def has_children(self, batch_id: str, job_ids: Sequence[str]) -> bool:
        rows = self._conn.execute(
            "SELECT job_id FROM batch_children WHERE batch_id = ?", (batch_id,)
        ).fetchall()
        return set(job_ids) <= {str(row[0]) for row in rows}

    def unsent(self, limit: int) -> list[Batch]:
        rows = self._conn.execute(
            f"SELECT {_COLUMNS} FROM batches WHERE finalized_by != '' AND completion_sent = 0 "
            "ORDER BY deadline, batch_id LIMIT ?",
            (limit,),
        ).fetchall()
        return [_batch(row) for row in rows]

    def children(self, batch_id: str, outcome: str, limit: int) -> list[str]:
        rows = self._conn.execute(
            "SELECT job_id FROM batch_children WHERE batch_id = ? AND outcome = ? "
            "ORDER BY job_id LIMIT ?",
            (batch_id, outcome, limit),
        ).fetchall()
        return [str(row[0]) for row in rows]

    def count_children(self, batch_id: str, outcome: str) -> int:
        row = self._conn.execute(
            "SELECT COUNT(*) FROM batch_children WHERE batch_id = ? AND outcome = ?",
            (batch_id, outcome),
        ).fetchone()
        return int(row[0])


def _purge(conn: sqlite3.Connection, now: float) -> None:
    """Delete the batches kept past ``KEPT_AFTER_DEADLINE`` whose completion was handed over,
    ledger first, ``_PURGED_ROWS`` rows at most (a purge holds the file's write lock: a
    batch of a million children goes over several)."""
    left = _PURGED_ROWS
    rows = conn.execute(
        "SELECT batch_id FROM batches WHERE deadline < ? AND completion_sent = 1 LIMIT ?",
        (now - store.KEPT_AFTER_DEADLINE, _PURGED_BATCHES),
    ).fetchall()
    for (batch_id,) in rows:
        left -= conn.execute(
            "DELETE FROM batch_children WHERE rowid IN "
            "(SELECT rowid FROM batch_children WHERE batch_id = ? LIMIT ?)",
            (batch_id, left),
        ).rowcount
        if left <= 0:
            return  # its ledger may not be empty yet: its record goes in a later purge
        conn.execute("DELETE FROM batches WHERE batch_id = ?", (batch_id,))


def _create(conn: sqlite3.Connection) -> None:
    for statement in _SCHEMA:
        conn.execute(statement)
    # A store file written before batches kept their publisher's trace, or their digest.
    add_column(conn, "batches", "trace", "TEXT NOT NULL DEFAULT ''")
    add_column(conn, "batches", "children_digest", "TEXT NOT NULL DEFAULT ''")


class SqliteBatches(BatchStore):
    """Purges the batches kept past ``KEPT_AFTER_DEADLINE`` (by ``clock``) every
    ``_PURGE_EVERY`` calls, and when asked (a worker starting)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        busy_timeout: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._lock = threading.Lock()  # one connection: one transaction at a time
        self._clock = clock
        self._conn = connect(path, busy_timeout, _LABEL, _create)
        self._tables = _Tables(self._conn)
        self._calls = 0

    def _atomic(self, body: Callable[[Transaction], T]) -> T:
        with self._lock, translated(_LABEL), immediate(self._conn):
            result = body(self._tables)
            self._calls += 1
            due = self._calls % _PURGE_EVERY == 0
        if due:
            self.purge()
        return result

    def purge(self) -> None:
        """In a transaction of its own: one that fails is logged, and the next tries again
        (the call it came after is not failed with it)."""
        try:
            with self._lock, translated(_LABEL), immediate(self._conn):
                _purge(self._conn, self._clock())
        except StoreError as exc:
            log.warning("old batches not purged (%s); tried again later", exc)

    def close(self) -> None:
        with self._lock:
            self._conn.close()
