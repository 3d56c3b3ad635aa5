"""The fleet's concurrency keys as they stand: each declared key's limit, holders, waiting
replicas and deferred jobs, read from the slot store; ``workerpool status`` prints them, the
dashboard's Keys page shows them. A key split into shards (``"200/bulk/25"``) shows once, with
each shard's part of its limit and the replicas' shares in that shard; its shard records
(``KEY#0`` ...) never show as keys of their own."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from workerpool.slots.parts import live_part
from workerpool.slots.sharding import shard_key, shard_parts, shard_record
from workerpool.slots.store import Share, SlotStore, Table

Shares = tuple[tuple[str, Share], ...]


@dataclass(frozen=True)
class Holder:
    name: str  # the replica's worker id
    token: int
    held_for: float  # seconds since the slot was granted


@dataclass(frozen=True)
class ShardState:
    index: int
    part: int  # its part of the key's limit, as its record holds it
    counted: int  # what it counts for in the key's record: its part, or more while shrinking
    shares: Shares = ()  # each replica's share in this shard


@dataclass(frozen=True)
class KeyState:
    key: str  # the key, or the declared pattern ("partner:*") when none of its keys is in use
    limit: int
    holders: tuple[Holder, ...] = ()
    waiters: int = 0  # replicas waiting for a slot now
    deferred: int = 0  # jobs deferred because the key was full
    hold: float = 0.0  # mean seconds a slot is held (0 until known)
    in_use: bool = True  # False: a pattern none of whose keys has a record
    shares: Shares = ()  # a key leased in bulk: each replica's share in the key's own record
    shards: tuple[ShardState, ...] = ()  # a key split into shards: each shard, by index
    # A pattern's row that stands for this many more of its keys, not read (``most``)
    not_shown: int = 0


def key_states(
    store: SlotStore,
    limits: Mapping[str, int],
    now: float,
    shards: Mapping[str, int] | None = None,
    *,
    most: int | None = None,
) -> list[KeyState]:
    """Each declared key's state, by declaration; a pattern ("partner:*") gives every key of
    it that has a record, or the first ``most`` of them in key order and a row saying how many
    more there are (its keys come from jobs' payloads, and their records stay: any number).
    ``shards``: how many shards each split entry declares."""
    states = []
    for declared, limit in sorted(limits.items()):
        count = (shards or {}).get(declared, 1)
        keys = _keys(store, declared[:-1], count) if declared.endswith("*") else [declared]
        if not keys:
            states.append(KeyState(declared, limit, in_use=False))
        not_shown = 0 if most is None else max(0, len(keys) - most)
        for key in keys[: len(keys) - not_shown]:
            table = store.table(key)
            holders = tuple(
                Holder(holder, lease.token, now - lease.since)
                for holder, lease in sorted(table.holders.items(), key=lambda h: h[1].since)
            )
            parts = shard_parts(table, now)
            shares = tuple(sorted((r, s) for r, s in table.shares.items() if r not in parts))
            states.append(
                KeyState(key, limit, holders, len(table.waiters), len(table.booked), table.hold,
                         shares=shares, shards=_shards(store, key, table, count, now))
            )  # fmt: skip
        if not_shown:
            states.append(KeyState(declared, limit, in_use=False, not_shown=not_shown))
    return states


def _keys(store: SlotStore, prefix: str, count: int) -> list[str]:
    """The keys of a pattern that have a record, less the shard records of its split keys."""
    keys = store.keys(prefix)
    listed = set(keys)
    return [key for key in keys if not _is_shard(shard_key(key), count, listed)]


def _is_shard(parsed: tuple[str, int] | None, count: int, listed: set[str]) -> bool:
    """A record named ``KEY#i`` is a shard's where its entry is split, or where ``KEY`` has a
    record too (an entry split before, or split by replicas of a newer config)."""
    return parsed is not None and (count > 1 or parsed[0] in listed)


def _shards(
    store: SlotStore, key: str, table: Table, count: int, now: float
) -> tuple[ShardState, ...]:
    """Each shard of a split key: the declared ones and any the key's record still counts."""
    counted = {int(name[1:]): share.granted for name, share in shard_parts(table, now).items()}
    indexes = sorted({*(range(count) if count > 1 else ()), *counted})
    states = []
    for index in indexes:
        shard = store.table(shard_record(key, index))
        shares = tuple(sorted(shard.shares.items()))
        states.append(ShardState(index, live_part(shard, now), counted.get(index, 0), shares))
    return tuple(states)
