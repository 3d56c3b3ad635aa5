"""Ordering keys an operator must let go on: the blocked-keys store beside the idempotency
store (SQLite: a table in its file; Firestore: the collection ``<COLLECTION>-ordering-blocks``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from workerpool.errors import ConfigError
from workerpool.ordering.blocks import Block, BlockedKeys, MemoryBlocks, SqliteBlocks
from workerpool.stores import StoreError, opener

__all__ = [
    "Block",
    "BlockedKeys",
    "MemoryBlocks",
    "SqliteBlocks",
    "blocked_lines",
    "blocked_now",
    "blocked_status",
    "open_blocked_keys",
    "unblock",
]

T = TypeVar("T")


def _firestore() -> Callable[[str, str], BlockedKeys]:
    from workerpool.ordering.firestore import FirestoreBlocks

    return FirestoreBlocks


def open_blocked_keys(url: str) -> BlockedKeys:
    """The blocked-keys store beside the idempotency store ``url`` names, opened; any problem
    is a ``ConfigError`` naming the setting."""
    try:
        found: Callable[[], BlockedKeys] | None = opener(
            url, "blocked-keys store", memory=MemoryBlocks, sqlite=SqliteBlocks,
            firestore=_firestore,
        )  # fmt: skip
        if found is None:
            raise ValueError("blocking an ordering key needs a shared store, not none")
        return found()
    except (ValueError, ImportError, StoreError) as exc:
        raise ConfigError(f"idempotency_store (for blocked ordering keys): {exc}") from None


def blocked_lines(url: str) -> list[str]:
    """One line per blocked key, for ``workerpool ordering blocked``; none where no store
    keeps them (``none``). A store that cannot be read is a ``ConfigError``."""
    if url == "none":
        return []
    blocks = blocked_now(url).values()
    return [f"blocked ordering key {b.key}: job {b.job} ({b.job_id})" for b in blocks]


def blocked_now(url: str) -> dict[str, Block]:
    """The keys blocked now, each with the job that blocked it. A ``ConfigError`` for a
    store that cannot be reached."""
    return {b.key: b for b in _with_store(url, lambda store: store.all())}


def unblock(url: str, key: str) -> bool:
    """Let ``key`` go on; False if it was not blocked. A ``ConfigError`` for a store that
    cannot be reached."""
    return _with_store(url, lambda store: store.unblock(key))


def _with_store(url: str, call: Callable[[BlockedKeys], T]) -> T:
    store = open_blocked_keys(url)
    try:
        return call(store)
    except StoreError as exc:
        raise ConfigError(f"idempotency_store (for blocked ordering keys): {exc}") from None
    finally:
        store.close()


def blocked_status(url: str) -> list[str]:
    """``blocked_lines`` for ``workerpool status``: a store that cannot be read is a line
    saying why, as the rest of the status reports what it cannot read."""
    try:
        return blocked_lines(url)
    except ConfigError as exc:
        return [f"blocked ordering keys not read: {exc}"]
