"""Keys leased in bulk: when a replica's rounds write the key's record, and when they come
between periods (on the in-memory store; the fleet on the emulator is in
test_slot_fairness_emulator.py's per-tenant test)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence

import pytest

from tests.fakes import FakeClock, PermitPool, PoolPermit
from tests.support import wait_for
from workerpool.slots import Limits, MemorySlots
from workerpool.slots.allocation import ShareAsk, lease_shares
from workerpool.slots.shares import ShareManager, ShareUse
from workerpool.slots.store import T, TableMutation
from workerpool.testing.fakes import slot_run
from workerpool.worker.run import Unparkable
from workerpool.worker.timers import Timer, Timers

KEY = "tenant:acme"
LIMIT = 5
TTL = 60.0


class _CountedSlots(MemorySlots):
    """The in-memory store, counting the writes of records (a mutation that changes one)
    and keeping its own clock."""

    def __init__(self) -> None:
        self.now = 1_000.0
        super().__init__(clock=lambda: self.now)
        self.writes = 0

    def _mutate_many(self, items: Sequence[tuple[str, TableMutation[T]]]) -> list[T]:
        def counted(mutation: TableMutation[T]) -> TableMutation[T]:
            def mutate(table: object, now: float) -> tuple[T, object]:
                result, change = mutation(table, now)  # type: ignore[arg-type]
                self.writes += change is not None
                return result, change

            return mutate  # type: ignore[return-value]

        return super()._mutate_many([(key, counted(mutation)) for key, mutation in items])


def _round(store: MemorySlots, replica: str, keep: int, want: int) -> tuple[int, int, float]:
    """One replica's round on KEY: (granted, target, seconds left)."""
    return _grant(store, replica, keep, want)[:3]


def _grant(store: MemorySlots, replica: str, keep: int, want: int) -> tuple[int, int, float, int]:
    """One replica's round on KEY: (granted, target, seconds left, room)."""
    (grant,) = lease_shares(store, [ShareAsk(KEY, replica, LIMIT, keep, want)], TTL)
    return grant.granted, grant.target, grant.left, grant.room


# --- the record ------------------------------------------------------------------------------


def test_a_round_that_changes_nothing_another_replica_sees_writes_nothing() -> None:
    # Given two replicas that split a key of 5, both wanting more than it
    store = _CountedSlots()
    assert _round(store, "a", 0, 12)[0] == 5
    assert _round(store, "b", 0, 9)[0] == 0
    assert _round(store, "a", 3, 12)[:2] == (3, 3)  # a learns its target, keeps 3
    assert _round(store, "b", 0, 9)[:2] == (2, 2)
    writes = store.writes
    # When they ask again a second later, their runs wanting other numbers, all above the
    # split
    store.now += 1
    a, b = _round(store, "a", 3, 20), _round(store, "b", 2, 6)
    # Then the record is read, not written: nobody's share or fair target moved; each still
    # holds its slots, for the time its last write gave it
    assert store.writes == writes
    assert a == (3, 3, TTL - 1) and b == (2, 2, TTL - 1)
    # When b's runs want only 1 (a's fair target grows)
    store.now += 1
    assert _round(store, "b", 1, 1)[0] == 1
    # Then that round is written, and a grows at its own
    assert store.writes == writes + 1
    assert _round(store, "a", 3, 20)[:2] == (4, 4)
    # And a share is renewed (written) once less than half the TTL is left
    store.now += TTL / 2
    granted, _, left = _round(store, "b", 1, 1)
    assert (granted, left) == (1, TTL)
    assert store.writes == writes + 3


def test_a_remainder_slot_stays_with_its_holder_as_the_replicas_wants_cross() -> None:
    # Given two replicas that split a key of 5 as 3 and 2, both wanting more than it, a
    # holding the slot over the equal split
    store = _CountedSlots()
    assert _round(store, "a", 0, 3)[0] == 3
    assert _round(store, "b", 0, 4)[:2] == (2, 2)
    writes = store.writes
    # When a's runs come to want more than b's (5 against 4), and b asks again
    store.now += 1
    a = _round(store, "a", 3, 5)
    b = _round(store, "b", 2, 4)
    # Then the slot stays with a: neither's target moved, and the record was not written
    # (the remainder went to the smaller want: a's target fell to 2 and b's rose to 3, a
    # write, and the slot moved, another; and a round deciding from a want the record had
    # not seen yet could give the slot to neither)
    assert (a[:2], b[:2]) == ((3, 3), (2, 2))
    assert store.writes == writes


def test_a_replica_whose_runs_wanted_nothing_is_told_the_room_it_has() -> None:
    # Given a key of 5, replica a holding 2 for its 2 runs, and replica b whose runs of the
    # key all ended (it gives its share back)
    store = MemorySlots()
    _round(store, "a", 0, 2)
    _round(store, "b", 0, 3)
    granted, _, _, room = _grant(store, "b", 0, 0)
    # Then b is told the 3 slots a does not hold are its room, though its runs wanted none:
    # a run of the key arriving at b next waits for a slot rather than being turned away
    assert (granted, room) == (0, 3)


# --- a replica's share manager --------------------------------------------------------------


@pytest.fixture
def store() -> Iterator[MemorySlots]:
    yield MemorySlots()


# Rounds a period apart come 20 s apart here, early ones at least 5 s apart (a quarter of
# it): a round the test sees within 12 s came early.
PERIOD = 20.0
EARLY = 12.0


def _manager(
    store: MemorySlots, timers: Timers, name: str, clock: Callable[[], float] = time.monotonic
) -> ShareManager:
    return ShareManager(
        store, name, Limits({KEY: LIMIT}, [KEY]), timers, ttl=TTL, period=PERIOD, clock=clock
    )


class _HeldTimers(Timers):
    """Timers whose delayed calls are kept for the test to make (when its clock says so)."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[tuple[float, Callable[[], None]]] = []

    def call_after(self, seconds: float, callback: Callable[[], None]) -> Timer:
        self.held.append((seconds, callback))
        return super().call_after(seconds, lambda: None)


def _take_on_threads(manager: ShareManager, count: int, taken: list[ShareUse]) -> None:
    def take(i: int) -> None:
        use = manager.take(KEY, slot_run(f"{manager}-{i}", key=KEY), 30, park=True)
        assert isinstance(use, ShareUse)
        taken.append(use)

    for i in range(count):
        threading.Thread(target=take, args=(i,), daemon=True).start()


def _running(
    store: MemorySlots,
    timers: Timers,
    name: str,
    count: int,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[ShareManager, list[ShareUse]]:
    """``name``'s manager (not started) with ``count`` runs of KEY in its share, after a
    round."""
    manager = _manager(store, timers, name, clock)
    taken: list[ShareUse] = []
    _take_on_threads(manager, count, taken)
    assert wait_for(lambda: manager.shares()[KEY].want == count, timeout=5)
    manager.renew()
    assert wait_for(lambda: len(taken) == count, timeout=5)
    return manager, taken


def test_a_share_asks_again_at_once_when_more_runs_come_than_its_first_ask_saw(
    store: MemorySlots, timers: Timers
) -> None:
    # Given a replica whose first run of a key was granted its one slot
    manager = _manager(store, timers, "a")
    manager.start()
    taken: list[ShareUse] = []
    _take_on_threads(manager, 1, taken)
    assert wait_for(lambda: len(taken) == 1, timeout=5)
    # When 4 more runs of the key come
    _take_on_threads(manager, 4, taken)
    # Then the share grows to the key's 5 slots in a round that comes now, not a period on
    assert wait_for(lambda: len(taken) == LIMIT, timeout=EARLY)
    assert store.table(KEY).shares["a"].granted == LIMIT
    for use in taken:
        manager.give(use)
    manager.close(5)


def test_slots_another_replica_waits_for_go_back_once_the_runs_have_paused_a_period(
    store: MemorySlots,
) -> None:
    # Given replica a running 5 runs in its share of all 5 slots, and replica b whose runs
    # wait for the key (a has learnt so at a round since)
    clock = FakeClock()
    timers = _HeldTimers()
    timers.start()
    a, taken = _running(store, timers, "a", LIMIT, clock)
    _round(store, "b", 0, 10)
    a.renew()
    assert a.shares()[KEY].target == 3
    a.start()
    # When two of a's runs end, it shrinks to its target of 3 (in a round that comes at
    # once, as before)
    for use in taken[:2]:
        a.give(use)
    assert wait_for(lambda: store.table(KEY).shares["a"].granted == 3, timeout=EARLY)
    # When its other runs end and no more come
    held = len(timers.held)
    for use in taken[2:]:
        a.give(use)
    # Then a keeps those slots a period (its runs may have paused between pulls), and asks
    # for a round then
    ((pause, wake),) = timers.held[held:]
    assert pause == PERIOD
    assert store.table(KEY).shares["a"].granted == 3
    # When that period has passed with no run of the key
    clock.advance(PERIOD)
    wake()
    # Then a gives the slots back in a round that comes now, not a period on
    assert wait_for(lambda: "a" not in store.table(KEY).shares, timeout=EARLY)
    a.close(5)
    timers.close(1.0)


def test_a_share_keeps_its_slots_through_a_pause_of_its_runs_while_another_replica_waits(
    timers: Timers,
) -> None:
    # Given replica a whose 3 runs use all 3 slots of its share of a key of 5, and replica b
    # holding the other 2, its runs wanting more (a has learnt so at a round since)
    store = _CountedSlots()
    clock = FakeClock()
    a, taken = _running(store, timers, "a", 3, clock)
    assert _round(store, "b", 0, 10)[0] == 2
    a.renew()
    assert a.shares()[KEY].contended
    writes = store.writes
    # When a's runs all end, the next pull's not come yet, and its rounds come half a period
    # apart
    for use in taken:
        a.give(use)
    clock.advance(PERIOD / 2)
    a.renew()
    # Then it keeps its slots, and the record is not written (it gave them back to b and
    # asked for them again with its next pull's runs: 5-7 writes for each such pause)
    assert store.table(KEY).shares["a"].granted == 3
    assert store.writes == writes
    # When the next pull's runs come, they start in its share with no write either
    more: list[ShareUse] = []
    _take_on_threads(a, 3, more)
    assert wait_for(lambda: len(more) == 3, timeout=5)
    clock.advance(PERIOD / 2)
    a.renew()
    assert store.writes == writes
    for use in more:
        a.give(use)
    a.close(5)


def test_a_run_coming_after_its_share_was_given_back_is_not_turned_away(
    store: MemorySlots, timers: Timers
) -> None:
    # Given replica a holding 2 of the key's 5, and replica b whose one run of the key ended
    # and whose share went back at its next round
    _round(store, "a", 0, 2)
    b, first = _running(store, timers, "b", 1)
    b.give(first[0])
    b.renew()
    # When a run of the key comes to b while its pool has no room to wait without its permit
    run = slot_run("late", Unparkable(), key=KEY)
    waiting: list[object] = []
    thread = threading.Thread(target=lambda: waiting.append(b.take(KEY, run, 30, park=True)))
    thread.start()
    assert wait_for(lambda: b.shares()[KEY].want == 1, timeout=5)
    b.renew()
    thread.join(5)
    # Then it waits for the slots a does not hold and gets one (it was turned away as if
    # other replicas held every slot: deferred, time after time, by a replica with room)
    assert isinstance(waiting[0], ShareUse)
    b.give(waiting[0])
    b.close(5)


def test_runs_waiting_with_their_permits_take_slots_those_without_cannot_use_yet(
    store: MemorySlots, timers: Timers
) -> None:
    # Given a pool of 2 permits with room for 2 runs to wait without theirs, and a key of 2
    # slots: the first 2 runs of the key put their permits down to wait, the next 2 (taking
    # those permits) wait holding them
    pool = PermitPool(n=2, prefetch=2)
    manager = ShareManager(store, "a", Limits({KEY: 2}, [KEY]), timers, ttl=TTL, period=PERIOD)
    ran: list[str] = []

    def run(job_id: str) -> None:
        permit = PoolPermit(pool)
        permit.take()
        use = manager.take(KEY, slot_run(job_id, permit, key=KEY), 30, park=True)
        assert isinstance(use, ShareUse)
        ran.append(job_id)
        manager.give(use)
        permit.end()

    for n, job_id in enumerate(["parked-1", "parked-2", "held-1", "held-2"], start=1):
        threading.Thread(target=run, args=(job_id,), daemon=True).start()
        assert wait_for(lambda n=n: manager.shares()[KEY].want == n, timeout=5)  # type: ignore[misc]
    assert pool.parked == 2 and pool.free == 0
    # When the share is granted the key's 2 slots
    manager.renew()
    # Then the runs holding permits take them first, and the others once they have their
    # permits back: all 4 run (the first 2 took the slots and waited for permits the other
    # 2 held while they waited for those slots, until their patience ran out)
    assert wait_for(lambda: len(ran) == 4, timeout=10)
    assert ran[0].startswith("held") and sorted(ran) == ["held-1", "held-2", "parked-1", "parked-2"]
    manager.close(5)


def test_a_share_rounds_twice_a_period_while_slots_may_move(
    store: MemorySlots, timers: Timers
) -> None:
    # Given replica a whose 3 runs hold all 3 slots its share has of a key of 5, b holding
    # the other 2 and its runs wanting no more
    a, taken = _running(store, timers, "a", 3)
    _round(store, "b", 0, 2)
    # Then nothing is to move: its next round is a period on
    assert a.next_round() == PERIOD
    # When a newcomer's runs want slots (a's share is to shrink for it, though a does not
    # know it until its next round reads the record), a learns of it at a round
    _round(store, "c", 0, 4)
    a.renew()
    # Then while they wait a rounds twice a period: a share whose round came just before
    # the newcomer's first ask does not keep its larger share a whole period while the
    # others shrink
    assert a.shares()[KEY].contended
    assert a.next_round() == PERIOD / 2
    # When the newcomer is gone again, and a's runs want more than its share holds (and b
    # then gives its slots back)
    _round(store, "c", 0, 0)
    a.renew()
    _take_on_threads(a, 1, taken)
    assert wait_for(lambda: a.shares()[KEY].want == 4, timeout=5)
    # Then it rounds twice a period too: it regrows within half a period of slots freeing,
    # though its room at its last round had no slot for them
    assert not a.shares()[KEY].contended
    assert a.next_round() == PERIOD / 2
    _round(store, "b", 0, 0)
    a.renew()
    assert wait_for(lambda: len(taken) == 4, timeout=5)
    for use in taken:
        a.give(use)
    a.close(5)
