"""Keys leased in bulk: the max-min fair allocator, the record's share mutation, and a
replica's share manager on the in-memory store (the emulator tests are in
test_slot_shares_emulator.py)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest

from bench.slot_shards import simulate
from tests.support import wait_for
from workerpool.slots import Full, Granted, Limits, MemorySlots
from workerpool.slots.allocation import ShareAsk, fair, grow_to, lease_shares
from workerpool.slots.leases import SlotLeases, Taken
from workerpool.slots.shares import ShareManager, ShareUse
from workerpool.testing.fakes import slot_run
from workerpool.worker.outcome import LostLease, Outcome
from workerpool.worker.run import Run
from workerpool.worker.timers import Timers

KEY = "partner-api"
T = TypeVar("T")
TTL = 60.0


# --- the allocator ---------------------------------------------------------------------------


def test_a_small_demand_gets_what_it_needs_and_the_rest_share_equally() -> None:
    # Given a key of 20 slots, one replica wanting 2 and three wanting many
    targets = fair(20, {"small": 2, "a": 50, "b": 40, "c": 16})
    # Then the small one gets its 2, the others split 18 equally
    assert targets == {"small": 2, "a": 6, "b": 6, "c": 6}
    # And a remainder goes one slot each, so shares differ by at most 1
    assert sorted(fair(20, {"a": 50, "b": 40, "c": 16}).values()) == [6, 7, 7]
    # And a remainder stays with those holding it already, whatever they want
    held = {"a": 6, "b": 7, "c": 7}
    assert fair(20, {"a": 16, "b": 19, "c": 20}, held) == {"a": 6, "b": 7, "c": 7}
    # And nobody gets more than it wants, even with slots to spare
    assert fair(20, {"a": 3, "b": 4}) == {"a": 3, "b": 4}


def test_fair_targets_never_sum_above_the_limit_and_are_max_min_fair() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        limit = rng.randint(0, 40)
        wants = {f"r{i}": rng.randint(0, 30) for i in range(rng.randint(1, 12))}
        targets = fair(limit, wants)
        assert sum(targets.values()) <= limit
        assert all(0 <= targets[r] <= wants[r] for r in wants)
        short = [r for r in wants if targets[r] < wants[r]]
        if short:  # every slot is used, and those short of their want differ by at most 1
            assert sum(targets.values()) == limit
            assert max(targets.values()) - min(targets[r] for r in short) <= 1


def test_a_share_grows_only_into_free_slots_and_shrinks_only_to_what_it_keeps() -> None:
    assert grow_to(limit=20, others=15, keep=2, target=10) == 5  # only 5 are free
    assert grow_to(limit=20, others=20, keep=2, target=10) == 2  # none free: it keeps its 2
    assert grow_to(limit=20, others=0, keep=8, target=5) == 8  # above target: until runs end


# --- the record --------------------------------------------------------------------------


def _shared(store: MemorySlots) -> int:
    """Slots the key's record holds in shares now."""
    return store.table(KEY).shared(time.time())


def test_shares_never_exceed_the_limit_while_replicas_rebalance() -> None:
    # Given 5 replicas whose demand changes at random, each keeping at most what it was
    # granted (its runs in use) and giving back the rest as its runs end
    store = MemorySlots()
    rng = random.Random(3)
    limit = 12
    granted = {f"r{i}": 0 for i in range(5)}
    want = dict.fromkeys(granted, 0)
    for step in range(3000):
        replica = rng.choice(list(granted))
        if rng.random() < 0.3:
            want[replica] = rng.choice([0, 1, 3, 20])
        in_use = rng.randint(0, granted[replica])
        keep = max(in_use, min(granted[replica], want[replica]))
        # When it writes its round
        (grant,) = lease_shares(store, [ShareAsk(KEY, replica, limit, keep, want[replica])], TTL)
        granted[replica] = grant.granted
        # Then the record never holds more than the limit, nor less than it kept
        assert grant.granted >= keep
        assert _shared(store) <= limit, step
    # And once demand stays put, a few rounds each bring every share to its fair target (a
    # share above its target keeps only its target once its runs end)
    want = {"r0": 2, "r1": 30, "r2": 30, "r3": 30, "r4": 0}
    target = dict(granted)
    for _ in range(4):
        for replica in granted:
            keep = min(granted[replica], target[replica], want[replica])
            ask = ShareAsk(KEY, replica, limit, keep, want[replica])
            grant = lease_shares(store, [ask], TTL)[0]
            granted[replica], target[replica] = grant.granted, grant.target
    assert granted == {"r0": 2, "r1": 4, "r2": 3, "r3": 3, "r4": 0}


def test_per_run_holders_and_shares_count_against_one_limit() -> None:
    # Given a key of 3 whose shares hold 2, and a per-run holder taking the third
    store = MemorySlots()
    lease_shares(store, [ShareAsk(KEY, "r0", 3, 0, 2)], TTL)
    assert isinstance(store.acquire(KEY, "h1", 3, TTL), Granted)
    # Then neither a per-run holder nor a share gets a fourth
    assert isinstance(store.acquire(KEY, "h2", 3, TTL), Full)
    assert lease_shares(store, [ShareAsk(KEY, "r1", 3, 0, 5)], TTL)[0].granted == 0


def test_a_share_gets_a_new_fencing_token_whenever_it_grows() -> None:
    store = MemorySlots()
    first = lease_shares(store, [ShareAsk(KEY, "r0", 10, 0, 2)], TTL)[0]
    renewed = lease_shares(store, [ShareAsk(KEY, "r0", 10, 2, 2)], TTL)[0]
    grown = lease_shares(store, [ShareAsk(KEY, "r0", 10, 2, 6)], TTL)[0]
    assert renewed.token == first.token < grown.token


# --- a replica's share manager --------------------------------------------------------------


@pytest.fixture
def store() -> Iterator[MemorySlots]:
    yield MemorySlots()


def _manager(store: MemorySlots, timers: Timers, name: str, ttl: float = TTL) -> ShareManager:
    # Rounds run when the test says (``renew``), not on a thread.
    return ShareManager(store, name, Limits({KEY: 4}, [KEY]), timers, ttl=ttl)


class _Waiters:
    """Runs of KEY on threads, each holding its slot until the test ends it."""

    def __init__(self, manager: ShareManager) -> None:
        self.manager = manager
        self.running: list[ShareUse] = []
        self._lock = threading.Lock()

    def arrive(self, count: int) -> None:
        for i in range(count):
            threading.Thread(target=self._run, args=(slot_run(f"j{i}", key=KEY),)).start()

    def _run(self, run: Run) -> None:
        use = self.manager.take(KEY, run, 30, park=True)
        if isinstance(use, ShareUse):
            with self._lock:
                self.running.append(use)

    def end(self, count: int) -> None:
        for _ in range(count):
            with self._lock:
                use = self.running.pop()
            self.manager.give(use)

    def count(self) -> int:
        with self._lock:
            return len(self.running)


def test_two_replicas_rebalance_a_key_without_exceeding_it(
    store: MemorySlots, timers: Timers
) -> None:
    # Given a key of 4 slots in bulk, and replica A with 6 runs wanting a slot
    a, b = _manager(store, timers, "a"), _manager(store, timers, "b")
    runs_a, runs_b = _Waiters(a), _Waiters(b)
    runs_a.arrive(6)
    assert wait_for(lambda: a.shares()[KEY].want == 6, timeout=5)
    a.renew()
    # Then A's share is all 4 slots, and 4 of its runs start with no store write
    assert wait_for(lambda: runs_a.count() == 4, timeout=5)
    # When replica B wants 2 as well
    runs_b.arrive(2)
    assert wait_for(lambda: b.shares()[KEY].want == 2, timeout=5)
    b.renew()
    # Then B gets nothing yet (A holds every slot), but its want is in the record
    assert b.shares()[KEY].granted == 0 and runs_b.count() == 0
    # When A renews, learns its target (2), and two of its runs end
    a.renew()
    assert a.shares()[KEY].target == 2
    runs_a.end(2)
    # Then A starts none of its waiting runs (it is above its target), and gives the two
    # slots back at its next round; B gets them at its own
    assert runs_a.count() == 2
    a.renew()
    assert _shared(store) == 2
    b.renew()
    assert wait_for(lambda: runs_b.count() == 2, timeout=5)
    assert _shared(store) == 4
    # And A keeps its 2 runs going, B its 2: never more than 4 in all
    assert runs_a.count() + runs_b.count() == 4
    runs_a.end(2)
    runs_b.end(2)
    a.close(5)
    b.close(5)


def test_a_share_not_renewed_in_time_hands_its_runs_back_before_it_lapses(
    store: MemorySlots, timers: Timers
) -> None:
    # Given a replica with a share (a TTL of 1.2 s) and a run inside it
    handed_back: list[Outcome] = []

    def hand_back(run: Run, outcome: Outcome) -> bool:
        handed_back.append(outcome)
        return True

    manager = _manager(store, timers, "a", ttl=1.2)
    leases = SlotLeases(store, "a", Limits({KEY: 4}, [KEY]), timers, ttl=1.2)
    leases.shares = manager
    run = slot_run("j1", key=KEY, hand_back=hand_back)
    taken = _after_a_round(manager, lambda: leases.take(KEY, run, patience=5))
    assert isinstance(taken, Taken) and taken.share is not None
    token = taken.lease.token
    # When its rounds stop reaching the store (nothing renews it)
    # Then the run is handed back (a lost lease) while the record still counts its slot
    assert wait_for(lambda: handed_back, timeout=5)
    assert isinstance(handed_back[0], LostLease)
    assert _shared(store) == 1
    # And the run no longer holds a slot of the share: it settles nothing as the owner
    assert run.lost_lease(time.monotonic()) == "slot"
    assert manager.shares()[KEY].granted == 0
    leases.give(taken)  # (its chain ends: nothing more to give back)
    assert manager.shares()[KEY].uses == set()
    # And once the record lets the share lapse, the next grant of the key has a higher token
    assert wait_for(lambda: _shared(store) == 0, timeout=5)
    b = _manager(store, timers, "b")
    use = _after_a_round(b, lambda: b.take(KEY, slot_run("j2", key=KEY), 5, park=True))
    assert isinstance(use, ShareUse) and use.share.token > token


def _after_a_round(manager: ShareManager, take: Callable[[], T]) -> T:
    """What ``take`` returns once it waits for a slot and the manager ran a round."""
    result: list[T] = []
    thread = threading.Thread(target=lambda: result.append(take()))
    thread.start()
    assert wait_for(lambda: manager.shares().get(KEY) and manager.shares()[KEY].want, timeout=5)
    manager.renew()
    thread.join(5)
    return result[0]


def test_a_job_that_came_back_goes_ahead_of_new_ones_in_the_share(
    store: MemorySlots, timers: Timers
) -> None:
    # Given a replica whose share of 1 slot is held by a run
    manager = _manager(store, timers, "a")
    first = _after_a_round(
        manager, lambda: manager.take(KEY, slot_run("j0", key=KEY), 5, park=True)
    )
    assert isinstance(first, ShareUse)
    order: list[str] = []

    def wait(run: Run) -> None:
        use = manager.take(KEY, run, 30, park=True)
        assert isinstance(use, ShareUse)
        order.append(run.job.job_id)
        manager.give(use)

    # ... a new job waiting for it, then a job delivered for the second time (deferred before)
    new = slot_run("new", key=KEY)
    back = slot_run("back", key=KEY)
    back.delivery.delivery_attempt = 2
    threads = [threading.Thread(target=wait, args=(run,)) for run in (new, back)]
    threads[0].start()
    assert wait_for(lambda: manager.shares()[KEY].want == 2, timeout=5)
    threads[1].start()
    assert wait_for(lambda: manager.shares()[KEY].want == 3, timeout=5)
    # When the slot comes free
    manager.give(first)
    for thread in threads:
        thread.join(10)
    # Then the job that came back ran first
    assert order == ["back", "new"]


def test_a_key_sharded_for_100_replicas_stays_within_its_limit_at_4_writes_a_record() -> None:
    # Given a model of 100 replicas on one key of 200, its record split into 25 shards whose
    # limits are rebalanced every 10 periods, the replicas' wants shifting every 30
    result = simulate(
        replicas=100, shards=25, limit=200, periods=120, rebalance=10, shift=30, seed=2
    )
    # Then no record is written more than 4 times a period, never more than 200 slots are
    # granted, and the replicas hold most of what they could use
    assert result.writes_per_record == 4
    assert result.peak <= 200
    assert result.busy >= 0.9
