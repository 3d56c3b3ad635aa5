"""Ordering keys an operator must let go on: the blocked-keys store beside the idempotency
store (SQLite: a table in its file; Firestore: not built, refused with one line)."""

from __future__ import annotations

from collections.abc import Callable

from workerpool.errors import ConfigError
from workerpool.ordering.blocks import Block, BlockedKeys, MemoryBlocks, SqliteBlocks
from workerpool.stores import StoreError, opener

__all__ = ["Block", "BlockedKeys", "MemoryBlocks", "SqliteBlocks", "open_blocked_keys"]


def _firestore() -> Callable[[str, str], BlockedKeys]:
    raise ValueError("blocked ordering keys are kept in SQLite only for now, not Firestore")


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
    """One line per blocked key, for ``workerpool status``; none where no store keeps them."""
    try:
        blocks = open_blocked_keys(url).all()
    except ConfigError:  # a store without them (none, Firestore): nothing can be blocked
        return []
    return [f"blocked ordering key {b.key}: job {b.job} ({b.job_id})" for b in blocks]
