"""Concurrency slots: one suite for every slot store backend (memory, SQLite, Firestore on its
emulator), the key templates and limits, and the middleware's waiting line."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from tests.conftest import FIRESTORE_PROJECT
from tests.fakes import FakeClock, PermitPool, PoolPermit, through
from tests.support import book, store_handles, wait_for
from workerpool import constants as c
from workerpool.context import AsyncJobContext, Flag, JobContext
from workerpool.errors import ConfigError, Defer
from workerpool.slots import (
    Full,
    Granted,
    KeyTemplate,
    Limits,
    MemorySlots,
    SlotStore,
    SqliteSlots,
    slot_store_opener,
)
from workerpool.slots.gate import PoolGate
from workerpool.slots.keys import BadPayloadKey
from workerpool.slots.leases import GaveUp, SlotLeases, Taken
from workerpool.slots.middleware import Concurrency
from workerpool.slots.store import BOOKING_GRACE, MIN_COME_BACK, WAITER_TTL, Booking, Table
from workerpool.testing.fakes import RoomyPermit as _Permit
from workerpool.testing.fakes import slot_run as _run
from workerpool.worker.outcome import Outcome, Rejected, Succeeded
from workerpool.worker.run import UNPARKABLE, Run
from workerpool.worker.timers import Timers

TTL = 60.0
KEY = "bigquery-exports"
StoreFactory = Callable[[], SlotStore]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=["memory", "sqlite", "firestore"])
def make_store(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[StoreFactory]:
    """Opens handles on one shared backing store, as the replicas of a fleet would."""

    def firestore(collection: str) -> SlotStore:
        from workerpool.slots.firestore import FirestoreSlots

        return FirestoreSlots(FIRESTORE_PROJECT, collection, clock=clock)

    with store_handles(
        request.param, request, monkeypatch,
        memory=lambda: MemorySlots(clock=clock),
        sqlite=lambda: SqliteSlots(tmp_path / "slots.db", clock=clock),
        firestore=firestore,
    ) as make:  # fmt: skip
        yield make


@pytest.fixture
def store(make_store: StoreFactory) -> SlotStore:
    return make_store()


def test_a_key_grants_up_to_its_limit_then_is_full(store: SlotStore, clock: FakeClock) -> None:
    granted = [store.acquire(KEY, f"w{i}", 2, TTL) for i in range(2)]
    assert granted == [Granted(KEY, "w0", 1), Granted(KEY, "w1", 2)]
    assert store.acquire(KEY, "w2", 2, TTL) == Full(2)
    assert store.acquire("other-key", "w2", 2, TTL) == Granted("other-key", "w2", 1)
    assert set(store.table(KEY).holders) == {"w0", "w1"}


def test_a_released_slot_goes_to_the_next_holder_with_a_new_token(store: SlotStore) -> None:
    store.acquire(KEY, "w0", 1, TTL)
    store.release_many([(KEY, "w0")])
    assert store.acquire(KEY, "w1", 1, TTL) == Granted(KEY, "w1", 2)  # tokens never repeat
    store.release_many([(KEY, "w0")])  # not held any more: changes nothing
    assert set(store.table(KEY).holders) == {"w1"}


def test_asking_again_as_a_live_holder_returns_the_same_grant(store: SlotStore) -> None:
    first = store.acquire(KEY, "w0", 2, TTL)
    assert store.acquire(KEY, "w0", 2, TTL) == first  # a lost reply, asked again
    assert store.acquire(KEY, "w1", 2, TTL) == Granted(KEY, "w1", 2)


def test_a_renewed_slot_stays_held_and_a_lapsed_one_frees(
    store: SlotStore, clock: FakeClock
) -> None:
    store.acquire(KEY, "w0", 1, TTL)
    store.acquire(KEY, "w1", 1, TTL)  # full
    clock.advance(TTL * 0.9)
    assert store.renew_many([(KEY, "w0")], TTL) == [True]
    clock.advance(TTL * 0.9)
    assert isinstance(store.acquire(KEY, "w1", 1, TTL), Full)  # renewed: still w0's
    clock.advance(TTL)  # w0 died: no more renewals
    assert store.acquire(KEY, "w1", 1, TTL) == Granted(KEY, "w1", 2)
    assert store.renew_many([(KEY, "w0"), (KEY, "w1")], TTL) == [False, True]


def test_a_lapsed_holder_is_not_revived_by_a_late_renewal(
    store: SlotStore, clock: FakeClock
) -> None:
    # Given a limit of 2 held by w0 (lapsed, still in the record) and w1
    store.acquire(KEY, "w0", 2, TTL)
    clock.advance(TTL / 2)
    store.acquire(KEY, "w1", 2, TTL)
    clock.advance(TTL / 2 + 1)
    # When w2 takes the slot w0 no longer counts for, and w0's renewal arrives late
    assert store.acquire(KEY, "w2", 2, TTL) == Granted(KEY, "w2", 3)
    # Then w0 hears it lost the slot, and the key never has more than 2 holders
    assert store.renew_many([(KEY, "w0")], TTL) == [False]
    assert set(store.table(KEY).holders) == {"w1", "w2"}


def test_a_freed_slot_goes_to_the_replica_that_waited_longest(
    store: SlotStore, clock: FakeClock
) -> None:
    # Given a full key and two replicas waiting in line, r1 first
    store.acquire(KEY, "holder", 1, TTL)
    assert store.acquire(KEY, "r1", 1, TTL, wait=True) == Full(1, 0)
    clock.advance(0.5)
    assert store.acquire(KEY, "r2", 1, TTL, wait=True) == Full(1, 1)
    # When the slot is freed, Then a newcomer and r2 do not jump the line, r1 gets it
    clock.advance(0.1)
    store.release_many([(KEY, "holder")])
    assert store.acquire(KEY, "newcomer", 1, TTL) == Full(0, 2)
    assert store.acquire(KEY, "r2", 1, TTL, wait=True) == Full(0, 1)
    assert store.acquire(KEY, "r1", 1, TTL, wait=True) == Granted(KEY, "r1", 2)
    store.release_many([(KEY, "r1")])
    assert store.acquire(KEY, "r2", 1, TTL, wait=True) == Granted(KEY, "r2", 3)
    assert store.table(KEY).waiters == {}


def test_a_release_hands_its_slot_to_the_first_in_line_in_the_same_write(
    store: SlotStore, clock: FakeClock
) -> None:
    # Given a key of limit 1 whose holder's job was booked, and two replicas in line
    book(store, KEY, "j-next", 1)
    clock.advance(0.1)
    store.acquire(KEY, "holder", 1, TTL)
    store.acquire(KEY, "second", 1, TTL, wait=True)
    clock.advance(0.5)
    store.acquire(KEY, "first", 1, TTL, wait=False)  # no place: it did not wait
    store.acquire(KEY, "booked", 1, TTL, wait=True, job_id="j-next")
    # When the holder releases its slot
    clock.advance(1.0)
    store.release(KEY, "holder", held_for=1.5, limit=1, ttl=TTL)
    # Then the oldest place in line holds it (the booked job's, kept from its deferral),
    # with a new token and the lease running since the release; the rest still wait
    table = store.table(KEY)
    assert set(table.holders) == {"booked"} and set(table.waiters) == {"second"}
    assert table.holders["booked"].token == 2 and table.holders["booked"].job_id == "j-next"
    clock.advance(2.0)
    assert store.acquire(KEY, "second", 1, TTL, wait=True) == Full(1)
    granted = store.acquire(KEY, "booked", 1, TTL, wait=True, job_id="j-next")
    assert granted == Granted(KEY, "booked", 2) and granted.age == pytest.approx(2.0)
    # And its release gives up its job's booking, and hands the slot on again
    store.release(KEY, "booked", held_for=2.0, limit=1, ttl=TTL)
    table = store.table(KEY)
    assert set(table.holders) == {"second"} and table.booked == {}
    assert table.holders["second"].token == 3


def test_a_release_hands_nothing_over_beyond_the_limit_or_to_a_lapsed_place(
    store: SlotStore, clock: FakeClock
) -> None:
    # Given a key of limit 2 held twice, one replica in line that stopped refreshing its place
    store.acquire(KEY, "h1", 2, TTL)
    store.acquire(KEY, "h2", 2, TTL)
    store.acquire(KEY, "gone", 2, TTL, wait=True)
    # When h1 releases with the limit lowered to 1 elsewhere, Then the waiter gets nothing
    store.release(KEY, "h1", held_for=1.0, limit=1, ttl=TTL)
    assert set(store.table(KEY).holders) == {"h2"}
    # When h2 releases after the place lapsed, Then the slot is free for anyone
    clock.advance(WAITER_TTL + 0.1)
    store.release(KEY, "h2", held_for=1.0, limit=2, ttl=TTL)
    assert store.table(KEY).holders == {}
    assert store.acquire(KEY, "newcomer", 2, TTL) == Granted(KEY, "newcomer", 3)


def test_a_change_made_by_another_replica_is_told_where_the_backend_can(
    make_store: StoreFactory, request: pytest.FixtureRequest
) -> None:
    # Given a replica told of changes to a key it asked about (its first copy, once watched)
    here, elsewhere = make_store(), make_store()
    told = threading.Event()
    here.on_change(KEY, told.set)
    here.acquire(KEY, "w0", 1, TTL)
    pushes = request.node.callspec.params["make_store"] == "firestore"
    patience = 10 if pushes else 0.5  # where nothing is pushed, a short wait shows none came
    assert told.wait(patience) == pushes
    told.clear()
    # When another replica changes the key's record, Then it is told where the backend
    # pushes changes (Firestore's listener); elsewhere its waiters poll, and nothing calls it
    elsewhere.acquire(KEY, "w1", 1, TTL, wait=True)
    assert told.wait(patience) == pushes


def test_a_place_in_line_lapses_unless_refreshed_and_can_be_given_up(
    store: SlotStore, clock: FakeClock
) -> None:
    store.acquire(KEY, "holder", 1, TTL)
    store.acquire(KEY, "dead", 1, TTL, wait=True)  # its replica dies: no more refreshes
    store.acquire(KEY, "quits", 1, TTL, wait=True)
    store.release_many([(KEY, "quits")])  # gave up waiting
    assert set(store.table(KEY).waiters) == {"dead"}
    clock.advance(WAITER_TTL + 0.1)
    store.release_many([(KEY, "holder")])
    assert store.acquire(KEY, "next", 1, TTL) == Granted(KEY, "next", 2)


def test_a_deferred_job_is_told_to_come_back_by_its_place_in_line(
    store: SlotStore, clock: FakeClock
) -> None:
    # Given a key of limit 2 whose hold time is not measured yet
    store.acquire(KEY, "h1", 2, TTL)
    store.acquire(KEY, "h2", 2, TTL)
    # Then a deferred job comes back when the oldest slot has been held as long again
    assert book(store, KEY, "j1", 2) - clock.now == MIN_COME_BACK
    clock.advance(5)
    assert book(store, KEY, "j2", 2) - clock.now == 5.0
    # Once a release measured one (4 s), a job comes back a little before a slot may be
    # free for it: 3rd in line, 2 slots of 4 s, 0.8 of that
    store.release_many([(KEY, "h1")], held_for=4.0)
    store.acquire(KEY, "h3", 2, TTL)
    assert book(store, KEY, "j3", 2) - clock.now == pytest.approx(0.8 * 3 * 4 / 2)
    # And one that comes back early keeps its place instead of going to the end
    assert book(store, KEY, "j1", 2) - clock.now == pytest.approx(0.8 * 1 * 4 / 2)
    # And a replica waiting now is ahead of every deferred job
    store.acquire(KEY, "replica", 2, TTL, wait=True)
    assert book(store, KEY, "j3", 2) - clock.now == pytest.approx(0.8 * 4 * 4 / 2)
    # And a booked job that comes back goes before that replica, which came later; while it
    # runs, it is not counted ahead of the jobs booked after it; its booking goes with its slot
    # (h2 was held 5 s since its grant: a caller counting 8 s from before its ask waited 3 s
    # for its answer, which is not the slot's hold)
    store.release_many([(KEY, "h2")], held_for=8.0)
    assert store.acquire(KEY, "w-j1", 2, TTL, job_id="j1") == Granted(KEY, "w-j1", 4)
    hold = 4 + 0.2 * (5 - 4)
    assert store.table(KEY).hold == pytest.approx(hold)
    assert book(store, KEY, "j3", 2) - clock.now == pytest.approx(0.8 * 3 * hold / 2)
    store.release_many([(KEY, "w-j1")], held_for=hold)
    assert set(store.table(KEY).booked) == {"j2", "j3"}
    # And a booking whose job never came back is dropped after a grace period
    clock.advance(BOOKING_GRACE + 60)
    assert set(store.table(KEY).bookings(clock.now)) == set()


def test_handles_racing_on_one_key_never_exceed_its_limit(make_store: StoreFactory) -> None:
    # Given 8 handles on one store (8 replicas), each taking and giving back slots in a loop
    limit, rounds = 3, 15
    handles = [make_store() for _ in range(8)]
    holding = 0
    peak = 0
    grants = 0
    lock = threading.Lock()
    errors: list[BaseException] = []

    def replica(index: int) -> None:
        nonlocal holding, peak, grants
        try:
            for round_ in range(rounds):
                holder = f"w{index}-{round_}"
                if not isinstance(handles[index].acquire(KEY, holder, limit, TTL), Granted):
                    continue
                with lock:
                    holding += 1
                    peak = max(peak, holding)
                    grants += 1
                time.sleep(0.002)
                with lock:
                    holding -= 1
                handles[index].release_many([(KEY, holder)])
        except BaseException as exc:  # pragma: no cover - shown by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=replica, args=(i,)) for i in range(len(handles))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    # Then the limit held at every moment, and slots did go round
    assert errors == []
    assert peak <= limit
    assert grants >= rounds


def test_a_change_made_through_one_handle_is_seen_by_another_soon(
    make_store: StoreFactory,
) -> None:
    # Given two replicas' handles, one waiting in the key's line (its asks may be answered
    # from a recent copy of the record, where the backend keeps one)
    a, b = make_store(), make_store()
    a.acquire(KEY, "h", 1, TTL)
    assert isinstance(b.acquire(KEY, "w", 1, TTL, wait=True), Full)
    assert b.acquire("other-key", "y", 2, TTL) == Granted("other-key", "y", 1)
    # When a slot is taken and another freed through the first handle
    a.acquire("other-key", "x", 2, TTL)
    b.release_many([("other-key", "x")])  # at once: its copy may not show "x" yet
    a.release_many([(KEY, "h")])
    # Then a release through the second never misses a holder, and its waiter gets the slot
    # at one of its next asks
    assert set(a.table("other-key").holders) == {"y"}
    deadline = time.monotonic() + 2
    while not isinstance(b.acquire(KEY, "w", 1, TTL, wait=True), Granted):
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_keys_are_listed_by_prefix(store: SlotStore) -> None:
    for key in ("partner:b", "partner:a", "partner%_x", "exports"):
        store.acquire(key, "w", 1, TTL)
    book(store, "partner:a", "deferred", 1)  # a record of its own, not a key
    assert store.keys("partner:") == ["partner:a", "partner:b"]
    assert store.keys("partner%") == ["partner%_x"]  # no wildcards in a prefix
    assert store.keys("") == ["exports", "partner%_x", "partner:a", "partner:b"]


def test_slot_store_urls() -> None:
    assert slot_store_opener("memory://")().table(KEY) == Table()
    with pytest.raises(ValueError, match="need a store shared"):
        slot_store_opener("none")
    with pytest.raises(ValueError, match="unsupported store URL"):
        slot_store_opener("postgres://db")


# --- keys and limits -------------------------------------------------------------------------


def test_limits_take_the_exact_key_then_the_longest_prefix() -> None:
    limits = Limits({"exports": 2, "partner:*": 1, "partner:eu:*": 3})
    assert limits.of("exports") == 2
    assert limits.of("partner:acme") == 1
    assert limits.of("partner:eu:acme") == 3
    assert limits.of("exports-2") is None
    with pytest.raises(ConfigError, match="may only end in"):
        Limits({"a*b": 1})
    with pytest.raises(ConfigError, match="positive integer"):
        Limits({"a": 0})


def test_a_template_renders_one_key_per_tenant_and_names_what_is_missing() -> None:
    template = KeyTemplate("partner:{partner_id}")
    assert template.render({"partner_id": "acme", "x": 1}) == "partner:acme"
    assert template.render({"partner_id": 7}) == "partner:7"
    for payload in ({}, {"partner_id": None}, {"partner_id": {"nested": 1}}):
        with pytest.raises(BadPayloadKey, match="partner_id"):
            template.render(payload)


def test_a_key_that_could_name_a_shard_record_is_refused_for_good(timers: Timers) -> None:
    # Given "partner:*" leased in bulk and split in 2 shards (records "partner:acme#0", ...),
    # and a job whose key is "partner:{partner_id}"
    limits = Limits({"partner:*": 5}, {"partner:*"}, {"partner:*": 2})
    store = MemorySlots()
    concurrency = Concurrency(SlotLeases(store, "w", limits, timers))
    ran: list[str] = []

    def handler(run: Run) -> Outcome:
        ran.append(run.job.job_id)
        return Succeeded()

    # When a payload's partner_id puts # in the key (it would name a shard's record)
    run = _run("1", key="partner:{partner_id}")
    run.job.payload = {"partner_id": "acme#0"}
    outcome = through(concurrency, run, handler)
    # Then the run is rejected as an invalid payload (one failure record, never retried),
    # before its handler or any store write
    assert isinstance(outcome, Rejected) and outcome.error_type == c.ERR_INVALID_PAYLOAD
    assert "'partner:acme#0'" in outcome.error_message and ran == []
    assert store.keys("") == []
    # And a handler naming such a key for part of its run is refused too
    with pytest.raises(LookupError, match="may not contain #"):
        concurrency.take_in_run("partner:acme#1", _run("2"))
    assert store.keys("") == []


def test_a_template_must_be_covered_by_a_declared_limit() -> None:
    limits = Limits({"exports": 2, "partner:*": 1})
    assert KeyTemplate("exports").check(limits) is None
    assert KeyTemplate("partner:{id}").check(limits) is None
    assert KeyTemplate("partner:{region}:{id}").check(limits) is None
    assert KeyTemplate("imports").check(limits) == "has no declared limit"
    problem = KeyTemplate("tenant:{id}").check(limits)
    assert problem is not None and '"tenant:*"' in problem
    # A key a pattern covers that could name a shard record ("partner:a"'s first) is refused
    # as the worker starts, not at each job's run
    for shard_like in ("partner:a#0", "partner:#{id}"):
        assert KeyTemplate(shard_like).check(limits) == (
            "a key may not contain # (it marks a split key's shard records)"
        )
    for bad in ("p:{a.b}", "p:{0}", "p:{a!r}", "p:{a:>3}", "p:{"):
        with pytest.raises(ConfigError):
            KeyTemplate(bad)


# --- waiting for a slot ----------------------------------------------------------------------


def test_runs_of_one_process_get_a_key_first_come_first_served(timers: Timers) -> None:
    # Given a key of limit 1 held by run 0, and runs 1..5 queueing behind it in order
    leases = SlotLeases(MemorySlots(), "w", Limits({KEY: 1}), timers)
    first = leases.take(KEY, _run("0"), patience=5)
    assert not isinstance(first, GaveUp)
    order: list[str] = []

    def wait_then_hold(name: str) -> None:
        taken = leases.take(KEY, _run(name), patience=30)
        assert not isinstance(taken, GaveUp)
        order.append(name)
        leases.give(taken)

    threads = []
    for name in "12345":
        threads.append(threading.Thread(target=wait_then_hold, args=(name,)))
        threads[-1].start()
        time.sleep(0.05)  # arrive in this order
    # When the holder gives its slot back
    leases.give(first)
    for thread in threads:
        thread.join(30)
    # Then the waiters got it in the order they came
    assert order == list("12345")


class _SlowBookings(MemorySlots):
    """Bookings that take until ``written`` is set to write (a busy shared document)."""

    def __init__(self) -> None:
        super().__init__()
        self.written = threading.Event()

    def book_many(self, bookings: Sequence[tuple[str, str, Booking]]) -> None:
        self.written.wait(10)
        super().book_many(bookings)


def test_a_deferral_does_not_wait_for_its_booking_and_a_close_writes_it(timers: Timers) -> None:
    # Given a key of limit 1 held, and a store whose bookings are slow to write
    store = _SlowBookings()
    leases = SlotLeases(store, "w", Limits({KEY: 1}), timers)
    assert not isinstance(leases.take(KEY, _run("0"), patience=5), GaveUp)
    # When two jobs are deferred, Then each is told when to come back before any booking is
    # written (the deferral's message is not held for it)
    assert 0 < leases.come_back_in(KEY, "j1") <= MIN_COME_BACK
    assert 0 < leases.come_back_in(KEY, "j2") <= MIN_COME_BACK
    assert store.table(KEY).booked == {}
    # And closing writes them, in place order
    store.written.set()
    leases.close(5.0)
    booked = store.table(KEY).booked
    assert list(booked) == ["j1", "j2"] and booked["j1"].since <= booked["j2"].since


class _BrokenOnce(MemorySlots):
    """Bookings whose first write fails with a bug (not a store error)."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    def book_many(self, bookings: Sequence[tuple[str, str, Booking]]) -> None:
        if not self.failed:
            self.failed = True
            raise RuntimeError("a bug")
        super().book_many(bookings)


def test_the_booking_writer_survives_a_failed_write_and_writes_the_next(timers: Timers) -> None:
    # Given a key held, and a store whose first booking write raises an unexpected error
    store = _BrokenOnce()
    leases = SlotLeases(store, "w", Limits({KEY: 1}), timers)
    assert not isinstance(leases.take(KEY, _run("0"), patience=5), GaveUp)
    # When one job is deferred (its booking lost to the error), then another
    leases.come_back_in(KEY, "lost")
    assert wait_for(lambda: store.failed, timeout=5, interval=0.01)
    leases.come_back_in(KEY, "kept")
    # Then the writer is still there: the second booking is written
    assert wait_for(lambda: "kept" in store.table(KEY).booked, timeout=5, interval=0.01)
    assert "lost" not in store.table(KEY).booked
    leases.close(1.0)


def test_a_waiter_gives_up_after_its_patience_or_when_the_pool_drains(timers: Timers) -> None:
    leases = SlotLeases(MemorySlots(), "w", Limits({KEY: 1}), timers)
    held = leases.take(KEY, _run("0"), patience=5)
    assert not isinstance(held, GaveUp)
    waiter = _run("1")
    assert leases.take(KEY, waiter, patience=0.2) is GaveUp.PATIENCE
    assert isinstance(waiter.permit, _Permit) and not waiter.permit.held  # waited without it
    draining = _run("2")
    threading.Timer(0.1, draining.ctx.draining.set).start()
    assert leases.take(KEY, draining, patience=30) is GaveUp.STOPPED
    # With no room to wait without its permit, a run gives up at once
    assert leases.take(KEY, _run("3", UNPARKABLE), patience=30) is GaveUp.NO_ROOM
    leases.give(held)
    assert not isinstance(leases.take(KEY, _run("4"), patience=1), GaveUp)


def _in_front(leases: SlotLeases, job_id: str) -> bool:
    """Whether ``job_id``'s run is the one waiting for a slot holding its permit."""
    front = leases._front
    return front is not None and front[0].job.job_id == job_id


def test_a_job_deferred_before_goes_first_and_waits_with_its_permit_if_there_is_no_room(
    timers: Timers,
) -> None:
    # Given a key of limit 1 held, a job that found it full and was deferred, and a newer
    # message now waiting for it (without its permit, filling the pool's room to wait so)
    store = MemorySlots()
    leases = SlotLeases(store, "w", Limits({KEY: 1, "other": 1}), timers)
    held = leases.take(KEY, _run("0"), patience=5)
    assert not isinstance(held, GaveUp)
    book(store, KEY, "old", 1)
    order: list[str] = []

    def wait_then_hold(run: Run) -> None:
        taken = leases.take(KEY, run, patience=30)
        if not isinstance(taken, GaveUp):
            order.append(run.job.job_id)
            leases.give(taken)

    newer = threading.Thread(target=wait_then_hold, args=(_run("new"),))
    newer.start()
    assert wait_for(lambda: len(store.table(KEY).waiters) == 1, timeout=5, interval=0.01)
    # When the deferred job comes back and the pool has no room for it to wait without its
    # permit, Then it waits all the same, holding it, ahead of the newer message
    returning = threading.Thread(target=wait_then_hold, args=(_run("old", UNPARKABLE),))
    returning.start()
    assert wait_for(lambda: _in_front(leases, "old"), timeout=5, interval=0.01)
    # and the newer message gives its place in the key's line up at once (a release would
    # hand it the slot while it no longer asks), long before the place would lapse
    places = lambda: [w.job_id for w in store.table(KEY).waiters.values()]  # noqa: E731
    assert wait_for(lambda: places() == ["old"], timeout=WAITER_TTL / 2, interval=0.01)
    # (one deferred after the newer message came is behind it: deferred again)
    book(store, KEY, "later", 1)
    assert leases.take(KEY, _run("later", UNPARKABLE), patience=30) is GaveUp.NO_ROOM
    # And one run waits so at a time: the first of another key's line is deferred
    other = leases.take("other", _run("o-0"), patience=5)
    assert not isinstance(other, GaveUp)
    book(store, "other", "o-1", 1)
    assert leases.take("other", _run("o-1", UNPARKABLE), patience=30) is GaveUp.NO_ROOM
    leases.give(other)
    # When the slot is freed, the job deferred before gets it first
    leases.give(held)
    newer.join(10)
    returning.join(10)
    assert order == ["old", "new"] and leases._front is None
    # And a newcomer with no room is deferred at once, as before
    blocker = leases.take(KEY, _run("1"), patience=5)
    assert not isinstance(blocker, GaveUp)
    assert leases.take(KEY, _run("2", UNPARKABLE), patience=30) is GaveUp.NO_ROOM
    leases.give(blocker)


def test_the_earliest_deferred_job_takes_the_front_over_from_a_later_one(timers: Timers) -> None:
    # Given a key held, and two jobs deferred one after the other
    store = MemorySlots()
    leases = SlotLeases(store, "w", Limits({KEY: 1}), timers)
    held = leases.take(KEY, _run("0"), patience=5)
    assert not isinstance(held, GaveUp)
    book(store, KEY, "earlier", 1)
    book(store, KEY, "later", 1)
    results: dict[str, object] = {}

    def take(job_id: str) -> None:
        results[job_id] = taken = leases.take(KEY, _run(job_id, UNPARKABLE), patience=30)
        if not isinstance(taken, GaveUp):
            leases.give(taken)

    # When the later one comes back first, with no room to wait without its permit
    threads = [threading.Thread(target=take, args=("later",))]
    threads[0].start()
    assert wait_for(lambda: _in_front(leases, "later"), timeout=5, interval=0.01)
    # and then the earlier one
    threads.append(threading.Thread(target=take, args=("earlier",)))
    threads[1].start()
    # Then the earlier one takes the front over, the later one is deferred again
    assert wait_for(lambda: results.get("later") is GaveUp.NO_ROOM, timeout=5, interval=0.01)
    assert _in_front(leases, "earlier")
    leases.give(held)
    for thread in threads:
        thread.join(10)
    assert not isinstance(results["earlier"], GaveUp)


def test_with_one_permit_a_returning_job_never_holds_it_from_a_run_granted_its_slot(
    timers: Timers,
) -> None:
    # Given a pool of N = 1 (a prefetch of 1), a key held by another replica, a job deferred
    # earlier, and a newer message waiting for the key without its permit
    store = MemorySlots()
    leases = SlotLeases(store, "w", Limits({KEY: 1}), timers)
    assert isinstance(store.acquire(KEY, "elsewhere", 1, 60), Granted)
    book(store, KEY, "old", 1)
    pool = PermitPool(1, 1)
    waiting = PoolPermit(pool)
    waiting.take()
    got: dict[str, object] = {}
    newer = threading.Thread(
        target=lambda: got.update(new=leases.take(KEY, _run("new", waiting), patience=30))
    )
    newer.start()
    assert wait_for(lambda: len(store.table(KEY).waiters) == 1, timeout=5, interval=0.01)
    # and another job running on the pool's one permit
    running = PoolPermit(pool)
    running.take()
    # When the other replica lets the slot go (handed to the waiting message's place, which
    # now waits for the permit), and the running job's permit goes to the returning job
    store.release(KEY, "elsewhere", held_for=1, limit=1, ttl=60)
    assert wait_for(lambda: leases._picking_up == 1, timeout=5, interval=0.01)
    returning = PoolPermit(pool, state=running.state)  # the permit, handed on
    # Then the returning job does not wait with the permit the granted one needs: deferred
    assert leases.take(KEY, _run("old", returning), patience=30) is GaveUp.NO_ROOM
    returning.end()
    newer.join(10)
    assert isinstance(got["new"], Taken) and waiting.state == "held"


class _Counted(_Permit):
    def __init__(self) -> None:
        super().__init__()
        self.pick_ups = 0

    def pick_up(self) -> bool:
        self.pick_ups += 1
        return super().pick_up()


def test_a_waiter_asks_again_without_its_permit_and_takes_it_back_once_granted(
    timers: Timers,
) -> None:
    # Given a key of limit 1 held, and a run waiting for it first in line
    store = MemorySlots()
    leases = SlotLeases(store, "w", Limits({KEY: 1}), timers)
    held = leases.take(KEY, _run("0"), patience=5)
    assert not isinstance(held, GaveUp)
    waiter, got = _run("1", _Counted()), {}
    asking = threading.Thread(target=lambda: got.update(slot=leases.take(KEY, waiter, 30)))
    asking.start()
    time.sleep(0.5)  # it asks the store again and again meanwhile
    # Then it waits without its permit (counted against the prefetch, not N)
    assert isinstance(waiter.permit, _Counted) and not waiter.permit.held
    assert waiter.permit.pick_ups == 0
    # When the slot is freed, Then it holds it and takes its permit back, once
    leases.give(held)
    asking.join(5)
    assert not isinstance(got["slot"], GaveUp)
    assert waiter.permit.held and waiter.permit.pick_ups == 1

    # And a run granted a slot as the pool drains gives it back unused
    class Drained(_Permit):
        def pick_up(self) -> bool:
            return False

    leases.give(got["slot"])  # type: ignore[arg-type]
    blocker = leases.take(KEY, _run("2"), patience=5)
    assert not isinstance(blocker, GaveUp)
    late = _run("3", Drained())
    threading.Timer(0.3, lambda: leases.give(blocker)).start()
    assert leases.take(KEY, late, patience=5) is GaveUp.STOPPED
    assert store.table(KEY).holders == {}


def test_a_slot_for_part_of_a_run_needs_a_declared_limit() -> None:
    ctx = JobContext("t", "j", "m", 1, None, Flag())
    limitless = pytest.raises(LookupError, match="no concurrency limit is declared for 'calls'")
    with limitless, ctx.slot("calls"):
        pass


def test_a_gated_pool_reserves_slots_before_it_pulls_and_binds_one_per_message(
    timers: Timers,
) -> None:
    # Given two replicas' pools gated on a key of limit 2
    store = MemorySlots()
    stop = threading.Event()
    gate = PoolGate(SlotLeases(store, "a", Limits({KEY: 2}), timers), KEY)
    leases = SlotLeases(store, "b", Limits({KEY: 2}), timers)
    leases.keeper.start()  # it releases the slots of messages that never ran
    other = PoolGate(leases, KEY)
    # When one has room for 8 messages: it reserves both slots, the other none meanwhile
    assert gate.reserve(8, timeout=1, stop=stop) == 2
    assert other.reserve(8, timeout=0.1, stop=stop) == 0
    # And its pull brings one message: that one is bound to a slot, the spare goes back
    first, second = _run("1"), _run("2")
    gate.bind([first.delivery])
    assert len(store.table(KEY).holders) == 1
    assert gate.claim(second.delivery) is None
    reserved = gate.claim(first.delivery)
    assert reserved is not None and reserved.lease.key == KEY
    assert gate.claim(first.delivery) is None  # claimed once
    # Then the other replica, waiting in the key's line, gets the freed slot first
    assert other.reserve(8, timeout=1, stop=stop) == 1
    assert gate.reserve(8, timeout=0.1, stop=stop) == 0
    # And a message that leaves the pool without running gives its slot back
    other.bind([second.delivery])
    other.settled(second.delivery.message_id)
    assert wait_for_holders(store, 1)
    leases.keeper.close(1.0)


def test_a_gated_pool_stops_waiting_for_a_slot_when_told_to(timers: Timers) -> None:
    store = MemorySlots()
    full = PoolGate(SlotLeases(store, "a", Limits({KEY: 1}), timers), KEY)
    assert full.reserve(1, timeout=1, stop=threading.Event()) == 1
    waiting = PoolGate(SlotLeases(store, "b", Limits({KEY: 1}), timers), KEY)
    stop = threading.Event()
    threading.Timer(0.1, stop.set).start()
    began = time.monotonic()
    assert waiting.reserve(1, timeout=30, stop=stop) == 0
    assert time.monotonic() - began < 5
    assert store.table(KEY).waiters == {}  # its place in line given up


def wait_for_holders(store: SlotStore, count: int) -> bool:
    deadline = time.monotonic() + 5
    while len(store.table(KEY).holders) != count and time.monotonic() < deadline:
        time.sleep(0.01)
    return len(store.table(KEY).holders) == count


def test_a_named_slot_is_one_slot_for_every_run_asking_under_its_name(timers: Timers) -> None:
    # Given a key of limit 2 and a slot named after the work it guards
    store = MemorySlots()
    leases = SlotLeases(store, "w", Limits({KEY: 2}), timers)
    first = leases.take(KEY, _run("1"), patience=1, park=False, holder="export-1")
    assert not isinstance(first, GaveUp)
    # When its run stops inside it (the work goes on) and the next run of that work asks
    leases.leave(first)
    assert list(store.table(KEY).holders) == ["export-1"]  # left held
    again = leases.take(KEY, _run("1"), patience=1, park=False, holder="export-1")
    # Then it holds the same slot (same token), and the key's other slot is still free
    assert not isinstance(again, GaveUp) and again.lease.token == first.lease.token
    other = leases.take(KEY, _run("2"), patience=1, park=False)
    assert not isinstance(other, GaveUp)
    assert len(store.table(KEY).holders) == 2
    leases.give(again)
    assert "export-1" not in store.table(KEY).holders


class _Slots:
    """``context.Slots`` recording what became of each lease."""

    def __init__(self) -> None:
        self.ends: list[tuple[str, bool]] = []

    def take(self, key: str, holder: str | None = None) -> str:
        return holder or key

    def give(self, lease: str, *, release: bool = True) -> None:
        self.ends.append((lease, release))


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_named_slot_outlives_only_a_run_stopped_inside_it(kind: str) -> None:
    def block(ctx: JobContext, holder: str | None, fail: bool) -> None:
        with ctx.slot(KEY, holder=holder):
            if fail:
                raise RuntimeError("stopped")

    async def async_block(ctx: AsyncJobContext, holder: str | None, fail: bool) -> None:
        async with ctx.slot(KEY, holder=holder):
            if fail:
                raise RuntimeError("stopped")

    def enter(holder: str | None, fail: bool, draining: bool) -> tuple[str, bool]:
        slots = _Slots()
        flag = Flag()
        if draining:
            flag.set()
        if kind == "sync":
            ctx = JobContext("t", "j", "m", 1, None, flag, slots=slots)
            with contextlib.suppress(RuntimeError):
                block(ctx, holder, fail)
        else:
            actx = AsyncJobContext("t", "j", "m", 1, None, flag, slots=slots)
            with contextlib.suppress(RuntimeError):
                asyncio.run(async_block(actx, holder, fail))
        return slots.ends[0]

    # A named slot is left held only when its run stops inside the block (draining);
    # otherwise, and an unnamed slot always, is released
    assert enter("export-1", fail=True, draining=True) == ("export-1", False)
    assert enter("export-1", fail=True, draining=False) == ("export-1", True)
    assert enter("export-1", fail=False, draining=True) == ("export-1", True)
    assert enter(None, fail=True, draining=True) == (KEY, True)


def test_a_run_is_freed_as_soon_as_its_chain_returns_not_by_the_cyclic_collector(
    timers: Timers,
) -> None:
    # Given the concurrency middleware (every run goes through it where any limit is
    # declared) and a run that also takes a slot for part of its work
    concurrency = Concurrency(SlotLeases(MemorySlots(), "w", Limits({KEY: 2}), timers))

    def handler(run: Run) -> Outcome:
        with run.ctx.slot(KEY):
            return Succeeded()

    run = _run("1")
    ctx, gone = run.ctx, weakref.ref(run)
    gc.disable()
    try:
        # When its chain returns and nothing else holds the run
        assert isinstance(through(concurrency, run, handler), Succeeded)
        del run
        # Then it is freed at once: its context leads back to it no more
        assert gone() is None
    finally:
        gc.enable()
    # And a handler still going after its run ended gets no new slot
    with pytest.raises(Defer, match="the run must stop"), ctx.slot(KEY):
        pass


def test_a_run_knows_the_fencing_token_of_the_slot_it_was_started_in(timers: Timers) -> None:
    # Given a key of one slot, and runs of a job that takes it, one after the other
    concurrency = Concurrency(SlotLeases(MemorySlots(), "w", Limits({KEY: 1}), timers))
    seen: list[Mapping[str, int]] = []

    def handler(run: Run) -> Outcome:
        seen.append(run.ctx.slot_tokens)
        return Succeeded()

    # When each runs
    for job_id in ("1", "2"):
        assert isinstance(through(concurrency, _run(job_id), handler), Succeeded)
    # Then each saw its slot's token, the later grant's the larger; a run without slots none
    assert seen == [{KEY: 1}, {KEY: 2}]
    assert _run("3").ctx.slot_tokens == {}
