"""Idempotency store: at most one worker runs a job id at a time, and a completed one never again.

``open_store`` URLs:

- ``sqlite:///relative/path.db`` (relative to the working directory) or
  ``sqlite:////absolute/path.db`` (four slashes: the path keeps its leading "/"), as SQLAlchemy
  spells them; the parent directory is created if missing.
- ``firestore://PROJECT/COLLECTION`` (needs ``workerpool[firestore]``; honours
  ``FIRESTORE_EMULATOR_HOST``).
- ``memory://`` (this process only), and ``none`` to turn idempotency off.
"""

from __future__ import annotations

from collections.abc import Callable

from workerpool.idempotency.base import (
    DEFAULT_RETENTION,
    Claimed,
    ClaimResult,
    Done,
    HeldElsewhere,
    IdempotencyStore,
    StoreError,
    StoreUnavailable,
)
from workerpool.idempotency.memory import MemoryStore
from workerpool.idempotency.sqlite import SqliteStore

__all__ = [
    "DEFAULT_RETENTION",
    "ClaimResult",
    "Claimed",
    "Done",
    "HeldElsewhere",
    "IdempotencyStore",
    "MemoryStore",
    "SqliteStore",
    "StoreError",
    "StoreUnavailable",
    "open_store",
    "store_opener",
]

_EXPECTED = "expected sqlite:///PATH, firestore://PROJECT/COLLECTION, memory:// or none"

StoreOpener = Callable[[], IdempotencyStore]


def store_opener(url: str, *, retention: float = DEFAULT_RETENTION) -> StoreOpener | None:
    """What opens the store a URL names (None for ``none``), checked now, opened later.
    Raises ValueError for a URL it does not know, ImportError for a missing extra."""
    if url == "none":
        return None
    if url == "memory://":
        return lambda: MemoryStore(retention=retention)
    scheme, sep, rest = url.partition("://")
    if sep and scheme == "sqlite" and rest.startswith("/") and rest != "/":
        return lambda: SqliteStore(rest[1:], retention=retention)
    if sep and scheme == "firestore":
        project, _, collection = rest.partition("/")
        if project and collection and "/" not in collection:
            return _firestore_opener(project, collection, retention)
    raise ValueError(f"unsupported idempotency store URL {url!r}: {_EXPECTED}")


def open_store(url: str, *, retention: float = DEFAULT_RETENTION) -> IdempotencyStore | None:
    """Open the store a URL names; None for ``none``. Raises ValueError for anything else."""
    opener = store_opener(url, retention=retention)
    return None if opener is None else opener()


def _firestore_opener(project: str, collection: str, retention: float) -> StoreOpener:
    # Imported here so the package works without the optional google-cloud-firestore.
    try:
        from workerpool.idempotency.firestore import FirestoreStore
    except ImportError as exc:
        raise ImportError(
            "firestore:// idempotency store needs google-cloud-firestore: "
            "pip install 'workerpool[firestore]'"
        ) from exc
    return lambda: FirestoreStore(project, collection, retention=retention)
