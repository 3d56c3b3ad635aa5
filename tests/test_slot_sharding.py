"""Bulk keys split into shards: the rebalance rule, and its steps through a store in one
process (the in-memory store, checked after every write); worker processes on the emulator
are in test_slot_shards_emulator.py."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from workerpool.slots import Limits, MemorySlots
from workerpool.slots.allocation import ShareAsk, ShareGrant
from workerpool.slots.parts import live_part, part_lease
from workerpool.slots.sharding import (
    Sharding,
    rebalance,
    shard_of,
    shard_parts,
    shard_record,
    spread,
)
from workerpool.slots.store import Granted, T, Table, TableMutation
from workerpool.stores import StoreUnavailable

KEY = "partner-api"
TTL = 60.0


# --- the rule --------------------------------------------------------------------------------


def test_a_rebalance_stays_within_the_limit_and_counts_a_shard_for_what_it_holds() -> None:
    rng = random.Random(11)
    for _ in range(3000):
        limit = rng.randint(1, 60)
        names = [f"#{i}" for i in range(rng.randint(1, 6))]
        # Shards counting for parts that sum within the limit, each holding at most that.
        cuts = sorted(rng.randint(0, limit) for _ in names[1:])
        counted = {n: b - a for n, a, b in zip(names, [0, *cuts], [*cuts, limit], strict=True)}
        held = {n: rng.randint(0, c) for n, c in counted.items()}
        parts = {n: rng.randint(0, c) for n, c in counted.items()}
        wants = {n: rng.randint(0, 40) for n in names}
        new, counts = rebalance(limit, parts, held, wants)
        assert sum(counts.values()) <= limit
        targets = spread(limit, wants)
        for n in names:
            assert counts[n] >= max(held[n], new[n])  # never below what its shares hold
            assert new[n] <= max(parts[n], targets[n])  # grows only toward its target
            assert new[n] <= targets[n] or new[n] <= parts[n]


def test_a_rebalance_is_max_min_fair_over_the_shards_wants() -> None:
    # Given a key of 20 in 2 shards, 10 each, the second shard's shares holding nothing
    parts, held = {"#0": 10, "#1": 10}, {"#0": 10, "#1": 0}
    # When only the first shard wants slots
    # Then it gets them all
    assert rebalance(20, parts, held, {"#0": 32, "#1": 0}) == ({"#0": 20, "#1": 0},) * 2
    # And while the second shard's shares hold 6, its part drops to 0 at once (its shares
    # shrink to it), but it counts for the 6 they hold, which go out only once given back
    assert rebalance(20, parts, {"#0": 10, "#1": 6}, {"#0": 32, "#1": 0}) == (
        {"#0": 14, "#1": 0},
        {"#0": 14, "#1": 6},
    )
    # And slots no shard wants are split evenly (new demand finds some at once)
    assert spread(20, {"#0": 4, "#1": 0}) == {"#0": 12, "#1": 8}


# --- the steps through a store ---------------------------------------------------------------


class CheckedSlots(MemorySlots):
    """The in-memory store, checking after every write that no shard's part, nor what its
    shares hold, is above what the key's record counts for it, nor outlives it there, that
    no share granted in a shard outlives its part, that a shard's record holds only its own
    replicas' shares, and the slots granted in all the shards, in the key's own record
    (replicas not splitting the key) and to per-run holders stay within the limit;
    ``between`` runs once, before the store call ``after`` calls from now (a rebalance in
    the middle of another's steps)."""

    def __init__(self, limit: int, clock: Callable[[], float], shards: int = 2) -> None:
        super().__init__(clock=clock)
        self.limit = limit
        self.shards = shards
        self.between: Callable[[], None] | None = None
        self.after = 0
        self.peak = 0  # in the shards
        self.unsplit_peak = 0  # in the key's own record

    def _mutate_many(self, items: Sequence[tuple[str, TableMutation[T]]]) -> list[T]:
        self.after -= 1
        if self.after == 0 and self.between is not None:
            between, self.between = self.between, None
            between()
        results = super()._mutate_many(items)
        self._check()
        return results

    def record(self, name: str) -> Table:
        return self._tables[name]

    def _check(self) -> None:
        now = self._clock()
        key = self._tables.get(KEY, Table())
        parts = shard_parts(key, now)
        counts = {name: share.granted for name, share in parts.items()}
        unsplit = key.shared(now) - sum(counts.values()) + len(key.live(now))
        assert sum(counts.values()) + unsplit <= self.limit
        granted = 0
        for name, table in self._tables.items():
            if name.startswith(KEY + "#"):
                counted = counts.get(name[len(KEY) :], 0)
                held = table.shared(now)
                assert live_part(table, now) <= counted and held <= counted, (name, table, key)
                if live_part(table, now) or held:
                    assert table.part_until <= parts[name[len(KEY) :]].until, (table, key)
                shares = table.live_shares(now).values()
                assert all(s.until <= table.part_until for s in shares if s.granted), table
                # Each replica writes its own shard's record only.
                mine = [f"#{shard_of(r, self.shards)}" for r in table.shares]
                assert set(mine) <= {name[len(KEY) :]}, table
                granted += held
        self.peak = max(self.peak, granted)
        self.unsplit_peak = max(self.unsplit_peak, unsplit)
        assert granted + unsplit <= self.limit


def replicas_of(shard: int, count: int, many: int) -> list[str]:
    return [r for r in (f"replica-{i}" for i in range(200)) if shard_of(r, count) == shard][:many]


def round_of(sharding: Sharding, replica: str, keep: int, want: int, limit: int) -> int:
    """One round of ``replica``: the slots its share holds now."""
    return sharding.lease([ShareAsk(KEY, replica, limit, keep, want)], TTL)[0].granted


def test_slots_move_between_shards_within_the_limit_under_overlapping_rebalances() -> None:
    # Given a key of 20 in 3 shards, 9 replicas, rebalances due at every round (period 0),
    # and some rebalances run in the middle of another's steps (a replica paused there)
    rng = random.Random(5)
    now = [1000.0]
    store = CheckedSlots(20, clock=lambda: now[0], shards=3)
    limits = Limits({KEY: 20}, {KEY}, {KEY: 3})
    names = [r for shard in range(3) for r in replicas_of(shard, 3, 3)]
    replicas = {r: Sharding(store, r, limits, period=0.0, clock=lambda: now[0]) for r in names}
    held = dict.fromkeys(names, 0)
    wants = dict.fromkeys(names, 0)
    hot_shard = [0]

    def turn(replica: str) -> None:
        """A round of ``replica``, its demand changed (one shard's hot, the others' light)."""
        hot = shard_of(replica, 3) == hot_shard[0]
        wants[replica] = rng.randint(8, 30) if hot else rng.randint(0, 2)
        keep = min(held[replica], wants[replica])
        held[replica] = round_of(replicas[replica], replica, keep, wants[replica], 20)

    def interrupt() -> None:
        """Another replica's round and rebalance, in a few store calls (maybe in the middle
        of this one's, which may itself be interrupted so)."""
        other = rng.choice(names)

        def between() -> None:
            turn(other)
            if rng.random() < 0.5:
                interrupt()
            replicas[other].keep_balanced({KEY: (held[other], wants[other])})

        store.between, store.after = between, rng.randint(1, 6)

    for step in range(1500):
        # When replicas' demands change, and a rebalance runs now and then, some of them
        # while another is half way (after a round whose demand changed)
        hot_shard[0] = step // 50 % 3
        replica = rng.choice(names)
        turn(replica)
        if rng.random() < 0.3:
            interrupt()
            replicas[replica].keep_balanced({KEY: (held[replica], wants[replica])})
        now[0] += 0.1
    # Then (checked at every write) no shard's part was above the key's record's, and the
    # slots granted over all shards never exceeded 20; and they reached 20
    assert store.peak == 20


class Pair:
    """A key of ``limit`` in 2 shards, a replica writing each (``first`` shard 0, ``second``
    shard 1), on a clock the test moves."""

    def __init__(self, limit: int, period: float = 10.0) -> None:
        self.period = period
        self.now = 1000.0
        self.store = CheckedSlots(limit, clock=lambda: self.now)
        limits = Limits({KEY: limit}, {KEY}, {KEY: 2})
        self.first, self.second = replicas_of(0, 2, 1)[0], replicas_of(1, 2, 1)[0]
        self.sides = {
            r: Sharding(self.store, r, limits, ttl=TTL, period=period, clock=lambda: self.now)
            for r in (self.first, self.second)
        }
        # Replicas that keep the key as one record (redeployed, or not yet split).
        self.whole = Limits({KEY: limit}, {KEY})

    def grant(self, replica: str, keep: int, want: int) -> ShareGrant:
        """One round of ``replica``: what the record answers."""
        ask = ShareAsk(KEY, replica, self.store.limit, keep, want)
        return self.sides[replica].lease([ask], TTL)[0]

    def round(self, replica: str, keep: int, want: int) -> int:
        """One round of ``replica``: the slots its share holds now."""
        return self.grant(replica, keep, want).granted

    def unsplit(self, replica: str, keep: int, want: int) -> int:
        """One round of ``replica``, a replica keeping the key as one record: what it holds."""
        side = self.sides.setdefault(replica, Sharding(self.store, replica, self.whole))
        return round_of(side, replica, keep, want, self.store.limit)

    def balance(self, replica: str, held: int, want: int) -> bool:
        return self.sides[replica].keep_balanced({KEY: (held, want)})

    def alone(self, replica: str, want: int) -> int:
        """``replica`` alone wants ``want``: the key's first rebalance splits it evenly, the
        next, a fifth of a period on, follows the wants; what its share holds then."""
        self.round(replica, 0, want)
        assert self.balance(replica, 0, want)
        half = self.round(replica, 0, want)
        assert half == min(want, self.store.limit // 2)
        self.now += self.period / 4
        self.balance(replica, half, want)
        return self.round(replica, half, want)


def test_a_keys_first_rebalance_splits_it_evenly_whoever_asks_first() -> None:
    # Given a key of 20 in 2 shards, and only the first shard's replica has written a round
    key = Pair(20)
    key.round(key.first, 0, 32)
    # When it rebalances the key first
    key.balance(key.first, 0, 32)
    # Then each shard gets half: the other shard's replicas find slots at their first round
    assert key.round(key.second, 0, 16) == 10
    assert key.round(key.first, 0, 32) == 10


def test_an_idle_shards_slots_reach_a_busy_one_at_the_next_rebalance() -> None:
    # Given a key of 20 in 2 shards, a replica on each, both busy at first
    key = Pair(20)
    busy, idle = key.first, key.second
    for r in (busy, idle):
        key.round(r, 0, 16)
    assert key.balance(busy, 0, 16)  # the first rebalance: 10 each
    assert key.balance(idle, 0, 16) is False  # not due yet for another replica
    assert [key.round(r, 0, 16) for r in (busy, idle)] == [10, 10]
    # When the idle replica's runs end (it gives its share back), and a period passes
    assert key.round(idle, 0, 0) == 0
    key.now += 11.0  # a period, and the most a replica waits past it
    # Then the next rebalance moves the idle shard's part to the busy one: all it wants, and
    # half of the 4 slots nobody wants
    assert key.balance(idle, 0, 0) is False  # its own shard did not grow
    assert key.round(busy, 10, 16) == 16
    assert key.store.record(shard_record(KEY, 0)).part == 18


def test_a_shard_holding_more_than_its_fair_part_gives_the_rest_back_as_its_runs_end() -> None:
    # Given a key of 20 in 2 shards, a replica on each, the first one alone at first: its
    # shard got 18 of the 20 (all it wanted, and half the rest)
    key = Pair(20)
    assert key.alone(key.first, 16) == 16
    assert key.round(key.first, 16, 18) == 18
    # When the second replica wants 16 too, and a period passes
    assert key.round(key.second, 0, 16) == 2
    key.now += 11.0
    key.balance(key.second, 2, 16)
    # Then the first replica's target drops to 10: it keeps the 18 its runs use until they
    # end, then gives back the 8 over its target; the next rebalance moves them
    grant = key.grant(key.first, 18, 18)
    assert (grant.granted, grant.target) == (18, 10)
    assert key.round(key.first, 10, 18) == 10
    key.now += 11.0
    key.balance(key.first, 10, 18)
    assert key.round(key.second, 2, 16) == 10


def test_a_shard_whose_demand_came_after_a_rebalance_is_rebalanced_within_a_fifth_period() -> None:
    # Given a key of 20 in 2 shards (a rebalance period of 10 s), the first shard's replica
    # alone at first, holding all 20
    key = Pair(20)
    assert key.alone(key.first, 32) == 20
    # When the second shard's replica wants 16 just after, with nothing
    assert key.round(key.second, 0, 16) == 0
    key.now += 2.5
    # Then it need not wait a period: a rebalance 2.5 s later lowers the first shard's part
    # (a replica holding what it wants asks no sooner than a period)
    assert key.balance(key.first, 20, 20) is False
    key.balance(key.second, 0, 16)
    grant = key.grant(key.first, 20, 32)
    assert (grant.granted, grant.target) == (20, 10)
    # And once the first replica's runs gave back 10, the next one, 2.5 s later, moves them
    assert key.round(key.first, 10, 32) == 10
    key.now += 2.5
    assert key.balance(key.second, 0, 16)
    assert key.round(key.second, 0, 16) == 10


def test_slots_moved_from_a_lapsed_share_to_another_shard_come_with_a_higher_token() -> None:
    # Given a key of 4 in 2 shards, and a replica of the first shard holding all 4 slots
    key = Pair(4, period=1.0)
    lapsing, taker = key.first, key.second
    assert key.alone(lapsing, 4) == 4
    old = key.store.record(shard_record(KEY, 0)).shares[lapsing].token
    # When its share lapses (the replica stopped past the TTL) and the other shard wants them
    key.now += TTL + 1
    key.round(taker, 0, 4)
    key.balance(taker, 0, 4)
    # Then the other shard's replica gets the 4 slots with a higher fencing token
    grant = key.grant(taker, 0, 4)
    assert grant.granted == 4
    assert grant.token > old


def test_a_key_of_one_shard_keeps_its_own_record() -> None:
    store = MemorySlots()
    sharding = Sharding(store, "replica-1", Limits({KEY: 5}, {KEY}), period=0.0)
    assert round_of(sharding, "replica-1", 0, 3, 5) == 3
    assert sharding.keep_balanced({KEY: (3, 3)}) is False
    assert store.keys("") == [KEY]


# --- brought back to one record: a part is a lease ---------------------------------------------

LEASE = part_lease(TTL, 10.0)  # the slot TTL and two rebalance periods


def busy_split(key: Pair) -> float:
    """Both of ``key``'s shards' replicas busy, 10 slots each after the key's first
    rebalance: when (the store's clock) that rebalance ran."""
    for replica in (key.first, key.second):
        key.round(replica, 0, 16)
    assert key.balance(key.first, 0, 16)
    assert [key.round(r, 0, 16) for r in (key.first, key.second)] == [10, 10]
    return key.now


def test_once_no_replica_splits_a_key_its_parts_lapse_and_one_record_gets_every_slot() -> None:
    # Given a key of 20 in 2 shards, a replica on each holding 10, that renew their shares
    # 30 s after the last rebalance and then stop (killed: nothing is given back)
    key = Pair(20)
    last = busy_split(key)
    key.now += 30
    assert [key.round(r, 10, 16) for r in (key.first, key.second)] == [10, 10]
    # When the fleet is redeployed with the key as one record, and a replica wants 32
    # Then it gets no slot while the parts live (the shards' shares may still be running)
    assert key.unsplit("whole-1", 0, 32) == 0
    key.now = last + LEASE - 1
    assert key.unsplit("whole-1", 0, 32) == 0
    # And once they lapsed, a part's lease after the last rebalance, per-run holders and
    # replicas leasing in bulk from the one record get every slot (never more: checked at
    # every write)
    key.now = last + LEASE + 0.1
    assert isinstance(key.store.acquire(KEY, "run-1", 20, TTL), Granted)
    assert key.unsplit("whole-1", 0, 32) == 19
    assert key.store.unsplit_peak == 20


def test_a_rebalance_stalled_past_the_parts_lease_writes_the_shards_a_lapsed_part() -> None:
    # Given a key of 20 in 2 shards, a replica on each holding 10
    key = Pair(20)
    busy_split(key)
    taken: list[int] = []

    def redeployed() -> None:
        """Past the part's lease, a replica keeping the key as one record asks for 32."""
        key.now += LEASE + 1
        taken.append(key.unsplit("whole-1", 0, 32))

    # When the next rebalance stalls between the key's record and the shards' (a paused
    # process) past the parts' lease, while the fleet is redeployed with the key as one record
    key.now += 11
    key.store.between, key.store.after = redeployed, 5
    key.balance(key.first, 10, 16)
    # Then the replica keeping one record got every slot once the parts lapsed
    assert taken == [20]
    # And the stalled rebalance wrote the shards an expiry already past: their replicas
    # get no slot (never more than 20 were granted: checked at every write)
    assert [key.round(r, 10, 16) for r in (key.first, key.second)] == [0, 0]
    assert key.store.record(KEY).shares["whole-1"].granted == 20


def test_a_rebalance_stopped_half_way_grants_the_slots_nowhere_until_the_next_completes() -> None:
    # Given a key of 20 in 2 shards, a replica on each holding 10
    key = Pair(20)
    last = busy_split(key)

    def cut_off() -> None:
        raise StoreUnavailable("cut off")

    # When the next rebalance stops after renewing the parts in the key's record, before
    # the shards' records (step 4)
    key.now += 11
    key.store.between, key.store.after = cut_off, 5
    key.balance(key.first, 10, 16)
    # Then once the shards' parts lapsed (a lease after the last complete rebalance), the
    # shards grant nothing, nor do the key's own record's, which counts them a while longer
    key.now = last + LEASE + 1
    assert [key.round(r, 10, 16) for r in (key.first, key.second)] == [0, 0]
    assert key.unsplit("whole-1", 0, 32) == 0
    # And the next rebalance gives the shards parts again, leaving the replica that keeps
    # one record (and still wants 32) its max-min fair due beside them
    key.balance(key.second, 0, 16)
    assert [key.round(r, 0, 16) for r in (key.first, key.second)] == [7, 7]
    assert key.unsplit("whole-1", 0, 32) == 6


def test_a_mixed_fleet_keeps_the_limit_and_one_record_gets_every_slot_once_the_split_left() -> None:
    # Given a key of 20, four replicas splitting it in 2 shards and two keeping it as one
    # record (a rolling deploy either way), their demands changing at random
    rng = random.Random(7)
    now = [1000.0]
    store = CheckedSlots(20, clock=lambda: now[0])
    split, whole = Limits({KEY: 20}, {KEY}, {KEY: 2}), Limits({KEY: 20}, {KEY})
    splitting = [r for shard in range(2) for r in replicas_of(shard, 2, 2)]
    unsplit = ["whole-1", "whole-2"]
    sides = {
        r: Sharding(store, r, split if r in splitting else whole, ttl=TTL, clock=lambda: now[0])
        for r in splitting + unsplit
    }
    held = dict.fromkeys(sides, 0)
    both = 0

    def turn(replica: str, want: int) -> None:
        held[replica] = round_of(sides[replica], replica, min(held[replica], want), want, 20)
        sides[replica].keep_balanced({KEY: (held[replica], want)})

    # When they run side by side for 200 s
    for _ in range(2000):
        turn(rng.choice(splitting + unsplit), rng.randint(0, 16))
        both += min(sum(held[r] for r in splitting), sum(held[r] for r in unsplit)) > 0
        now[0] += 0.1
    # Then both kinds held slots at once, never more than 20 in all (checked at every write)
    assert both > 0 and store.peak > 0 and store.unsplit_peak > 0
    # And once the splitting replicas left (killed: nothing given back), the others get
    # every slot within a part's lease
    left = now[0]
    while now[0] < left + LEASE + 1:
        for replica in unsplit:
            turn(replica, 16)
        now[0] += 0.5
    assert [held[r] for r in unsplit] == [10, 10]


def test_replicas_keeping_one_record_get_their_due_within_fifths_of_a_period() -> None:
    # Given a key of 20 in 2 shards (a rebalance period of 10 s), a busy replica on each
    # holding 10 (all of it), and a replica keeping the key as one record (a rolling
    # deploy) that wants 16 and finds nothing
    key = Pair(20)
    busy_split(key)
    assert key.unsplit("whole-1", 0, 16) == 0
    # When a replica of a shard that wants more than it holds tries 2.5 s on (a fifth of a
    # period, and the jitter of its tries)
    key.now += 2.5
    assert key.balance(key.first, 10, 16) is False
    # Then the shards' targets drop to leave the other replica its max-min fair due (20
    # among three that want 16: 7, 7 and 6): they keep what their runs use until those end
    grants = [key.grant(r, 10, 16) for r in (key.first, key.second)]
    assert [(g.granted, g.target) for g in grants] == [(10, 7), (10, 7)]
    assert [key.round(r, 7, 16) for r in (key.first, key.second)] == [7, 7]
    # And the next try, 2.5 s on, counts the shards for what they hold: the
    # replica keeping one record gets its due without waiting a period
    key.now += 2.5
    key.balance(key.second, 7, 16)
    assert key.unsplit("whole-1", 0, 16) == 6


def test_shards_counting_nothing_are_not_rebalanced_early_for_replicas_over_their_due() -> None:
    # Given a key of 20 in 2 shards held whole by two replicas keeping it as one record (16
    # and 4, both wanting 16: the first holds more than its due), and a replica of a shard
    # that wants 16, whose first rebalance gave the shards nothing
    key = Pair(20)
    assert key.unsplit("whole-1", 0, 16) == 16
    assert key.unsplit("whole-2", 0, 16) == 4
    assert key.round(key.first, 0, 16) == 0
    key.balance(key.first, 0, 16)
    first = key.store.record(KEY).rebalanced
    # When it tries again 2.5 s on (a fifth of a period, and the jitter), and again
    for _ in range(2):
        key.now += 2.5
        key.balance(key.first, 0, 16)
    # Then no rebalance ran: the shards count for nothing, and no rebalance could lower them
    assert key.store.record(KEY).rebalanced == first
    assert key.round(key.first, 0, 16) == 0
