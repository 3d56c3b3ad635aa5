"""Idempotency store: at most one worker runs a job id at a time, and a completed one never again.

``open_store`` URLs (``workerpool.stores.Location``):

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
from workerpool.stores import opener

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

StoreOpener = Callable[[], IdempotencyStore]


def store_opener(url: str, *, retention: float = DEFAULT_RETENTION) -> StoreOpener | None:
    """What opens the store a URL names (None for ``none``), checked now, opened later.
    Raises ValueError for a URL it does not know, ImportError for a missing extra."""

    def firestore() -> Callable[[str, str], IdempotencyStore]:
        # Imported here so the package works without the optional google-cloud-firestore.
        from workerpool.idempotency.firestore import FirestoreStore

        return lambda project, collection: FirestoreStore(project, collection, retention=retention)

    return opener(
        url,
        "idempotency store",
        memory=lambda: MemoryStore(retention=retention),
        sqlite=lambda path: SqliteStore(path, retention=retention),
        firestore=firestore,
    )


def open_store(url: str, *, retention: float = DEFAULT_RETENTION) -> IdempotencyStore | None:
    """Open the store a URL names; None for ``none``. Raises ValueError for anything else."""
    opener = store_opener(url, retention=retention)
    return None if opener is None else opener()
