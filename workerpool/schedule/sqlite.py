"""The schedule of the worker processes of one host: a table in the idempotency store's file."""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from collections.abc import Sequence
from typing import Any

from workerpool.schedule.store import Entry, ScheduleStore
from workerpool.stores.sqlite import connect, immediate, translated

_LABEL = "schedule"
_SCHEMA = (
    """
    CREATE TABLE IF NOT EXISTS schedule (
        topic TEXT NOT NULL,
        job_id TEXT NOT NULL,
        due REAL NOT NULL,
        ready_at REAL NOT NULL,
        data BLOB NOT NULL,
        attributes TEXT NOT NULL,
        PRIMARY KEY (topic, job_id)
    )
    """,
    "CREATE INDEX IF NOT EXISTS schedule_ready ON schedule (topic, ready_at)",
)
_COLUMNS = "topic, job_id, due, data, attributes"


def _entry(row: Any) -> Entry:
    topic, job_id, due, data, attributes = row
    return Entry(topic, job_id, float(due), bytes(data), json.loads(attributes))


def _create(conn: sqlite3.Connection) -> None:
    for statement in _SCHEMA:
        conn.execute(statement)


class SqliteSchedule(ScheduleStore):
    def __init__(self, path: str | os.PathLike[str], *, busy_timeout: float = 5.0) -> None:
        self._lock = threading.Lock()  # one connection: one transaction at a time
        self._conn = connect(path, busy_timeout, _LABEL, _create)

    def add(self, entry: Entry) -> bool:
        with self._lock, translated(_LABEL):
            cursor = self._conn.execute(
                "INSERT OR IGNORE INTO schedule VALUES (?, ?, ?, ?, ?, ?)",
                (
                    entry.topic, entry.job_id, entry.due, entry.due, entry.data,
                    json.dumps(entry.attributes),
                ),
            )  # fmt: skip
            return cursor.rowcount == 1

    def claim_due(
        self, topic: str, now: float, lease: float, limit: int
    ) -> tuple[list[Entry], float | None]:
        with self._lock, translated(_LABEL):
            # A read first: most wakes find nothing due, and need not take the write lock
            # the idempotency claims wait for.
            next_ready = self._next_ready(topic)
            if next_ready is None or next_ready > now:
                return [], next_ready
            with immediate(self._conn):
                rows = self._conn.execute(
                    f"SELECT {_COLUMNS} FROM schedule WHERE topic = ? AND ready_at <= ? "
                    "ORDER BY ready_at LIMIT ?",
                    (topic, now, limit),
                ).fetchall()
                self._conn.executemany(
                    "UPDATE schedule SET ready_at = ? WHERE topic = ? AND job_id = ?",
                    [(now + lease, topic, row[1]) for row in rows],
                )
                next_ready = self._next_ready(topic)
        return [_entry(row) for row in rows], next_ready

    def _next_ready(self, topic: str) -> float | None:
        (ready_at,) = self._conn.execute(
            "SELECT MIN(ready_at) FROM schedule WHERE topic = ?", (topic,)
        ).fetchone()
        return None if ready_at is None else float(ready_at)

    def fired(self, topic: str, job_ids: Sequence[str]) -> None:
        with self._lock, translated(_LABEL), immediate(self._conn):
            self._conn.executemany(
                "DELETE FROM schedule WHERE topic = ? AND job_id = ?",
                [(topic, job_id) for job_id in job_ids],
            )

    def entries(self, topic: str | None = None, limit: int = 100) -> list[Entry]:
        with self._lock, translated(_LABEL):
            rows = self._conn.execute(
                f"SELECT {_COLUMNS} FROM schedule WHERE ?1 IS NULL OR topic = ?1 "
                "ORDER BY due, job_id LIMIT ?2",
                (topic, limit),
            ).fetchall()
        return [_entry(row) for row in rows]

    def close(self) -> None:
        with self._lock:
            self._conn.close()
