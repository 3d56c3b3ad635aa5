"""Opening an SQLite database that several worker processes share, and naming its errors."""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from workerpool.stores import StoreError, StoreUnavailable

# RETURNING (claims say in the same statement whether they won): 3.35, fixed in 3.35.4.
MIN_SQLITE = (3, 35, 4)


def connect(
    path: str | os.PathLike[str],
    busy_timeout: float,
    label: str,
    setup: Callable[[sqlite3.Connection], object] | None = None,
) -> sqlite3.Connection:
    """An autocommit connection in WAL mode (``synchronous=NORMAL``); the caller issues
    ``BEGIN IMMEDIATE`` itself. ``setup`` (the store's tables) runs on it before it is
    returned. Errors are ``StoreError``s naming ``label``; on one, the connection is closed."""
    if sqlite3.sqlite_version_info < MIN_SQLITE:
        # Else every claim would fail with a syntax error, read as an outage: say it once.
        raise StoreError(
            f"SQLite {label}: needs SQLite {'.'.join(map(str, MIN_SQLITE))} or newer; this "
            f"Python's sqlite3 has {sqlite3.sqlite_version}"
        )
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with translated(label):
        # isolation_level=None: we issue BEGIN IMMEDIATE ourselves instead of the module's
        # deferred BEGIN, which would take the write lock only at the first write and could
        # then fail with "database is locked" mid-transaction.
        # A statement per batch size (claims, IN lists): room for them all in the cache.
        conn = sqlite3.connect(
            path,
            timeout=busy_timeout,
            isolation_level=None,
            check_same_thread=False,
            cached_statements=512,
        )
        try:
            if _enable_wal(conn, busy_timeout):
                # NORMAL syncs the WAL at checkpoints, not at every COMMIT (FULL): even with
                # group commit, FULL did 25-30% fewer claim+complete pairs/s at 100 threads,
                # and 4x fewer next to a CPU-bound thread (the fsync hands it the GIL). A
                # commit still survives any process crash, SIGKILL included: it is in the OS's
                # cache. Only an OS crash or power loss can roll back the last commits (never
                # corrupt the file), and every worker on the host dies with them.
                conn.execute("PRAGMA synchronous=NORMAL")
            if setup is not None:
                setup(conn)
        except BaseException:
            conn.close()
            raise
    return conn


@contextmanager
def immediate(conn: sqlite3.Connection) -> Iterator[None]:
    """One ``BEGIN IMMEDIATE`` transaction: committed if the block ends, rolled back if it
    raises (the write lock is taken at once, so it cannot fail half-way for a lock)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def add_column(conn: sqlite3.Connection, table: str, column: str, definition: str) -> None:
    """Add ``column`` to a ``table`` made before it existed (a store file written by an older
    workerpool); two workers upgrading one file together both get through."""
    columns = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
    if column in columns:
        return
    try:
        conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")
    except sqlite3.OperationalError as exc:  # another worker added it just now
        if "duplicate column" not in str(exc):
            raise


@contextmanager
def translated(label: str) -> Iterator[None]:
    # OperationalError is SQLite's class for environmental failures: locked/busy past the
    # busy timeout, I/O errors, a file that cannot be opened: worth trying again later.
    try:
        yield
    except sqlite3.OperationalError as exc:
        raise StoreUnavailable(f"SQLite {label}: {exc}") from exc
    except sqlite3.Error as exc:  # not a database, corrupt, read-only: not soon better
        raise StoreError(f"SQLite {label}: {exc}") from exc


def _enable_wal(conn: sqlite3.Connection, busy_timeout: float) -> bool:
    """Switch to WAL, waiting out other processes doing the same to a new file: SQLite
    answers "database is locked" to this pragma at once instead of honouring the busy timeout
    (two workers opening a fresh store together failed 35 times in 80). False if the file
    system cannot do WAL (SQLite then keeps the old journal mode without an error)."""
    deadline = time.monotonic() + busy_timeout
    while True:
        try:
            return bool(conn.execute("PRAGMA journal_mode=WAL").fetchone()[0] == "wal")
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                raise
            time.sleep(0.05)
