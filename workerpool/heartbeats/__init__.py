"""Heartbeats: each replica's record of what it runs and holds, in the store the fleet shares
(the idempotency store's URL: a table beside the claims on SQLite, the collection
``<COLLECTION>-heartbeats`` on Firestore), read by the autoscaler."""

from __future__ import annotations

from collections.abc import Callable

from workerpool.heartbeats.memory import MemoryHeartbeats
from workerpool.heartbeats.sqlite import SqliteHeartbeats
from workerpool.heartbeats.store import Beat, HeartbeatStore
from workerpool.stores import opener

__all__ = ["Beat", "HeartbeatStore", "MemoryHeartbeats", "SqliteHeartbeats", "heartbeat_opener"]


def heartbeat_opener(url: str) -> Callable[[], HeartbeatStore] | None:
    """What opens the heartbeats beside the idempotency store ``url`` names; None for
    ``none`` (nothing is shared: no replica can be seen by another process). Raises
    ValueError for a URL it does not know, ImportError for a missing extra."""
    return opener(url, "heartbeats", memory=MemoryHeartbeats, sqlite=SqliteHeartbeats,
                  firestore=_firestore)  # fmt: skip


def _firestore() -> Callable[[str, str], HeartbeatStore]:
    from workerpool.heartbeats.firestore import FirestoreHeartbeats

    return lambda project, collection: FirestoreHeartbeats(project, f"{collection}-heartbeats")
