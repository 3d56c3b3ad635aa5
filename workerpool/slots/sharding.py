"""Keys leased in bulk whose record is split into shards (``KEY = "200/bulk/25"``), so that no
document takes more than a few replicas' writes a second.

A key of S shards has S records beside its own, ``KEY#0`` ... ``KEY#S-1``. Each holds a *part*
of the key's limit and the shares of the replicas that write it: a replica writes only its
shard's record (``shard_of``, a hash of its id), by the rules of one record
(``allocation.share_mutation``) with the part as the limit, so its shares' targets follow
the part and they grow only into it. The key's own record holds what each shard counts for,
as shares named ``#0`` ...: its part, or more while its shares shrink to a lowered part
(per-run holders and the shares of replicas not splitting the key, in a rolling deploy,
count against one limit with them). A part is a lease that each rebalance renews, and no
share in a shard outlives its part (``parts``): once no replica splits the key, its parts
lapse and replicas that keep it as one record get its slots.

Once a rebalance period one replica, whichever claims the key's record first (no leader),
moves the parts toward max-min fair over the shards' wants (``rebalance``, a pure function,
the model's too in ``bench.slot_shards``; a key's first rebalance splits it evenly), in steps
of one store call each:

1. claim: the key's record says a period has passed since the last rebalance; it notes now;
2. read the shards' wants, then lower each part to its target, the shard counting for no
   less than its live shares hold (a write of the shard's record: atomic with its grants);
3. in the key's record, take what the lowered shards count for and grow the others into
   what is free, every part's expiry renewed;
4. write the grown parts, and every part's expiry, into their shards' records.

The key's record gives what a shard counts for a token from the key's counter, a new one
whenever it grows; a shard's record takes a grown part only with a newer token than its own,
and the key's record takes a lowered count only with the token it holds for it (and never
above what it holds). So a shard never holds more than the key's record counts for it, even
while two rebalances overlap (a replica paused in the middle) or after one stopped half way
(the next writes what it left out), and the counts in the key's record never sum above the
limit: the slots granted across the shards never exceed it, at any instant. A grown shard's
record also takes the key's counter as the floor of its own, and the key's counter follows
the shards': slots that move from a lapsed share in one shard to a share in another come
with a higher fencing token than it had.
"""

from __future__ import annotations

import logging
import math
import random
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
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
from workerpool.slots.keys import SHARD_MARK, Limits
from workerpool.slots.parts import live_part, part_lease, renewed, share_terms, taken
from workerpool.slots.store import Share, SlotStore, Table, TableMutation
from workerpool.stores import StoreError

log = logging.getLogger(__name__)

_PART = SHARD_MARK
# A key whose demand moved since its last rebalance (a shard behind its fair part, or the
# replicas not splitting it short of their due) may be rebalanced this many times a period.
EARLY = 5


def shard_record(key: str, index: int) -> str:
    """The name of the record of ``key``'s shard ``index``."""
    return f"{key}{_PART}{index}"


def shard_key(record: str) -> tuple[str, int] | None:
    """The key and shard index a shard record's name gives (``KEY#3``: ``KEY``, 3), or None
    for a key's own record."""
    key, part, index = record.rpartition(_PART)
    return (key, int(index)) if part and key and index.isdigit() else None


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


def lowered(part: int, held: int, target: int) -> tuple[int, int]:
    """A shard's part lowered to ``target`` at once (its replicas' targets follow, and their
    shares shrink to them as their runs end), and what it counts for in the key's record
    meanwhile: never less than its shares hold."""
    part = min(part, target)
    return part, max(held, part)


def grown(limit: int, counted: Mapping[str, int], targets: Mapping[str, int]) -> dict[str, int]:
    """What the shards count for, grown toward their targets, each only into slots no other
    shard counts."""
    new = dict(counted)
    for name in sorted(new):
        others = sum(part for other, part in new.items() if other != name)
        new[name] = grow_to(limit, others, new[name], targets.get(name, 0))
    return new


def rebalance(
    limit: int, parts: Mapping[str, int], held: Mapping[str, int], wants: Mapping[str, int]
) -> tuple[dict[str, int], dict[str, int]]:
    """The shards' new parts of ``limit`` (by shard), from their parts now, what their shares
    hold and what their replicas want, and what each counts for (its part, or what its
    shares hold while they shrink to it): the rule ``Sharding`` applies in steps."""
    targets = spread(limit, wants)
    low = {name: lowered(part, held[name], targets[name]) for name, part in parts.items()}
    counted = grown(limit, {name: count for name, (_, count) in low.items()}, targets)
    new = {name: count if count > low[name][1] else low[name][0] for name, count in counted.items()}
    return new, counted


def behind(
    limit: int, counted: Mapping[str, int], wants: Mapping[str, int], shard: str, want: int
) -> bool:
    """Whether ``shard`` counts for less than its fair part of ``limit`` were its want at
    least ``want`` (``wants``: as of the last rebalance): demand came to it since."""
    wants = {**wants, shard: max(wants.get(shard, 0), want)}
    return counted.get(shard, 0) < spread(limit, wants)[shard]


# --- the records' side -------------------------------------------------------------------


@dataclass(frozen=True)
class _Claim:
    claimed: bool
    room: int = 0  # the limit less per-run holders and the fair due of replicas not splitting
    shards: tuple[int, ...] = ()  # the shards with a part in the key's record


@dataclass(frozen=True)
class _Lowered:
    """A shard's record once its part was lowered (step 2): what it counts for now."""

    counted: int
    token: int
    want: int
    next_token: int


def shard_parts(table: Table, now: float) -> dict[str, Share]:
    """A split key's own record: what each shard counts for, by ``#i`` (lapsed parts count
    for nothing)."""
    return {n: share for n, share in table.live_shares(now).items() if n.startswith(_PART)}


def _room(table: Table, limit: int, now: float) -> int:
    """``limit`` less what holds slots in the key's record beside the shards' parts."""
    parts = shard_parts(table, now)
    unsplit = sum(s.granted for r, s in table.live_shares(now).items() if r not in parts)
    return limit - len(table.live(now)) - unsplit


def _shards_room(table: Table, limit: int, now: float) -> int:
    """What the shards' parts may come to: the limit less per-run holders and what the
    replicas not splitting the key (a rolling deploy) hold or are due, max-min fair with
    each shard as one replica, so neither kind of replica starves the other."""
    parts = shard_parts(table, now)
    others = {r: s for r, s in table.live_shares(now).items() if r not in parts}
    free = limit - len(table.live(now))
    wants = {**{n: p.want for n, p in parts.items()}, **{r: s.want for r, s in others.items()}}
    due = fair(free, wants)
    return free - sum(max(due[r], s.granted) for r, s in others.items())


def _claiming(limit: int, period: float, shard: str, want: int) -> TableMutation[_Claim]:
    """Step 1, by a replica of ``shard`` whose runs ``want`` so many slots: a rebalance is due
    a period after the last, or a fifth of one where demand came since (as replicas started
    or a backlog moved): to this shard (its fair part, with that want, is more than it counts
    for), or to replicas not splitting the key (the shards count for more than their due
    leaves). Slots idle in one place then reach demand in another within seconds, not a
    whole period, once a replica of a shard wants more than it holds (only those try
    early: ``Sharding.keep_balanced``). Where the others hold more than their due, the room
    left is below 0, and a rebalance could not lower the shards below nothing."""

    def mutation(table: Table | None, now: float) -> tuple[_Claim, Table | None]:
        table = table or Table()
        parts, room = shard_parts(table, now), _shards_room(table, limit, now)
        wants = {name: part.want for name, part in parts.items()}
        counted = {name: part.granted for name, part in parts.items()}
        late = behind(room, counted, wants, shard, want) or sum(counted.values()) > max(room, 0)
        if now < table.rebalanced + (period / EARLY if late else period):
            return _Claim(False), None
        shards = tuple(int(name[len(_PART) :]) for name in parts)
        return _Claim(True, room, shards), replace(table, rebalanced=now)

    return mutation


def _wanting(table: Table | None, now: float) -> tuple[int, None]:
    shares = (table or Table()).live_shares(now)
    return sum(share.want for share in shares.values()), None


def _lowering(target: int) -> TableMutation[_Lowered]:
    def mutation(table: Table | None, now: float) -> tuple[_Lowered, Table | None]:
        table = table or Table()
        shares = table.live_shares(now).values()
        live = live_part(table, now)
        part, counted = lowered(live, sum(share.granted for share in shares), target)
        want = sum(share.want for share in shares)
        result = _Lowered(counted, table.part_token, want, table.next_token)
        return result, (replace(table, part=part) if part != live else None)

    return mutation


_Part = tuple[int, int, float]  # a part of the limit, its token and its expiry


def _parting(
    limit: int, reports: Mapping[str, _Lowered], targets: Mapping[str, int], lease: float
) -> TableMutation[dict[str, _Part]]:
    """Step 3: the reported shards' parts, tokens and expiries, as the key's record now
    holds them."""

    def mutation(table: Table | None, now: float) -> tuple[dict[str, _Part], Table]:
        table = table or Table()
        recorded = shard_parts(table, now)
        parts: dict[str, tuple[int, int]] = {}
        for name, share in recorded.items():
            parts[name] = (share.granted, share.token)
        for name, report in reports.items():
            # A shard whose part lapsed counts for nothing (its shares lapsed with it).
            held = parts.setdefault(name, (0, 0))
            if report.token == held[1]:
                # Lowered from the part recorded (a newer one may have grown it since), and
                # no higher than it (another rebalance may have lowered it further since).
                parts[name] = (min(report.counted, held[0]), held[1])
        room = _room(table, limit, now) - sum(p for n, (p, _) in parts.items() if n not in reports)
        sizes = grown(room, {n: parts[n][0] for n in reports}, targets)
        token = max([table.next_token, *(report.next_token for report in reports.values())])
        for name, size in sizes.items():
            if size > parts[name][0]:
                parts[name] = (size, token)
                token += 1
        shares = table.live_shares(now)
        written: dict[str, _Part] = {}
        for name, report in reports.items():
            size, part_token = parts[name]
            until = renewed(recorded.get(name), part_token, now, lease)
            shares[name] = Share(size, report.want, until, part_token)
            written[name] = (size, part_token, until)
        return written, replace(table, shares=shares, next_token=token)

    return mutation


def _taking(part: int, token: int, until: float) -> TableMutation[None]:
    """Step 4: a shard's record takes a grown part, or its part's later expiry, unless it
    has a newer one."""

    def mutation(table: Table | None, now: float) -> tuple[None, Table | None]:
        return None, taken(table or Table(), part, token, until)

    return mutation


def _in_shard(ask: ShareAsk, ttl: float) -> TableMutation[ShareGrant]:
    """A replica's round in its shard's record: the record's rules, the part as the limit."""

    def mutation(table: Table | None, now: float) -> tuple[ShareGrant, Table | None]:
        part, until = share_terms(table, now, ttl)
        return share_mutation(replace(ask, limit=part), until)(table, now)

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
        ttl: float = c.DEFAULT_SLOT_TTL,
        period: float = c.SLOT_SHARD_REBALANCE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._owner = owner
        self._limits = limits
        self._period = period
        self._lease = part_lease(ttl, period)
        self._clock = clock
        self._tried: dict[str, float] = {}  # by key: when (our clock) it last tried
        # A little late, at random: the replicas of a key do not all ask at once.
        self._late = random.uniform(1.0, 1.1)
        for entry, count in sorted(limits.split.items()):
            index = shard_of(owner, count)
            log.info("slots of %s: this replica writes shard %d of %d", entry, index, count)

    def record(self, key: str) -> str:
        """The record this replica's shares of ``key`` are in."""
        count = self._limits.shards(key)
        if count == 1:
            return key
        return shard_record(key, shard_of(self._owner, count))

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

    def keep_balanced(self, demand: Mapping[str, tuple[int, int]]) -> bool:
        """Rebalance the split keys whose time came, from this replica's ``demand`` by key
        (slots its share holds, slots its runs want); whether its shard of one grew (its
        next round may grow its share). A replica whose runs want more than it holds asks
        a fifth of a period after its last try, others a period after (a read of the key's
        record, unless a rebalance is due)."""
        grew = False
        for key, (held, want) in demand.items():
            if self._limits.shards(key) == 1:
                continue
            gap = self._period / EARLY if held < want else self._period
            if self._clock() < self._tried.get(key, -math.inf) + gap * self._late:
                continue
            self._tried[key] = self._clock()
            try:
                grew = self._rebalance(key, want) or grew
            except StoreError as exc:
                log.warning("shards of %s not rebalanced: %s", key, exc)
        return grew

    def _rebalance(self, key: str, want: int) -> bool:
        limit, count = self._limits.of(key) or 0, self._limits.shards(key)
        mine = f"{_PART}{shard_of(self._owner, count)}"
        claiming = _claiming(limit, self._period, mine, want)
        claim = self._store.mutate_records([(key, claiming)])[0]
        if not claim.claimed:
            return False
        indexes = sorted({*range(count), *claim.shards})
        names = [f"{_PART}{i}" for i in indexes]
        records = [shard_record(key, i) for i in indexes]
        wants = self._store.mutate_records([(record, _wanting) for record in records])
        if not claim.shards:
            # A key's first rebalance splits it evenly: the replicas of the other shards may
            # not have written their first round yet, and a shard given nothing would defer
            # their runs (the next rebalance follows the wants, a fifth of a period on).
            wants = [0] * len(wants)
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
        parting = _parting(limit, reports, targets, self._lease)
        parts = self._store.mutate_records([(key, parting)])[0]
        # Every shard's record: the grown parts, and every part's renewed expiry.
        self._store.mutate_records(
            [(record, _taking(*parts[name])) for name, record in zip(names, records, strict=True)]
        )
        return parts[mine][0] > reports[mine].counted
