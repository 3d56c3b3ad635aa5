"""A resource that fences its writes, for ``tests.fencing_jobs`` and the test that reads what
it was sent. It keeps the highest token it has seen and refuses older ones, as a database row
guarded by a token column, or an object store's conditional write, would. Kept apart from the
job so that a test process importing it registers no job (the test kit's ``worker`` fixture
runs every registered job).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path

RESOURCE_ENV = "FENCED_RESOURCE"
KEY = "fenced"  # its concurrency key: the worker declares its limit


@dataclass(frozen=True)
class Write:
    pid: int
    token: int
    what: str
    accepted: bool


class FencedResource:
    """Writes by fencing token in one SQLite file, every one of them recorded, refused or not."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = Path(path)

    def _connect(self) -> contextlib.closing[sqlite3.Connection]:
        conn = sqlite3.connect(self._path, timeout=30, isolation_level=None)
        conn.execute(
            "CREATE TABLE IF NOT EXISTS writes (n INTEGER PRIMARY KEY, pid INTEGER,"
            " token INTEGER, what TEXT, accepted INTEGER)"
        )
        return contextlib.closing(conn)

    def write(self, token: int, what: str) -> bool:
        """Accept ``what`` unless a write with a newer token came first."""
        with self._connect() as conn:
            conn.execute("BEGIN IMMEDIATE")
            (highest,) = conn.execute(
                "SELECT coalesce(max(token), 0) FROM writes WHERE accepted"
            ).fetchone()
            accepted = token >= int(highest)
            conn.execute(
                "INSERT INTO writes (pid, token, what, accepted) VALUES (?, ?, ?, ?)",
                (os.getpid(), token, what, accepted),
            )
            conn.execute("COMMIT")
        return accepted

    def writes(self) -> list[Write]:
        if not self._path.exists():
            return []
        with self._connect() as conn:
            rows = conn.execute("SELECT pid, token, what, accepted FROM writes ORDER BY n")
            return [Write(pid, token, what, bool(accepted)) for pid, token, what, accepted in rows]
