"""One suite for every idempotency backend: memory, SQLite, and Firestore on its emulator."""

from __future__ import annotations

import contextlib
import multiprocessing
import random
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import FIRESTORE_PROJECT as PROJECT
from tests.fakes import FakeClock
from tests.support import store_handles
from workerpool.idempotency import (
    Claimed,
    Done,
    HeldElsewhere,
    IdempotencyStore,
    MemoryStore,
    SqliteStore,
    StoreError,
    StoreUnavailable,
    open_store,
)
from workerpool.idempotency import sqlite as sqlite_backend
from workerpool.testing.emulator import free_port

TTL = 60.0
RETENTION = 3600.0
JOB = "reports/2024-01-01"  # a "/" must not break backends that use the id as a key
StoreFactory = Callable[[], IdempotencyStore]


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
    """Opens handles on one shared backing store (like several workers would)."""

    def firestore(collection: str) -> IdempotencyStore:
        from workerpool.idempotency.firestore import FirestoreStore

        return FirestoreStore(PROJECT, collection, retention=RETENTION, clock=clock)

    with store_handles(
        request.param, request, monkeypatch,
        memory=lambda: MemoryStore(retention=RETENTION, clock=clock),
        sqlite=lambda: SqliteStore(tmp_path / "idem.db", retention=RETENTION, clock=clock),
        firestore=firestore,
    ) as make:  # fmt: skip
        yield make


@pytest.fixture
def store(make_store: StoreFactory) -> IdempotencyStore:
    return make_store()


def test_claim_is_exclusive_even_for_the_same_owner_or_message(
    store: IdempotencyStore, clock: FakeClock
) -> None:
    held = HeldElsewhere("w1", "m1", clock.now + TTL)
    assert store.claim(JOB, "w1", "m1", TTL) == Claimed()
    assert store.claim(JOB, "w2", "m2", TTL) == held  # publisher duplicate
    assert store.claim(JOB, "w2", "m1", TTL) == held  # redelivery to another worker
    assert store.claim(JOB, "w1", "m1", TTL) == held  # redelivery to the holder itself
    assert store.claim(JOB, "w1", "m2", TTL) == held  # duplicate within the same process
    assert store.claim("other", "w2", "m2", TTL) == Claimed()


def test_only_the_holder_renews_and_renewal_extends(
    store: IdempotencyStore, clock: FakeClock
) -> None:
    store.claim(JOB, "w1", "m1", TTL)
    clock.advance(TTL / 2)
    assert store.renew(JOB, "w1", "m1", TTL)
    assert not store.renew(JOB, "w2", "m2", TTL)
    assert not store.renew(JOB, "w1", "m2", TTL)
    assert not store.renew("unknown", "w1", "m1", TTL)
    clock.advance(TTL * 3 / 4)  # past the first deadline, within the renewed one
    assert store.claim(JOB, "w2", "m2", TTL) == HeldElsewhere("w1", "m1", clock.now + TTL / 4)


def test_renew_after_expiry_succeeds_while_nobody_took_over(
    store: IdempotencyStore, clock: FakeClock
) -> None:
    store.claim(JOB, "w1", "m1", TTL)
    clock.advance(TTL + 1)
    assert store.renew(JOB, "w1", "m1", TTL)
    assert isinstance(store.claim(JOB, "w2", "m2", TTL), HeldElsewhere)


def test_completed_job_is_done_and_no_longer_claimed(
    store: IdempotencyStore, clock: FakeClock
) -> None:
    store.claim(JOB, "w1", "m1", TTL)
    completed_at = clock.now
    store.complete(JOB, "w1", "m1")
    clock.advance(1)
    assert store.claim(JOB, "w2", "m2", TTL) == Done(completed_at)
    assert not store.renew(JOB, "w1", "m1", TTL)
    store.release(JOB, "w1", "m1")  # a completion is not a claim: release leaves it
    assert store.claim(JOB, "w1", "m1", TTL) == Done(completed_at)


def test_run_state_running_while_claimed_ended_once_done_or_failed(
    store: IdempotencyStore, clock: FakeClock
) -> None:
    # (what a periodic schedule's overlap policy asks of its previous tick's job id)
    assert store.run_state(JOB) == "unclaimed"  # published, not claimed yet
    store.claim(JOB, "w1", "m1", TTL)
    assert store.run_state(JOB) == "running"
    clock.advance(TTL + 1)
    assert store.run_state(JOB) == "unclaimed"  # its holder died: delivered again
    store.claim(JOB, "w2", "m2", TTL)
    store.release(JOB, "w2", "m2")  # handed back (a drain): delivered again
    assert store.run_state(JOB) == "unclaimed"
    store.claim(JOB, "w2", "m3", TTL)
    store.release(JOB, "w2", "m3", failed=True)
    assert store.run_state(JOB) == "ended"  # its failure is recorded
    store.claim(JOB, "w3", "m4", TTL)
    assert store.run_state(JOB) == "running"  # a retry of it
    store.complete(JOB, "w3", "m4")
    assert store.run_state(JOB) == "ended"


def test_claims_and_completions_in_one_call_decide_as_one_at_a_time(
    store: IdempotencyStore, clock: FakeClock
) -> None:
    # Given a job id held by another worker and one it completed
    store.claim("held", "w2", "m0", TTL)
    store.claim("done", "w2", "m0", TTL)
    store.complete("done", "w2", "m0")
    before = clock.now
    clock.advance(1)
    # When a pull's job ids are claimed in one call (one of them twice: a publisher duplicate)
    results = store.claim_many(
        [("new", "m1"), ("held", "m2"), ("done", "m3"), ("new", "m4")], "w1", TTL
    )
    # Then each gets what a claim of its own would have
    assert results == [
        Claimed(),
        HeldElsewhere("w2", "m0", before + TTL),
        Done(before),
        HeldElsewhere("w1", "m1", clock.now + TTL),
    ]
    assert store.claim_many([], "w1", TTL) == []
    # And completions in one call are each recorded, a claim taken over or not
    clock.advance(1)
    store.complete_many([("new", "m1"), ("held", "m2")], "w1")
    store.complete_many([], "w1")
    assert store.claim("new", "w3", "m5", TTL) == Done(clock.now)
    assert store.claim("held", "w3", "m5", TTL) == Done(clock.now)
    assert not store.renew("held", "w2", "m0", TTL)


def test_a_pull_of_distinct_job_ids_claimed_in_one_call_gets_what_each_claim_would(
    store: IdempotencyStore, clock: FakeClock
) -> None:
    # Given job ids in every state a claim can meet: completed past its retention, claimed
    # and left to expire after a failed run, completed, held by another, held by us
    store.claim("forgotten", "w2", "m0", TTL)
    store.complete("forgotten", "w2", "m0")
    clock.advance(RETENTION - 2 * TTL)
    store.claim("expired", "w2", "m0", TTL)
    store.release("expired", "w2", "m0", failed=True)
    store.claim("expired", "w2", "m0", TTL)
    store.claim("done", "w2", "m0", TTL)
    store.complete("done", "w2", "m0")
    done_at = clock.now
    clock.advance(2 * TTL + 1)
    store.claim("held", "w2", "m0", TTL)
    store.claim("mine", "w1", "m0", TTL)
    store.claim("again", "w1", "m7", TTL)  # this very message, claimed at this very instant
    # When a pull's distinct job ids are claimed in one call
    results = store.claim_many(
        [("new", "m1"), ("held", "m2"), ("mine", "m3"), ("done", "m4"), ("expired", "m5"),
         ("forgotten", "m6"), ("again", "m7")],
        "w1",
        TTL,
    )  # fmt: skip
    # Then each gets what a claim of its own would have, failures counted with the job id
    assert results == [
        Claimed(0),
        HeldElsewhere("w2", "m0", clock.now + TTL),
        HeldElsewhere("w1", "m0", clock.now + TTL),
        Done(done_at),
        Claimed(1),
        Claimed(0),
        HeldElsewhere("w1", "m7", clock.now + TTL),
    ]
    assert store.renew("expired", "w1", "m5", TTL) and store.renew("new", "w1", "m1", TTL)
    assert not store.renew("held", "w1", "m2", TTL)


def test_release_frees_the_job_at_once_but_only_for_the_holder(store: IdempotencyStore) -> None:
    store.claim(JOB, "w1", "m1", TTL)
    store.release(JOB, "w2", "m2")
    store.release(JOB, "w1", "m2")
    assert isinstance(store.claim(JOB, "w2", "m2", TTL), HeldElsewhere)
    store.release(JOB, "w1", "m1")
    assert store.claim(JOB, "w2", "m2", TTL) == Claimed()
    store.release("unknown", "w1", "m1")


def test_expired_claim_is_taken_over_and_late_completion_still_counts(
    store: IdempotencyStore, clock: FakeClock
) -> None:
    store.claim(JOB, "w1", "m1", TTL)
    clock.advance(TTL + 1)  # w1 looks dead
    assert store.claim(JOB, "w2", "m1", TTL) == Claimed()
    assert not store.renew(JOB, "w1", "m1", TTL)
    store.release(JOB, "w1", "m1")
    assert store.claim(JOB, "w3", "m3", TTL) == HeldElsewhere("w2", "m1", clock.now + TTL)
    # w1 was only slow: its side effect happened, so the job is done and w2 loses its claim.
    first_completion = clock.now
    store.complete(JOB, "w1", "m1")
    assert not store.renew(JOB, "w2", "m1", TTL)
    clock.advance(1)
    store.complete(JOB, "w2", "m1")
    assert store.claim(JOB, "w3", "m3", TTL) == Done(first_completion)


def test_every_claim_granted_on_a_job_id_gets_a_larger_fencing_token(
    store: IdempotencyStore, clock: FakeClock
) -> None:
    # Given a job id claimed and released, claimed again and left to expire, taken over in
    # a pull's batch, released after a failed run, and claimed once more
    claims: list[Any] = [store.claim(JOB, "w1", "m1", TTL)]
    store.release(JOB, "w1", "m1")
    claims.append(store.claim(JOB, "w2", "m1", TTL))
    clock.advance(TTL + 1)
    claims.append(store.claim_many([(JOB, "m2"), ("other", "m3")], "w3", TTL)[0])
    store.release(JOB, "w3", "m2", failed=True)
    claims += store.claim_many([(JOB, "m4"), (JOB, "m5")], "w4", TTL)  # a job id twice
    # Then every grant's token is the one after the last; a claim that finds the job id held
    # says the holder's
    tokens = [claim.token for claim in claims]
    assert [type(claim) for claim in claims] == [Claimed] * 4 + [HeldElsewhere]
    assert tokens == [1, 2, 3, 4, 4]


def test_completion_is_forgotten_after_retention(store: IdempotencyStore, clock: FakeClock) -> None:
    store.claim(JOB, "w1", "m1", TTL)
    store.complete(JOB, "w1", "m1")
    clock.advance(RETENTION - 1)
    assert isinstance(store.claim(JOB, "w2", "m2", TTL), Done)
    clock.advance(2)
    assert store.claim(JOB, "w2", "m2", TTL) == Claimed()


def test_racing_threads_claim_each_job_once(make_store: StoreFactory) -> None:
    threads, job_ids = 8, [f"job-{i}" for i in range(50)]
    stores = [make_store() for _ in range(threads)]  # one handle (client) per worker
    start = threading.Barrier(threads)
    won: list[list[str]] = [[] for _ in range(threads)]
    errors: list[BaseException] = []

    def worker(index: int) -> None:
        order = random.Random(index).sample(job_ids, len(job_ids))
        try:
            start.wait(timeout=30)
            for job_id in order:
                if stores[index].claim(job_id, f"w{index}", f"m{index}", TTL) == Claimed():
                    won[index].append(job_id)
        except BaseException as exc:
            errors.append(exc)

    _run_threads(worker, threads, timeout=60)
    assert not errors
    assert sorted(job_id for ids in won for job_id in ids) == sorted(job_ids)


def _claim_all_in_process(path: str, owner: str, job_ids: list[str], start: Any, out: Any) -> None:
    store = SqliteStore(path)  # opened concurrently on purpose: startup must be race-free too
    start.wait(timeout=30)
    won = []
    for job_id in random.Random(owner).sample(job_ids, len(job_ids)):
        if store.claim(job_id, owner, "m", TTL) == Claimed():
            won.append(job_id)
        # SQLite's busy handler sleeps between retries, so a process claiming in a tight loop
        # keeps the lock and wins everything; real workers pause between jobs, so do we.
        time.sleep(0.001)
    out.put(won)
    store.close()


def test_sqlite_racing_processes_claim_each_job_once(tmp_path: Path) -> None:
    processes, job_ids = 4, [f"job-{i}" for i in range(200)]
    # Processes of their own, forked from one that imported this module once (not spawned:
    # each would import it again, seconds of CPU before it races at all)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    start, out = ctx.Barrier(processes), ctx.Queue()
    path = str(tmp_path / "shared" / "idem.db")
    pool = [
        ctx.Process(target=_claim_all_in_process, args=(path, f"p{i}", job_ids, start, out))
        for i in range(processes)
    ]
    for process in pool:
        process.start()
    won = [out.get(timeout=60) for _ in pool]
    for process in pool:
        process.join(timeout=10)
        assert process.exitcode == 0
    assert sorted(job_id for ids in won for job_id in ids) == sorted(job_ids)
    assert all(won), "every process should win some claims, or they did not race"


def test_sqlite_locked_past_busy_timeout_is_unavailable(tmp_path: Path) -> None:
    path = tmp_path / "idem.db"
    with SqliteStore(path, busy_timeout=0.05) as store:
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN EXCLUSIVE")
        started = time.monotonic()
        with pytest.raises(StoreUnavailable) as caught:
            store.claim(JOB, "w1", "m1", TTL)
        assert time.monotonic() - started < 2
        assert isinstance(caught.value.__cause__, sqlite3.OperationalError)
        blocker.execute("ROLLBACK")
        blocker.close()
        assert store.claim(JOB, "w1", "m1", TTL) == Claimed()  # recovers once the lock is gone


def test_sqlite_many_threads_on_two_stores_keep_the_serial_semantics(
    tmp_path: Path, clock: FakeClock
) -> None:
    # Two stores on one file stand for two worker processes; their threads are pool slots.
    threads, shared = 64, [f"shared-{i}" for i in range(40)]
    stores = [SqliteStore(tmp_path / "idem.db", retention=RETENTION, clock=clock) for _ in "ab"]
    start = threading.Barrier(threads)
    results: dict[str, list[tuple[str, object]]] = {}
    errors: list[BaseException] = []

    def worker(index: int) -> None:
        owner, store = f"w{index}", stores[index % 2]
        own = [f"own-{index}-{i}" for i in range(10)]
        try:
            start.wait(timeout=30)
            for job_id in random.Random(index).sample(own + shared, len(own) + len(shared)):
                result = store.claim(job_id, owner, "m", TTL)
                results.setdefault(job_id, []).append((owner, result))
                if result == Claimed():
                    store.complete(job_id, owner, "m")
        except BaseException as exc:
            errors.append(exc)

    _run_threads(worker, threads, timeout=120)
    for store in stores:
        store.close()
    assert not errors
    assert len(results) == threads * 10 + len(shared)
    for job_id, outcomes in results.items():
        winners = [owner for owner, result in outcomes if result == Claimed()]
        assert len(winners) == 1, job_id
        losers = {result for owner, result in outcomes if result != Claimed()}
        # Every loser saw the winner's claim or its completion, nothing else.
        assert losers <= {HeldElsewhere(winners[0], "m", clock.now + TTL), Done(clock.now)}
    assert sum(len(outcomes) for outcomes in results.values()) == threads * (10 + len(shared))
    with SqliteStore(tmp_path / "idem.db", retention=RETENTION, clock=clock) as reopened:
        assert all(reopened.claim(job_id, "x", "m", TTL) == Done(clock.now) for job_id in results)


def _wait_until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def _as_one_batch(
    store: SqliteStore, calls: list[Callable[[], object]], then: Callable[[], None] = lambda: None
) -> list[object]:
    """Returns each call's result or exception. A leader is held inside an earlier mutation
    until every call is queued (in list order), so the next leader commits them together: one
    transaction. ``then`` runs once all are queued, before the leader is let go."""
    entered, gate = threading.Event(), threading.Event()

    def hold(record: object, now: float) -> tuple[None, None]:
        entered.set()
        gate.wait(timeout=30)
        return None, None

    def held() -> None:
        with contextlib.suppress(StoreUnavailable):  # a test may fail every transaction
            store._mutate("held", hold)

    holder = threading.Thread(target=held)
    holder.start()
    assert entered.wait(timeout=30)
    outcomes: list[object] = [None] * len(calls)

    def run(index: int) -> None:
        try:
            outcomes[index] = calls[index]()
        except Exception as exc:
            outcomes[index] = exc

    pool = []
    for index in range(len(calls)):
        pool.append(threading.Thread(target=run, args=(index,)))
        pool[-1].start()
        _wait_until(lambda: store._queued() == index + 1)  # noqa: B023
    then()
    gate.set()
    for thread in [holder, *pool]:
        thread.join(timeout=30)
    return outcomes


def test_sqlite_batch_runs_in_order_and_a_failing_mutation_fails_only_its_caller(
    tmp_path: Path, clock: FakeClock
) -> None:
    def boom(record: object, now: float) -> tuple[None, None]:
        raise ValueError("boom")

    path = tmp_path / "idem.db"
    with SqliteStore(path, retention=RETENTION, clock=clock) as store:
        outcomes = _as_one_batch(
            store,
            [
                lambda: store.claim(JOB, "w1", "m1", TTL),
                lambda: store._mutate(JOB, boom),
                lambda: store.claim(JOB, "w2", "m2", TTL),  # sees the claim just before it
                lambda: store.complete(JOB, "w1", "m1"),
                lambda: store.claim(JOB, "w3", "m3", TTL),
                lambda: store.claim("other", "w1", "m1", TTL),
                lambda: store.release("other", "w1", "m1"),
            ],
        )
    assert outcomes[0] == Claimed()
    assert isinstance(outcomes[1], ValueError)
    assert outcomes[2] == HeldElsewhere("w1", "m1", clock.now + TTL)
    assert outcomes[3:] == [None, Done(clock.now), Claimed(), None]
    with SqliteStore(path, retention=RETENTION, clock=clock) as reopened:  # it was committed
        assert reopened.claim(JOB, "w4", "m4", TTL) == Done(clock.now)
        assert reopened.claim("other", "w4", "m4", TTL) == Claimed()


def test_sqlite_failed_transaction_keeps_nothing_and_fails_every_caller(
    tmp_path: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing_purge() -> None:  # runs inside the batch's transaction, after its writes
        raise sqlite3.OperationalError("disk I/O error")

    with SqliteStore(tmp_path / "idem.db", retention=RETENTION, clock=clock) as store:
        monkeypatch.setattr(sqlite_backend, "_PURGE_EVERY", 1)
        monkeypatch.setattr(store, "_purge", failing_purge)
        outcomes = _as_one_batch(
            store,
            [
                lambda: store.claim(JOB, "w1", "m1", TTL),
                lambda: store.claim("other", "w1", "m1", TTL),
                lambda: store.complete("third", "w1", "m1"),
            ],
        )
        monkeypatch.undo()
        for outcome in outcomes:
            assert isinstance(outcome, StoreUnavailable)
            assert isinstance(outcome.__cause__, sqlite3.OperationalError)
        assert len({id(outcome) for outcome in outcomes}) == len(outcomes)  # one per caller
        for job_id in [JOB, "other", "third"]:
            assert store.claim(job_id, "w2", "m2", TTL) == Claimed()


def test_sqlite_close_finishes_queued_work_then_refuses_calls(
    tmp_path: Path, clock: FakeClock
) -> None:
    store = SqliteStore(tmp_path / "idem.db", retention=RETENTION, clock=clock)
    closer = threading.Thread(target=store.close)

    def close_while_queued() -> None:
        closer.start()
        _wait_until(lambda: store._closed)
        with pytest.raises(StoreUnavailable, match="closed"):  # at once, not after the queue
            store.claim("late", "w1", "m1", TTL)

    outcomes = _as_one_batch(
        store,
        [lambda: store.claim(JOB, "w1", "m1", TTL), lambda: store.claim(JOB, "w2", "m2", TTL)],
        then=close_while_queued,
    )
    closer.join(timeout=30)
    assert not closer.is_alive() and store._queued() == 0
    assert outcomes == [Claimed(), HeldElsewhere("w1", "m1", clock.now + TTL)]
    with pytest.raises(StoreUnavailable, match="closed"):
        store.renew(JOB, "w1", "m1", TTL)
    store.close()  # idempotent
    with SqliteStore(tmp_path / "idem.db", retention=RETENTION, clock=clock) as reopened:
        assert reopened.claim(JOB, "w3", "m3", TTL) == HeldElsewhere("w1", "m1", clock.now + TTL)
        assert reopened.claim("late", "w3", "m3", TTL) == Claimed()


def test_firestore_unreachable_is_unavailable_within_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from workerpool.idempotency.firestore import FirestoreStore

    monkeypatch.setenv("FIRESTORE_EMULATOR_HOST", f"127.0.0.1:{free_port()}")  # nothing listens
    with FirestoreStore(PROJECT, "idem", timeout=1.0) as store:
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            store.claim(JOB, "w1", "m1", TTL)
        assert time.monotonic() - started < 4


def test_open_store_by_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FIRESTORE_EMULATOR_HOST", "127.0.0.1:1")  # no credentials lookup
    assert open_store("none") is None
    memory = open_store("memory://", retention=5)
    assert isinstance(memory, MemoryStore) and memory.retention == 5
    for url, created in [
        ("sqlite:///rel/dir/idem.db", tmp_path / "rel" / "dir" / "idem.db"),
        (f"sqlite:///{tmp_path}/abs/idem.db", tmp_path / "abs" / "idem.db"),
    ]:
        store = open_store(url)
        assert isinstance(store, SqliteStore)
        store.close()
        assert created.is_file()
    from workerpool.idempotency.firestore import FirestoreStore

    firestore_store = open_store("firestore://my-project/jobs")
    assert isinstance(firestore_store, FirestoreStore)
    firestore_store.close()


def test_an_sqlite_store_written_before_failures_were_counted_opens_and_keeps_its_records(
    tmp_path: Path, clock: FakeClock
) -> None:
    path = tmp_path / "old.db"
    with contextlib.closing(sqlite3.connect(path)) as old:
        old.execute(
            "CREATE TABLE idempotency (job_id TEXT PRIMARY KEY, owner TEXT NOT NULL,"
            " message_id TEXT NOT NULL, until REAL NOT NULL, completed_at REAL,"
            " expire_at REAL NOT NULL)"
        )
        old.execute(
            "INSERT INTO idempotency VALUES ('done-before', 'w', 'm', ?, ?, ?)",
            (clock.now, clock.now, clock.now + RETENTION),
        )
        old.commit()
    with SqliteStore(path, retention=RETENTION, clock=clock) as store:
        assert store.claim("done-before", "w2", "m2", TTL) == Done(clock.now)
        assert store.claim(JOB, "w2", "m2", TTL) == Claimed(0)
        store.release(JOB, "w2", "m2", failed=True)
        assert store.claim(JOB, "w2", "m3", TTL) == Claimed(1)


def test_failed_runs_are_counted_with_the_job_id_and_nothing_else_is(
    store: IdempotencyStore, clock: FakeClock
) -> None:
    # Given a job id whose run failed twice, and was interrupted once (not a failure)
    assert store.claim(JOB, "w1", "m1", TTL) == Claimed(0)
    store.release(JOB, "w1", "m1", failed=True)
    assert store.claim(JOB, "w2", "m1", TTL) == Claimed(1)
    store.release(JOB, "w2", "m1", failed=True)
    assert store.claim(JOB, "w1", "m2", TTL) == Claimed(2)
    store.release(JOB, "w1", "m2")
    # Then the next claim hears of 2 failures, and a late renewal of a released claim fails
    assert store.renew(JOB, "w1", "m2", TTL) is False
    assert store.claim(JOB, "w3", "m3", TTL) == Claimed(2)
    # And once completed and expired, a new run of the job id starts from none
    store.complete(JOB, "w3", "m3")
    clock.advance(RETENTION + 1)
    assert store.claim(JOB, "w1", "m4", TTL) == Claimed(0)


@pytest.mark.parametrize(
    "url",
    [
        "",
        "None",
        "memory",
        "sqlite://",
        "sqlite:///",
        "sqlite://relative.db",
        "postgres://host/db",
        "firestore://project",
        "firestore://project/",
        "firestore:///jobs",
        "firestore://project/jobs/extra",
    ],
)
def test_open_store_rejects_unknown_urls(url: str) -> None:
    with pytest.raises(ValueError, match="unsupported store URL") as caught:
        open_store(url)
    assert repr(url) in str(caught.value) and "\n" not in str(caught.value)


def _run_threads(target: Callable[[int], None], count: int, timeout: float) -> None:
    """``target(0)`` ... ``target(count - 1)`` at once, each in a thread of its own."""
    pool = [threading.Thread(target=target, args=(i,)) for i in range(count)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(timeout=timeout)


def test_an_sqlite_too_old_for_the_store_is_named_when_it_opens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite3, "sqlite_version_info", (3, 31, 1))
    monkeypatch.setattr(sqlite3, "sqlite_version", "3.31.1")
    with pytest.raises(StoreError, match=r"needs SQLite 3\.35\.4 or newer; .* has 3\.31\.1"):
        SqliteStore(tmp_path / "idem.db")
    assert not (tmp_path / "idem.db").exists()


def test_failed_runs_are_counted_by_the_minute_and_a_day_of_them_kept(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    # Given two handles on one store (two workers), and a clock on a whole minute
    first, second = make_store(), make_store()
    clock.now = 1_700_000_040.0
    minute = int(clock.now // 60)
    # When runs fail on both, in two minutes
    first.count_failed()
    second.count_failed()
    clock.advance(60)
    second.count_failed(2)
    # Then each minute counts its failed runs, from both
    assert first.failed_per_minute(minute * 60) == {minute: 2, minute + 1: 2}
    assert second.failed_per_minute((minute + 1) * 60) == {minute + 1: 2}
    # and a day on, the old minutes are forgotten as new ones are counted
    clock.advance(24 * 3600)
    first.count_failed()
    assert first.failed_per_minute(0) == {minute + 1 + 24 * 60: 1}


class _HeldConnection:
    """An SQLite connection whose statements on ``table`` wait for ``gate`` (the rest pass)."""

    def __init__(self, conn: sqlite3.Connection, table: str) -> None:
        self._conn, self._table = conn, table
        self.entered, self.gate = threading.Event(), threading.Event()

    def execute(self, sql: str, *args: Any) -> Any:
        if self._table in sql:
            self.entered.set()
            self.gate.wait(timeout=30)
        return self._conn.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def test_sqlite_claims_queued_while_a_failed_run_is_counted_are_committed(
    tmp_path: Path, clock: FakeClock
) -> None:
    # Given a failed run being counted, its statement held, while two slots' claims queue
    # behind it
    with SqliteStore(tmp_path / "idem.db", retention=RETENTION, clock=clock) as store:
        held = _HeldConnection(store._conn, "failed_per_minute")
        store._conn = held  # type: ignore[assignment]
        counting = threading.Thread(target=store.count_failed)
        counting.start()
        assert held.entered.wait(timeout=30)
        claimed: list[object] = []
        claiming = [
            threading.Thread(target=lambda j=job_id: claimed.append(store.claim(j, "w", "m", TTL)))
            for job_id in "ab"
        ]
        for thread in claiming:
            thread.start()
        _wait_until(lambda: store._queued() == 2)
        # When the count is written
        held.gate.set()
        counting.join(timeout=30)
        for thread in claiming:
            thread.join(timeout=10)
        # Then the claims queued meanwhile are committed too: before, nobody led them and the
        # worker's claims and completions stalled for good
        assert not any(thread.is_alive() for thread in claiming)
        assert [type(c) for c in claimed] == [Claimed, Claimed]
        store._conn = held._conn


def test_sqlite_a_pull_waits_for_the_batch_being_committed_then_goes_after_what_queued(
    tmp_path: Path, clock: FakeClock
) -> None:
    # Given a batch being committed (its leader held inside it) with a slot's claim of "a"
    # queued behind it
    with SqliteStore(tmp_path / "idem.db", retention=RETENTION, clock=clock) as store:
        pulled: list[object] = []

        def pull() -> None:
            pulled.extend(store.claim_many([("a", "m-2"), ("b", "m-2")], "w2", TTL))

        puller = threading.Thread(target=pull)
        # When a pull claims "a" and "b" meanwhile
        outcomes = _as_one_batch(
            store, [lambda: store.claim("a", "w1", "m-1", TTL)], then=puller.start
        )
        puller.join(timeout=30)
        # Then the pull neither joins the batches nor goes first: the claim queued before it
        # wins "a", and the pull's own statement claims "b"
        assert outcomes == [Claimed()]
        assert not puller.is_alive()
        assert pulled == [HeldElsewhere("w1", "m-1", clock.now + TTL), Claimed()]
        assert store._queued() == 0


def test_sqlite_a_pull_of_more_job_ids_than_a_statement_binds_is_claimed_and_completed_whole(
    tmp_path: Path, clock: FakeClock
) -> None:
    # Given an SQLite that binds 14 parameters a statement (3 claims, 4 completions)
    with SqliteStore(tmp_path / "idem.db", retention=RETENTION, clock=clock) as store:
        store._conn.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 14)
        store._variables = 14
        job_ids = [f"j-{i}" for i in range(10)]
        store.claim("j-4", "w2", "m-0", TTL)
        # When a pull of 10 is claimed, and the 9 it won completed
        claimed = store.claim_many([(j, "m") for j in job_ids], "w1", TTL)
        store.complete_many([(j, "m") for j in job_ids if j != "j-4"], "w1")
        # Then each got what a claim of its own would have, and each completion is recorded
        assert claimed == [HeldElsewhere("w2", "m-0", clock.now + TTL) if j == "j-4"
                           else Claimed() for j in job_ids]  # fmt: skip
        clock.advance(1)
        assert [store.claim(j, "w3", "m", TTL) for j in job_ids] == [
            HeldElsewhere("w2", "m-0", clock.now - 1 + TTL) if j == "j-4" else Done(clock.now - 1)
            for j in job_ids
        ]


@pytest.mark.parametrize(
    "claims", [[("a", "m-a")], [("a", "m-a"), ("b", "m-b")]], ids=["one", "a_pull"]
)
def test_sqlite_a_claim_lost_to_a_record_swept_before_it_is_read_is_claimed_after_all(
    tmp_path: Path, clock: FakeClock, claims: list[tuple[str, str]]
) -> None:
    # Given job id "a" held elsewhere, and a claim of it whose lost record is gone (deleted
    # here, as the expiry sweep deletes a record past its time) between the claim's statement
    # and the read of who holds it: a lone caller's claims run in autocommit, not in one
    # transaction
    path = tmp_path / "idem.db"
    with SqliteStore(path, retention=RETENTION, clock=clock) as store:
        assert store.claim("a", "elsewhere", "m-0", TTL) == Claimed()
        read = store._records

        def swept_then_read(job_ids: list[str]) -> dict[str, Any]:
            with contextlib.closing(sqlite3.connect(path)) as sweeper, sweeper:
                sweeper.execute("DELETE FROM idempotency WHERE job_id = 'a'")
            return read(job_ids)

        store._records = swept_then_read  # type: ignore[method-assign]
        # When the claims are made, Then each is won: the swept record is claimed after all
        # (not a KeyError, nor "held" by a record that is gone)
        assert store.claim_many(claims, "w", TTL) == [Claimed()] * len(claims)
        store._records = read  # type: ignore[method-assign]
        assert isinstance(store.claim("a", "w2", "m-9", TTL), HeldElsewhere)
