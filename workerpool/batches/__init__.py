"""Fan-out batches: children published together, each child's final outcome written once to
a ledger by job id, and one completion job when every child has one, or at the batch's
deadline, whichever comes first (``store``). The batches live beside the idempotency claims
(the same store URL: SQLite for one host, Firestore for a fleet); ``middleware`` is the
worker's side, ``publishing.publish_batch`` the publisher's."""

from __future__ import annotations

from collections.abc import Callable

from workerpool.batches.memory import MemoryBatches
from workerpool.batches.sqlite import SqliteBatches
from workerpool.batches.store import Batch, BatchStore, Completion
from workerpool.stores import opener

__all__ = ["Batch", "BatchStore", "Completion", "MemoryBatches", "SqliteBatches", "batch_opener"]


def batch_opener(url: str) -> Callable[[], BatchStore] | None:
    """What opens the batches beside the idempotency store ``url`` names (Firestore: the
    collection ``<COLLECTION>-batches``); None for ``none``. Raises ImportError for a
    missing extra."""
    return opener(url, "batch store", memory=MemoryBatches, sqlite=SqliteBatches,
                  firestore=_firestore)  # fmt: skip


def _firestore() -> Callable[[str, str], BatchStore]:
    from workerpool.batches.firestore import FirestoreBatches

    return lambda project, collection: FirestoreBatches(project, f"{collection}-batches")
