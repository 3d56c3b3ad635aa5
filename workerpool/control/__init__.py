"""Job control from outside the worker: cancel a job by its id (``cancel.cancel``, which is
``workerpool.cancel``), whatever replica holds it and whether or not any worker is up.

A cancel is a record in the store the fleet shares (the idempotency store's URL: a table
``cancels`` beside the claims on SQLite, the collection ``<COLLECTION>-cancels`` on
Firestore), kept as long as completions are. The worker's side is ``middleware``.
"""

from __future__ import annotations

from workerpool.control.cancel import Answer
from workerpool.control.memory import MemoryCancels
from workerpool.control.opening import cancel_opener
from workerpool.control.sqlite import SqliteCancels
from workerpool.control.store import Cancel, CancelStore

__all__ = [
    "Answer",
    "Cancel",
    "CancelStore",
    "MemoryCancels",
    "SqliteCancels",
    "cancel_opener",
]
