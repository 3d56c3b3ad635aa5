"""Checkpoints and progress: ``ctx.checkpoint(state)`` keeps a job's resume point durably
under its job id for the next run (after a crash, a drain, a retry, a lost claim) until the
job finishes; ``ctx.progress(done, total, note)`` shows how far a running job has got
(``workerpool status --running``). Both live in the store the fleet shares (the idempotency
store's URL: two tables beside the claims on SQLite, the collections
``<COLLECTION>-checkpoints`` and ``<COLLECTION>-progress`` on Firestore)."""

from __future__ import annotations

from collections.abc import Callable

from workerpool.progress.handle import CheckpointTooLarge
from workerpool.progress.memory import MemoryJobState
from workerpool.progress.sqlite import SqliteJobState
from workerpool.progress.store import MAX_CHECKPOINT_BYTES, JobStateStore, Report
from workerpool.stores import opener

__all__ = [
    "MAX_CHECKPOINT_BYTES",
    "CheckpointTooLarge",
    "JobStateStore",
    "MemoryJobState",
    "Report",
    "SqliteJobState",
    "job_state_opener",
]


def job_state_opener(url: str) -> Callable[[], JobStateStore] | None:
    """What opens the checkpoints and progress beside the idempotency store ``url`` names;
    None for ``none``. Raises ValueError for a URL it does not know, ImportError for a
    missing extra."""
    return opener(url, "checkpoints", memory=MemoryJobState, sqlite=SqliteJobState,
                  firestore=_firestore)  # fmt: skip


def _firestore() -> Callable[[str, str], JobStateStore]:
    from workerpool.progress.firestore import FirestoreJobState

    return FirestoreJobState
