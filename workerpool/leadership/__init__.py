"""Leadership: which one of several processes (autoscalers of one subscription) acts, from a
lease record with a TTL and a fencing token in the store the fleet shares (the idempotency
store's URL: a table beside the claims on SQLite, the collection ``<COLLECTION>-leadership``
on Firestore), and the leading autoscaler's last decisions beside them (the table
``autoscale_decisions``; the collection ``<COLLECTION>-decisions``)."""

from __future__ import annotations

from collections.abc import Callable

from workerpool.leadership.decisions import Noted
from workerpool.leadership.memory import MemoryLeadership
from workerpool.leadership.sqlite import SqliteLeadership
from workerpool.leadership.store import LeadershipStore, Lease
from workerpool.stores import opener

__all__ = [
    "LeadershipStore",
    "Lease",
    "MemoryLeadership",
    "Noted",
    "SqliteLeadership",
    "leadership_opener",
]


def leadership_opener(url: str) -> Callable[[], LeadershipStore] | None:
    """What opens the leases beside the idempotency store ``url`` names; None for ``none``.
    Raises ValueError for a URL it does not know, ImportError for a missing extra."""
    return opener(url, "leadership", memory=MemoryLeadership, sqlite=SqliteLeadership,
                  firestore=_firestore)  # fmt: skip


def _firestore() -> Callable[[str, str], LeadershipStore]:
    from workerpool.leadership.firestore import FirestoreLeadership

    return lambda project, collection: FirestoreLeadership(
        project, f"{collection}-leadership", f"{collection}-decisions"
    )
