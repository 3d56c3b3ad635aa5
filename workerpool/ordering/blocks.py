"""Ordering keys blocked until an operator acts: the store every replica shares.

A key is blocked when a job that asks for it (``@job(..., ordered_exhausted="block")``)
exhausts its attempts on an ordered subscription; while it is, every later message of the key
is given back unrun. ``workerpool ordering unblock KEY`` lets the key go on.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

from workerpool.stores.sqlite import connect, immediate, translated

_LABEL = "blocked-keys store"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS ordering_blocks (
    key TEXT PRIMARY KEY,
    job TEXT NOT NULL,
    job_id TEXT NOT NULL,
    blocked_at REAL NOT NULL
)
"""


@dataclass(frozen=True)
class Block:
    """A blocked key, and the job whose last attempt failed."""

    key: str
    job: str
    job_id: str
    blocked_at: float  # wall clock, seconds


class BlockedKeys(Protocol):
    def block(self, key: str, job: str, job_id: str) -> None: ...

    def blocker(self, key: str) -> str | None:
        """The job id that blocked ``key``; None if it is not blocked."""
        ...

    def unblock(self, key: str) -> bool:
        """False if ``key`` was not blocked."""
        ...

    def all(self) -> list[Block]: ...

    def close(self) -> None: ...


class MemoryBlocks:
    """One process's blocked keys (the memory idempotency store's worker, and tests)."""

    def __init__(self) -> None:
        self._blocks: dict[str, Block] = {}
        self._lock = threading.Lock()

    def block(self, key: str, job: str, job_id: str) -> None:
        with self._lock:
            self._blocks[key] = Block(key, job, job_id, time.time())

    def blocker(self, key: str) -> str | None:
        block = self._blocks.get(key)
        return None if block is None else block.job_id

    def unblock(self, key: str) -> bool:
        with self._lock:
            return self._blocks.pop(key, None) is not None

    def all(self) -> list[Block]:
        with self._lock:
            return sorted(self._blocks.values(), key=lambda b: b.key)

    def close(self) -> None:
        pass  # nothing held beyond this process's memory


class SqliteBlocks:
    """The blocked keys in a table of the idempotency store's file."""

    def __init__(self, path: str | os.PathLike[str], busy_timeout: float = 5.0) -> None:
        self._conn = connect(path, busy_timeout, _LABEL, lambda conn: conn.execute(_SCHEMA))
        self._lock = threading.Lock()

    def block(self, key: str, job: str, job_id: str) -> None:
        self._write(
            "INSERT OR REPLACE INTO ordering_blocks VALUES (?, ?, ?, ?)",
            (key, job, job_id, time.time()),
        )

    def blocker(self, key: str) -> str | None:
        rows = self._read("SELECT job_id FROM ordering_blocks WHERE key = ?", (key,))
        return str(rows[0][0]) if rows else None

    def unblock(self, key: str) -> bool:
        return self._write("DELETE FROM ordering_blocks WHERE key = ?", (key,)) > 0

    def all(self) -> list[Block]:
        rows = self._read("SELECT key, job, job_id, blocked_at FROM ordering_blocks ORDER BY key")
        return [Block(*row) for row in rows]

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def _read(self, sql: str, args: tuple[object, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock, translated(_LABEL):
            return list(self._conn.execute(sql, args))

    def _write(self, sql: str, args: tuple[object, ...]) -> int:
        with self._lock, translated(_LABEL), immediate(self._conn):
            cursor: sqlite3.Cursor = self._conn.execute(sql, args)
            return cursor.rowcount
