"""The fleet's concurrency keys as they stand: each declared key's limit, holders, waiting
replicas and deferred jobs, read from the slot store; ``workerpool status`` prints them, the
dashboard's Keys page shows them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from workerpool.slots.store import Share, SlotStore


@dataclass(frozen=True)
class Holder:
    name: str  # the replica's worker id
    token: int
    held_for: float  # seconds since the slot was granted


@dataclass(frozen=True)
class KeyState:
    key: str  # the key, or the declared pattern ("partner:*") when none of its keys is in use
    limit: int
    holders: tuple[Holder, ...] = ()
    waiters: int = 0  # replicas waiting for a slot now
    deferred: int = 0  # jobs deferred because the key was full
    hold: float = 0.0  # mean seconds a slot is held (0 until known)
    in_use: bool = True  # False: a pattern none of whose keys has a record
    shares: tuple[tuple[str, Share], ...] = ()  # a key leased in bulk: each replica's share


def key_states(store: SlotStore, limits: Mapping[str, int], now: float) -> list[KeyState]:
    """Each declared key's state, by declaration; a pattern ("partner:*") gives every key of
    it that has a record."""
    states = []
    for declared, limit in sorted(limits.items()):
        keys = store.keys(declared[:-1]) if declared.endswith("*") else [declared]
        if not keys:
            states.append(KeyState(declared, limit, in_use=False))
        for key in keys:
            table = store.table(key)
            holders = tuple(
                Holder(holder, lease.token, now - lease.since)
                for holder, lease in sorted(table.holders.items(), key=lambda h: h[1].since)
            )
            states.append(
                KeyState(key, limit, holders, len(table.waiters), len(table.booked), table.hold,
                         shares=tuple(sorted(table.shares.items())))
            )  # fmt: skip
    return states
