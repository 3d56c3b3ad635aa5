"""The SQLite idempotency store's statements: its tables, and its claims and completions in SQL.

The WHERE clauses of ``claim_sql`` and ``COMPLETE`` are ``base.IdempotencyStore``'s rules for a
claim and a completion, in SQL; the parametrized backend suite holds them to the same behaviour
as the other backends.
"""

from __future__ import annotations

import functools
import sqlite3

from workerpool.idempotency.base import Record

SCHEMA = """
CREATE TABLE IF NOT EXISTS idempotency (
    job_id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    message_id TEXT NOT NULL,
    until REAL NOT NULL,
    completed_at REAL,
    expire_at REAL NOT NULL,
    failures INTEGER NOT NULL DEFAULT 0,
    token INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS idempotency_expire_at ON idempotency (expire_at);
CREATE TABLE IF NOT EXISTS failed_per_minute (minute INTEGER PRIMARY KEY, failed INTEGER NOT NULL);
"""
# A Record's fields, after its job id.
RECORD = "job_id, owner, message_id, until, completed_at, failures, token"
# Complete a job id: parameters ``job_id, owner, message_id, now, retention``; a completion
# within its retention stays (the first one).
COMPLETE = (
    "INSERT INTO idempotency VALUES (?1, ?2, ?3, ?4, ?4, ?4 + ?5, 0, 0)"
    " ON CONFLICT (job_id) DO UPDATE SET owner = excluded.owner,"
    " message_id = excluded.message_id, until = excluded.until,"
    " completed_at = excluded.completed_at, expire_at = excluded.expire_at"
    " WHERE NOT (completed_at IS NOT NULL AND completed_at + ?5 > ?4)"
)


# Parameters a row of ``complete_sql`` and of ``claim_sql`` binds (after two shared ones).
COMPLETE_BINDS = 3
CLAIM_BINDS = 4


@functools.cache
def complete_sql(rows: int) -> str:
    """``COMPLETE`` for ``rows`` job ids in one statement: parameters ``now, retention``, then
    ``job_id, owner, message_id`` per row. Rows of one job id apply in order, as ``COMPLETE``
    one after another would: the first completion stays."""
    values = ", ".join(
        f"(?{3 + 3 * i}, ?{4 + 3 * i}, ?{5 + 3 * i}, ?1, ?1, ?1 + ?2, 0, 0)" for i in range(rows)
    )
    return (
        f"INSERT INTO idempotency VALUES {values}"
        " ON CONFLICT (job_id) DO UPDATE SET owner = excluded.owner,"
        " message_id = excluded.message_id, until = excluded.until,"
        " completed_at = excluded.completed_at, expire_at = excluded.expire_at"
        " WHERE NOT (completed_at IS NOT NULL AND completed_at + ?2 > ?1)"
    )


@functools.cache
def claim_sql(rows: int) -> str:
    """Claim ``rows`` job ids: parameters ``now, retention``, then ``job_id, owner,
    message_id, until`` per row; returns ``job_id, failures, token`` of each claim won. The WHERE
    clause is ``base.IdempotencyStore``'s rule for a claim, in SQL (a free job id, an expired
    claim, a completion past its retention); the parametrized backend suite holds it to the
    same behaviour as the other backends."""
    values = ", ".join(
        f"(?{3 + 4 * i}, ?{4 + 4 * i}, ?{5 + 4 * i}, ?{6 + 4 * i}, NULL, ?{6 + 4 * i} + ?2, 0, 1)"
        for i in range(rows)
    )
    return (
        f"INSERT INTO idempotency VALUES {values}"
        " ON CONFLICT (job_id) DO UPDATE SET owner = excluded.owner,"
        " message_id = excluded.message_id, until = excluded.until, completed_at = NULL,"
        " expire_at = excluded.expire_at,"
        " failures = CASE WHEN completed_at IS NULL THEN failures ELSE 0 END,"
        " token = token + 1"
        " WHERE (completed_at IS NULL AND until <= ?1)"
        " OR (completed_at IS NOT NULL AND completed_at + ?2 <= ?1)"
        " RETURNING job_id, failures, token"
    )


def marks(count: int) -> str:
    return ", ".join(["?"] * count)


def delete_expired(conn: sqlite3.Connection, now: float) -> None:
    conn.execute("DELETE FROM idempotency WHERE expire_at <= ?", (now,))


@functools.cache
def replace_sql(rows: int) -> str:
    """Write ``rows`` whole records (``record_row`` each), over any of their job ids."""
    return "INSERT OR REPLACE INTO idempotency VALUES " + ", ".join([f"({marks(8)})"] * rows)


def record_row(job_id: str, r: Record, retention: float) -> tuple[object, ...]:
    """A record as a row of the table, in its columns' order."""
    return (job_id, r.owner, r.message_id, r.until, r.completed_at, r.expire_at(retention),
            r.failures, r.token)  # fmt: skip


# Completions and failed runs per minute, for the autoscaler's and dashboard's rates.
COMPLETED_PER_MINUTE = (
    "SELECT CAST(completed_at / 60 AS INTEGER) AS minute, COUNT(*) FROM idempotency"
    " WHERE completed_at >= ? GROUP BY minute"
)
ADD_FAILED = (
    "INSERT INTO failed_per_minute VALUES (?, ?) ON CONFLICT (minute)"
    " DO UPDATE SET failed = failed + excluded.failed"
)
DELETE_FAILED_BEFORE = "DELETE FROM failed_per_minute WHERE minute <= ?"
FAILED_SINCE = "SELECT minute, failed FROM failed_per_minute WHERE minute * 60 >= ?"
