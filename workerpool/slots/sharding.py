"""Keys leased in bulk whose record is split into shards (``KEY = "200/bulk/25"``), so that no
document takes more than a few replicas' writes a second.

A key of S shards has S records beside its own, ``KEY#0`` ... ``KEY#S-1``. Each holds a *part*
of the key's limit and the shares of the replicas that write it: a replica writes only its
shard's record (``shard_of``, a hash of its id), by the rules of one record
(``allocation.share_mutation``) with the part as the limit. The key's own record holds the
parts, as shares named ``#0`` ... that never lapse, so per-run holders and the shares of
replicas not splitting the key (in a rolling deploy) count against one limit with them.

Once a rebalance period one replica, whichever claims the key's record first (no leader),
moves the parts toward max-min fair over the shards' wants (``rebalance``, a pure function,
the model's too in ``bench.slot_shards``), in steps of one store call each:

1. claim: the key's record says a period has passed since the last rebalance; it notes now;
2. read the shards' wants, then lower each part toward its target but never below what the
   shard's live shares hold (a write of the shard's record: atomic with its grants);
3. in the key's record, take the lowered parts and grow the others into what is free;
4. write the grown parts into their shards' records.

The key's record gives each part a token from the key's counter, a new one whenever the part
grows; a shard's record takes a part only with a newer token than its own, and the key's
record takes a lowered part only with the token it holds for it. So a shard's part is never
above what the key's record holds for it, even while two rebalances overlap (a replica paused
in the middle) or after one stopped half way (the next writes what it left out), and the
parts in the key's record never sum above the limit: the slots granted across the shards
never exceed it, at any instant. A grown shard's record also takes the key's counter as the
floor of its own, and the key's counter follows the shards': slots that move from a lapsed
share in one shard to a share in another come with a higher fencing token than it had.
"""

from __future__ import annotations

import logging
import math
import random
import time
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from workerpool import constants as c
from workerpool.slots.allocation import (
    ShareAsk,
    ShareGrant,
    fair,
    grow_to,
    lease_shares,
    share_mutation,
)
from workerpool.slots.keys import Limits
from workerpool.slots.store import Share, SlotStore, Table, TableMutation
from workerpool.stores import StoreError

log = logging.getLogger(__name__)

# A shard's part in the key's record: it is given back only by a rebalance lowering it.
_NEVER = math.inf
_PART = "#"


def shard_record(key: str, index: int) -> str:
    """The name of the record of ``key``'s shard ``index``."""
    return f"{key}{_PART}{index}"


def shard_of(replica: str, count: int) -> int:
    """The shard of ``count`` that ``replica`` writes: a hash of its id, stable across
    processes (not Python's ``hash``, salted per process)."""
    return zlib.crc32(replica.encode()) % count


# --- the rule (pure) ---------------------------------------------------------------------


def spread(limit: int, wants: Mapping[str, int]) -> dict[str, int]:
    """Each shard's target: max-min fair over the shards' wants, and the slots no shard
    wants split evenly, so new demand in any shard finds some without waiting a rebalance."""
    targets = fair(limit, wants)
    spare = limit - sum(targets.values())
    if spare > 0 and targets:
        extra = fair(spare, dict.fromkeys(targets, spare))
        targets = {name: target + extra[name] for name, target in targets.items()}
    return targets


def lowered(part: int, held: int, target: int) -> int:
    """A shard's part lowered toward ``target``, never below what its shares hold."""
    return max(held, min(part, target))


def grown(limit: int, parts: Mapping[str, int], targets: Mapping[str, int]) -> dict[str, int]:
    """``parts`` grown toward their targets, each only into slots no other part holds."""
    new = dict(parts)
    for name in sorted(new):
        others = sum(part for other, part in new.items() if other != name)
        new[name] = grow_to(limit, others, new[name], targets.get(name, 0))
    return new


def rebalance(
    limit: int, parts: Mapping[str, int], held: Mapping[str, int], wants: Mapping[str, int]
) -> dict[str, int]:
    """The shards' new parts of ``limit`` (by shard), from their parts now, what their shares
    hold and what their replicas want: the rule ``Sharding`` applies in steps."""
    targets = spread(limit, wants)
    return grown(limit, {n: lowered(p, held[n], targets[n]) for n, p in parts.items()}, targets)


# --- the records' side -------------------------------------------------------------------


@dataclass(frozen=True)
class _Claim:
    claimed: bool
    wait: float  # seconds until a rebalance is due
    room: int = 0  # the limit less per-run holders and the shares of replicas not splitting
    shards: tuple[int, ...] = ()  # the shards with a part in the key's record


@dataclass(frozen=True)
class _Lowered:
    """A shard's record once its part was lowered (step 2)."""

    part: int
    token: int
    want: int
    next_token: int


def _parts(table: Table) -> dict[str, Share]:
    return {name: share for name, share in table.shares.items() if name.startswith(_PART)}


def _room(table: Table, limit: int, now: float) -> int:
    """``limit`` less what holds slots in the key's record beside the shards' parts."""
    parts = _parts(table)
    unsplit = sum(s.granted for r, s in table.live_shares(now).items() if r not in parts)
    return limit - len(table.live(now)) - unsplit


def _claiming(limit: int, period: float) -> TableMutation[_Claim]:
    def mutation(table: Table | None, now: float) -> tuple[_Claim, Table | None]:
        table = table or Table()
        due = table.rebalanced + period
        if now < due:
            return _Claim(False, due - now), None
        shards = tuple(int(name[len(_PART) :]) for name in _parts(table))
        return _Claim(True, 0.0, _room(table, limit, now), shards), replace(table, rebalanced=now)

    return mutation


def _wanting(table: Table | None, now: float) -> tuple[int, None]:
    shares = (table or Table()).live_shares(now)
    return sum(share.want for share in shares.values()), None


def _lowering(target: int) -> TableMutation[_Lowered]:
    def mutation(table: Table | None, now: float) -> tuple[_Lowered, Table | None]:
        table = table or Table()
        shares = table.live_shares(now).values()
        part = lowered(table.part, sum(share.granted for share in shares), target)
        want = sum(share.want for share in shares)
        result = _Lowered(part, table.part_token, want, table.next_token)
        return result, (replace(table, part=part) if part != table.part else None)

    return mutation


def _parting(
    limit: int, reports: Mapping[str, _Lowered], targets: Mapping[str, int]
) -> TableMutation[dict[str, tuple[int, int]]]:
    """Step 3: the parts (and their tokens) by shard, as the key's record now holds them."""

    def mutation(table: Table | None, now: float) -> tuple[dict[str, tuple[int, int]], Table]:
        table = table or Table()
        recorded = _parts(table)
        parts: dict[str, tuple[int, int]] = {}
        for name, share in recorded.items():
            parts[name] = (share.granted, share.token)
        for name, report in reports.items():
            held = parts.get(name, (0, 0))
            if report.token == held[1]:
                # Lowered from the part recorded (a newer one may have grown it since), and
                # no higher than it (another rebalance may have lowered it further since).
                parts[name] = (min(report.part, held[0]), held[1])
        room = _room(table, limit, now) - sum(p for n, (p, _) in parts.items() if n not in reports)
        sizes = grown(room, {n: parts[n][0] for n in reports}, targets)
        token = max([table.next_token, *(report.next_token for report in reports.values())])
        for name, size in sizes.items():
            if size > parts[name][0]:
                parts[name] = (size, token)
                token += 1
        shares = table.live_shares(now)
        for name, (size, part_token) in parts.items():
            want = reports[name].want if name in reports else recorded[name].want
            shares[name] = Share(size, want, _NEVER, part_token)
        return parts, replace(table, shares=shares, next_token=token)

    return mutation


def _taking(part: int, token: int) -> TableMutation[None]:
    """Step 4: a shard's record takes a grown part, unless it has a newer one."""

    def mutation(table: Table | None, now: float) -> tuple[None, Table | None]:
        table = table or Table()
        if token <= table.part_token:
            return None, None
        next_token = max(table.next_token, token + 1)
        return None, replace(table, part=part, part_token=token, next_token=next_token)

    return mutation


def _in_shard(ask: ShareAsk, ttl: float) -> TableMutation[ShareGrant]:
    """A replica's round in its shard's record: the record's rules, the part as the limit."""

    def mutation(table: Table | None, now: float) -> tuple[ShareGrant, Table | None]:
        part = 0 if table is None else table.part
        return share_mutation(replace(ask, limit=part), ttl)(table, now)

    return mutation


class Sharding:
    """One replica's side of the split keys: the record its round writes for each key, and
    the rebalances it runs when their time comes."""

    def __init__(
        self,
        store: SlotStore,
        owner: str,
        limits: Limits,
        *,
        period: float = c.SLOT_SHARD_REBALANCE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._owner = owner
        self._limits = limits
        self._period = period
        self._clock = clock
        self._due: dict[str, float] = {}  # by key: when (our clock) to try a rebalance
        self._told: set[str] = set()

    def record(self, key: str) -> str:
        """The record this replica's shares of ``key`` are in."""
        count = self._limits.shards(key)
        if count == 1:
            return key
        index = shard_of(self._owner, count)
        entry = self._limits.entry(key) or key
        if entry not in self._told:
            self._told.add(entry)
            log.info("slots of %s: this replica writes shard %d of %d", entry, index, count)
        return shard_record(key, index)

    def lease(self, asks: Sequence[ShareAsk], ttl: float) -> list[ShareGrant]:
        """``allocation.lease_shares``, each key's ask written to this replica's shard of it."""
        if all(self._limits.shards(ask.key) == 1 for ask in asks):
            return lease_shares(self._store, asks, ttl)
        return self._store.mutate_records(
            [(self.record(ask.key), self._mutation(ask, ttl)) for ask in asks]
        )

    def _mutation(self, ask: ShareAsk, ttl: float) -> TableMutation[ShareGrant]:
        if self._limits.shards(ask.key) == 1:
            return share_mutation(ask, ttl)
        return _in_shard(ask, ttl)

    def keep_balanced(self, keys: Iterable[str]) -> bool:
        """Rebalance the split keys among ``keys`` whose time came; whether this replica's
        shard of one grew (its next round may grow its share)."""
        grew = False
        for key in keys:
            if self._limits.shards(key) == 1 or self._due.get(key, -math.inf) > self._clock():
                continue
            try:
                grew = self._rebalance(key) or grew
            except StoreError as exc:
                log.warning("shards of %s not rebalanced: %s", key, exc)
                self._due[key] = self._clock() + self._period / 2
        return grew

    def _rebalance(self, key: str) -> bool:
        limit, count = self._limits.of(key) or 0, self._limits.shards(key)
        claim = self._store.mutate_records([(key, _claiming(limit, self._period))])[0]
        # A little late, at random: the replicas of a key do not all ask at once.
        wait = claim.wait if not claim.claimed else self._period
        self._due[key] = self._clock() + wait + random.uniform(0, self._period / 10)
        if not claim.claimed:
            return False
        indexes = sorted({*range(count), *claim.shards})
        names = [f"{_PART}{i}" for i in indexes]
        records = [shard_record(key, i) for i in indexes]
        wants = self._store.mutate_records([(record, _wanting) for record in records])
        targets = spread(claim.room, dict(zip(names, wants, strict=True)))
        reports = dict(
            zip(
                names,
                self._store.mutate_records(
                    [(r, _lowering(targets[n])) for n, r in zip(names, records, strict=True)]
                ),
                strict=True,
            )
        )
        parts = self._store.mutate_records([(key, _parting(limit, reports, targets))])[0]
        moves = [
            (record, _taking(*parts[name]))
            for name, record in zip(names, records, strict=True)
            if parts[name][1] > reports[name].token
        ]
        if moves:
            self._store.mutate_records(moves)
        mine = f"{_PART}{shard_of(self._owner, count)}"
        return parts[mine][0] > reports[mine].part
