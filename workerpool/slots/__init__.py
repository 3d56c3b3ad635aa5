"""Fleet-wide concurrency limits: slots of named keys, leased from the store every replica
shares (the idempotency store's URL: SQLite for the processes of one host, a table beside the
claims; Firestore for a fleet, the collection ``<COLLECTION>-slots``). This is the store's
side; the worker's (``middleware``, ``leases``, ``gate``) is imported by the launcher only, so
that a job's registration can check its key without it."""

from __future__ import annotations

from collections.abc import Callable

from workerpool.errors import ConfigError
from workerpool.slots.keys import KeyTemplate, Limits
from workerpool.slots.memory import MemorySlots
from workerpool.slots.sqlite import SqliteSlots
from workerpool.slots.store import Full, Granted, Holding, SlotStore
from workerpool.stores import StoreError, opener

__all__ = [
    "Full",
    "Granted",
    "Holding",
    "KeyTemplate",
    "Limits",
    "MemorySlots",
    "SlotStore",
    "SqliteSlots",
    "open_slot_store",
    "slot_store_opener",
]

SlotStoreOpener = Callable[[], SlotStore]


def slot_store_opener(url: str) -> SlotStoreOpener:
    """What opens the slot store beside the idempotency store ``url`` names. Raises
    ValueError for a URL it does not know or for ``none`` (slots must be shared to limit
    anything), ImportError for a missing extra."""
    found = opener(url, "slot store", memory=MemorySlots, sqlite=SqliteSlots,
                   firestore=_firestore)  # fmt: skip
    if found is None:
        raise ValueError("concurrency limits need a store shared by the workers, not none")
    return found


def _firestore() -> Callable[[str, str], SlotStore]:
    from workerpool.slots.firestore import FirestoreSlots

    return lambda project, collection: FirestoreSlots(project, f"{collection}-slots")


def open_slot_store(url: str) -> SlotStore:
    """The slot store beside the idempotency store ``url`` names, opened; any problem is a
    ``ConfigError`` naming the setting."""
    try:
        return slot_store_opener(url)()
    except (ValueError, ImportError, StoreError) as exc:
        raise ConfigError(f"idempotency_store (for concurrency slots): {exc}") from None
