"""Leases of the processes of one host: a table in the idempotency store's file."""

from __future__ import annotations

import os
import threading

from workerpool.leadership.decisions import Noted, appended, read
from workerpool.leadership.store import LeadershipStore, Lease, claimed, decode, encode, released
from workerpool.stores.sqlite import connect, immediate, translated

_LABEL = "leadership"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS leadership (
    name TEXT PRIMARY KEY,
    lease TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS autoscale_decisions (
    name TEXT PRIMARY KEY,
    entries TEXT NOT NULL
)
"""


class SqliteLeadership(LeadershipStore):
    """A claim is one ``BEGIN IMMEDIATE`` transaction: read, decide and write under the
    database's write lock, so two processes claiming together see one order."""

    def __init__(self, path: str | os.PathLike[str], *, busy_timeout: float = 5.0) -> None:
        self._lock = threading.Lock()  # one connection: one transaction at a time
        self._conn = connect(path, busy_timeout, _LABEL, lambda conn: conn.executescript(_SCHEMA))

    def claim(self, name: str, holder: str, now: float, ttl: float) -> Lease:
        with self._lock, translated(_LABEL), immediate(self._conn):
            lease, changed = claimed(self._read(name), holder, now, ttl)
            if changed:
                self._write(name, lease)
            return lease

    def release(self, name: str, holder: str) -> None:
        with self._lock, translated(_LABEL), immediate(self._conn):
            lease = released(self._read(name), holder)
            if lease is not None:
                self._write(name, lease)

    def note(self, name: str, noted: Noted) -> None:
        with self._lock, translated(_LABEL), immediate(self._conn):
            entries = appended(self._entries(name), noted)
            self._conn.execute(
                "INSERT OR REPLACE INTO autoscale_decisions VALUES (?, ?)", (name, entries)
            )

    def decisions(self, name: str) -> list[Noted]:
        with self._lock, translated(_LABEL):
            return read(self._entries(name))

    def _entries(self, name: str) -> str | None:
        row = self._conn.execute(
            "SELECT entries FROM autoscale_decisions WHERE name = ?", (name,)
        ).fetchone()
        return None if row is None else str(row[0])

    def _write(self, name: str, lease: Lease) -> None:
        self._conn.execute("INSERT OR REPLACE INTO leadership VALUES (?, ?)", (name, encode(lease)))

    def _read(self, name: str) -> Lease | None:
        row = self._conn.execute("SELECT lease FROM leadership WHERE name = ?", (name,)).fetchone()
        return None if row is None else decode(row[0])

    def close(self) -> None:
        with self._lock:
            self._conn.close()
