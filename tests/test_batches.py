"""Batches, the pure parts: the ledger and the one finalization, on memory, SQLite and
Firestore on its emulator (the same suite), and handing the completion to the schedule."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import FIRESTORE_PROJECT
from tests.fakes import FakeClock
from tests.support import store_handles, wait_for
from workerpool import JobContext, PermanentError
from workerpool import constants as c
from workerpool.batches import BatchStore, Completion, MemoryBatches, SqliteBatches, batch_opener
from workerpool.batches import firestore as firestore_batches
from workerpool.batches import sqlite as batches_sqlite
from workerpool.batches import store as batch_store
from workerpool.batches.firestore import FirestoreBatches
from workerpool.batches.middleware import Batches
from workerpool.batches.store import DEADLINE, LAST_CHILD, children_digest, deliver
from workerpool.idempotency import Claimed, HeldElsewhere, MemoryStore
from workerpool.idempotency.middleware import Idempotency
from workerpool.registry import Registry
from workerpool.schedule import Entry, MemorySchedule
from workerpool.schedule.delays import Firer
from workerpool.stores import StoreUnavailable
from workerpool.testing.emulator import LocalEmulator, free_port
from workerpool.testing.fakes import FakeAcks, FakeDeadLetters, FakeLeaser, make_delivery
from workerpool.worker.backoff import Backoff
from workerpool.worker.delivery import Delivery
from workerpool.worker.failures import Failure
from workerpool.worker.processor import Processor, ProcessorSettings
from workerpool.worker.timers import Timers

TOPIC = "projects/p/topics/t"
DAY = 86400.0
StoreFactory = Callable[[], BatchStore]


@pytest.fixture(params=["memory", "sqlite", "firestore"])
def make_store(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[StoreFactory]:
    """Handles on one backing store (a connection or client each, as processes have)."""

    def firestore(collection: str) -> BatchStore:
        from workerpool.batches.firestore import FirestoreBatches

        return FirestoreBatches(FIRESTORE_PROJECT, collection)

    with store_handles(
        request.param, request, monkeypatch,
        memory=MemoryBatches,
        sqlite=lambda: SqliteBatches(tmp_path / "b.db"),
        firestore=firestore,
    ) as make:  # fmt: skip
        yield make


def _create(store: BatchStore, children: int, batch_id: str = "b1") -> list[str]:
    job_ids = [f"child-{i}" for i in range(children)]
    store.create(batch_id, TOPIC, "reports.done", job_ids, deadline=2_000_000_000.0)
    return job_ids


def _committed(store: BatchStore, children: int) -> list[str]:
    """A batch b1 of ``children``, every one published."""
    job_ids = _create(store, children)
    store.commit("b1")
    return job_ids


def test_children_that_finish_before_the_commit_never_complete_the_batch(
    make_store: StoreFactory,
) -> None:
    store = make_store()
    job_ids = _create(store, 3)
    assert [store.record("b1", j, True) for j in job_ids] == [None, None, None]
    batch = store.get("b1")
    assert batch is not None and (batch.done, batch.pending, batch.committed) == (3, 0, False)
    # The commit, once every child is published, finds nothing pending: it completes it
    completion = store.commit("b1")
    assert completion is not None and completion.batch.finalized_by == LAST_CHILD
    # A commit again gets it again until it is handed over (its publisher may have died
    # before it could be), and then nothing
    again = store.commit("b1")
    assert again is not None and again.payload() == completion.payload()
    store.sent("b1")
    assert store.commit("b1") is None


def test_the_last_final_outcome_completes_the_batch_once_whatever_the_deliveries(
    make_store: StoreFactory,
) -> None:
    # Given a committed batch of 200 children, and 8 handles recording every outcome, some
    # twice (duplicates, redeliveries), 10 children dead-lettered, each handing over any
    # completion it gets, as a worker does
    job_ids = _create(make_store(), 200)
    make_store().commit("b1")
    handles = [make_store() for _ in range(8)]
    schedule = MemorySchedule()
    completions: list[Completion] = []
    lock = threading.Lock()

    def record(handle: BatchStore, ids: list[str]) -> None:
        for job_id in ids:
            got = handle.record("b1", job_id, succeeded=not job_id.endswith("7"))
            if got is not None:
                deliver(got, handle, schedule)
                with lock:
                    completions.append(got)

    threads = [
        threading.Thread(target=record, args=(h, job_ids[i::4] + job_ids[i::7]))
        for i, h in enumerate(handles)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # Then its counts were frozen once, with every child counted once: a duplicate that came
    # before the completion was handed over got the very same one, and the schedule holds it
    # once
    completion = completions[0]
    assert all(got == completion for got in completions)
    assert [e.job_id for e in schedule.entries()] == [completion.job_id]
    payload = completion.payload()
    failed = sorted(j for j in job_ids if j.endswith("7"))
    assert payload == {
        "batch_id": "b1", "total": 200, "succeeded": 180, "failed": 20, "cancelled": 0,
        "failed_job_ids": failed, "pending_job_ids": [], "cancelled_job_ids": [],
        "finalized_by": LAST_CHILD,
    }  # fmt: skip
    assert completion.job_id == "batch:b1:complete"
    # ... and nothing reopens it
    assert make_store().record("b1", "child-7", True) is None
    assert make_store().expire("b1") is None


def test_a_child_this_store_does_not_have_is_not_counted_and_says_so(
    make_store: StoreFactory, caplog: pytest.LogCaptureFixture
) -> None:
    # Given batch b1 of two children, committed
    store = make_store()
    _committed(store, 2)
    # When an outcome comes for a batch this store has not, and for a job b1 does not have
    with caplog.at_level("WARNING", logger="workerpool.batches.store"):
        assert store.record("b-elsewhere", "child-0", True) is None
        assert store.record("b1", "stranger", True) is None
    # Then neither counts, and each says so in one line (its batch would wait for its deadline)
    batch = store.get("b1")
    assert batch is not None and (batch.done, batch.pending) == (0, 2)
    said = [r.getMessage() for r in caplog.records if r.name == "workerpool.batches.store"]
    assert said == [
        "batch b-elsewhere has no child child-0 in this store: its outcome is not counted",
        "batch b1 has no child stranger in this store: its outcome is not counted",
    ]


def test_a_replayed_child_turns_done_while_its_batch_is_open(make_store: StoreFactory) -> None:
    store = make_store()
    _committed(store, 2)
    assert store.record("b1", "child-0", False) is None  # dead-lettered
    assert store.record("b1", "child-0", False) is None  # its record, twice
    assert store.record("b1", "child-0", True) is None  # replayed from the dead-letter topic
    assert store.record("b1", "child-0", False) is None  # a done child stays done
    assert store.record("b1", "not-a-child", True) is None
    completion = store.record("b1", "child-1", True)
    assert completion is not None and completion.payload()["succeeded"] == 2


def test_cancelled_children_finalize_the_batch_and_are_counted_apart(
    make_store: StoreFactory,
) -> None:
    # Given a committed batch of 4: one done, one dead-lettered, two pending
    store = make_store()
    _committed(store, 4)
    store.record("b1", "child-0", True)
    store.record("b1", "child-1", False)
    assert store.pending("b1", 10) == ["child-2", "child-3"]
    # When the two pending ones are cancelled (one of them twice: a redelivery)
    assert store.record("b1", "child-2", False, cancelled=True) is None
    assert store.record("b1", "child-2", False, cancelled=True) is None
    completion = store.record("b1", "child-3", False, cancelled=True)
    # Then the last one finalizes it, with the cancelled counted apart from the failed
    assert completion is not None
    payload = completion.payload()
    assert (payload["succeeded"], payload["failed"], payload["cancelled"]) == (1, 1, 2)
    assert payload["failed_job_ids"] == ["child-1"]
    assert sorted(payload["cancelled_job_ids"]) == ["child-2", "child-3"]


def test_cancelled_children_are_counted_by_the_store_and_listed_never_all_read(
    make_store: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a completion that lists 2 job ids of a kind at most, and the store's listings
    # of children watched
    monkeypatch.setattr(batch_store, "MAX_FAILED_IDS", 2)
    store = make_store()
    asked: list[tuple[str, int]] = []
    atomic = store._atomic

    class Listings:
        def __init__(self, tx: Any) -> None:
            self._tx = tx

        def __getattr__(self, name: str) -> Any:
            return getattr(self._tx, name)

        def children(self, batch_id: str, outcome: str, limit: int) -> list[str]:
            asked.append((outcome, limit))
            found: list[str] = self._tx.children(batch_id, outcome, limit)
            return found

    monkeypatch.setattr(store, "_atomic", lambda body: atomic(lambda tx: body(Listings(tx))))
    # And a committed batch of 7: one done, five cancelled (one of them replayed to done
    # after), and one cancelled last
    _committed(store, 7)
    store.record("b1", "child-0", True)
    for i in range(1, 6):
        assert store.record("b1", f"child-{i}", False, cancelled=True) is None
    assert store.record("b1", "child-5", True) is None
    # When the last child is cancelled
    completion = store.record("b1", "child-6", False, cancelled=True)
    # Then the completion counts the 5 cancelled from the tallies and lists 2 of them, and
    # no listing asked for more than 2 children
    assert completion is not None
    payload = completion.payload()
    assert (payload["succeeded"], payload["failed"], payload["cancelled"]) == (2, 0, 5)
    assert len(payload["cancelled_job_ids"]) == 2
    assert set(payload["cancelled_job_ids"]) <= {f"child-{i}" for i in (1, 2, 3, 4, 6)}
    assert asked and max(limit for _, limit in asked) <= 2, asked


def test_the_deadline_finalizes_what_is_still_open_and_names_the_pending(
    make_store: StoreFactory,
) -> None:
    store = make_store()
    _create(store, 3)  # never committed: its publisher died mid-way
    store.record("b1", "child-0", True)
    store.record("b1", "child-1", False)
    completion = store.expire("b1")
    assert completion is not None
    assert completion.payload() == {
        "batch_id": "b1", "total": 3, "succeeded": 1, "failed": 2, "cancelled": 0,
        "failed_job_ids": ["child-1", "child-2"], "pending_job_ids": ["child-2"],
        "cancelled_job_ids": [], "finalized_by": DEADLINE,
    }  # fmt: skip
    store.sent("b1")  # handed over
    # A child finishing afterwards fires no second completion
    assert store.record("b1", "child-2", True) is None
    assert store.expire("b1") is None and store.commit("b1") is None


def test_a_batch_is_created_once(make_store: StoreFactory) -> None:
    store = make_store()
    _create(store, 3)
    _create(make_store(), 3)  # its publisher trying again: the same batch
    with pytest.raises(ValueError, match="exists already"):
        _create(store, 4)
    with pytest.raises(KeyError):
        store.commit("no-such-batch")
    assert [b.batch_id for b in store.batches()] == ["b1"]


def test_two_lists_of_children_never_pass_for_one_however_their_ids_are_spelt() -> None:
    # Ids may hold any character: a newline must not make ["a\nb", "c"] the same as
    # ["a", "b\nc"]
    assert children_digest(["a\nb", "c"]) != children_digest(["a", "b\nc"])
    assert children_digest(["a", "b"]) == children_digest(["a", "b"])


def test_a_batch_id_is_one_set_of_children_open_or_final(make_store: StoreFactory) -> None:
    # Given batch b1 of mon-1..3, open
    store, deadline = make_store(), 2_000_000_000.0
    monday = ["mon-1", "mon-2", "mon-3"]
    store.create("b1", TOPIC, "reports.done", monday, deadline)
    # When another set of as many children is created under its id: refused, open or final
    tuesday = ["tue-1", "tue-2", "tue-3"]
    with pytest.raises(ValueError, match=r"batch b1 exists already \(open\) with other children"):
        make_store().create("b1", TOPIC, "reports.done", tuesday, deadline)
    with pytest.raises(ValueError, match="exists already"):  # one child swapped
        store.create("b1", TOPIC, "reports.done", ["mon-1", "mon-2", "tue-3"], deadline)
    store.commit("b1")
    for job_id in monday:
        store.record("b1", job_id, True)
    with pytest.raises(ValueError, match=r"exists already \(final\)"):
        make_store().create("b1", TOPIC, "reports.done", tuesday, deadline)
    # Then the same children again (in any order) are the same batch, and change nothing
    make_store().create("b1", TOPIC, "reports.done", list(reversed(monday)), deadline)
    batch = store.get("b1")
    assert batch is not None and (batch.total, batch.done, batch.finalized_by) == (3, 3, LAST_CHILD)
    assert store.record("b1", "tue-1", True) is None


def test_children_left_by_a_creation_that_failed_part_way_never_pass_for_the_batch(
    firestore_emulator: LocalEmulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given Firestore, which writes a batch's children apart from its record, and a publisher
    # whose creation of b1 wrote its children's ledger and then failed
    monkeypatch.setenv(firestore_emulator.env_var, firestore_emulator.host)
    collection = f"test-{uuid.uuid4().hex[:12]}"
    first, second = (FirestoreBatches(FIRESTORE_PROJECT, collection) for _ in range(2))
    written = firestore_batches._Docs.add_children

    def fails_after_writing(self: Any, batch: Any, job_ids: Sequence[str]) -> None:
        written(self, batch, job_ids)
        raise StoreUnavailable("the commit timed out")

    mine, theirs = ["a1", "a2", "a3", "a4"], ["b20", "b21", "b24", "b6"]
    try:
        with monkeypatch.context() as patched:
            patched.setattr(firestore_batches._Docs, "add_children", fails_after_writing)
            with pytest.raises(StoreUnavailable):
                first.create("b1", TOPIC, "reports.done", mine, 9e9)
        # ... and another publisher creating b1 with as many other children
        second.create("b1", TOPIC, "reports.done", theirs, 9e9)
        second.commit("b1")
        # When the first tries again, Then it is refused: its children found in the ledger do
        # not make it the same batch (counted, they would complete b1 before its own ran)
        with pytest.raises(ValueError, match=r"batch b1 exists already \(open\)"):
            first.create("b1", TOPIC, "reports.done", mine, 9e9)
        # And the same batch again is still accepted
        second.create("b1", TOPIC, "reports.done", list(reversed(theirs)), 9e9)
    finally:
        first.close()
        second.close()


def test_a_completion_never_handed_over_is_handed_over_by_whoever_touches_the_batch_next(
    make_store: StoreFactory,
) -> None:
    # Given batch b1 finalized by its last child, whose worker died before handing the
    # completion over (to the schedule), and batch b2 open
    store, schedule = make_store(), MemorySchedule()
    job_ids = _create(store, 2)
    _create(store, 1, batch_id="b2")
    store.commit("b1")
    store.record("b1", job_ids[0], True)
    finalized = store.record("b1", job_ids[1], True)
    assert finalized is not None
    # When a worker starts, the last child is redelivered, the deadline comes, or the
    # publisher commits again: each gets it
    [swept] = make_store().unsent()
    redelivered = make_store().record("b1", job_ids[1], True)
    other_child = make_store().record("b1", job_ids[0], True)
    expired = make_store().expire("b1")
    committed_again = make_store().commit("b1")  # its publisher trying again
    for got in (swept, redelivered, other_child, expired, committed_again):
        assert got is not None and got.job_id == "batch:b1:complete"
        assert got.payload() == finalized.payload()
    # Then once it is handed over, nobody gets it again, and the schedule holds it once
    deliver(swept, make_store(), schedule)
    deliver(redelivered, make_store(), schedule)
    assert [e.job_id for e in schedule.entries()] == ["batch:b1:complete"]
    assert make_store().unsent() == []
    assert make_store().record("b1", job_ids[1], True) is None
    assert make_store().expire("b1") is None


def test_a_batch_of_more_children_than_one_commit_takes(make_store: StoreFactory) -> None:
    # Given a batch of 1,201 children (Firestore writes 500 documents at most per commit)
    store = make_store()
    _create(store, 1201)
    # When one child is done and one failed, and its deadline comes
    store.record("b1", "child-1", False)
    store.record("b1", "child-0", True)
    batch = store.get("b1")
    assert batch is not None and (batch.total, batch.done, batch.failed) == (1201, 1, 1)
    completion = store.expire("b1")
    # Then every child was counted, and the completion lists at most 1,000 of them
    assert completion is not None
    payload = completion.payload()
    assert (payload["succeeded"], payload["failed"]) == (1, 1200)
    failed, pending = payload["failed_job_ids"], payload["pending_job_ids"]
    assert isinstance(failed, list) and isinstance(pending, list)
    assert failed[0] == "child-1" and len(failed) == len(pending) == 1000


def test_firestore_unreachable_is_unavailable_within_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FIRESTORE_EMULATOR_HOST", f"127.0.0.1:{free_port()}")  # nothing listens
    store = FirestoreBatches(FIRESTORE_PROJECT, "batches", timeout=0.5)
    started = time.monotonic()
    with pytest.raises(StoreUnavailable):
        store.record("b1", "child-0", True)
    assert time.monotonic() - started < 4
    store.close()


def test_firestore_batches_sit_beside_the_idempotency_collection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FIRESTORE_EMULATOR_HOST", "127.0.0.1:1")  # no credentials lookup
    opener = batch_opener("firestore://my-project/jobs")
    assert opener is not None
    store = opener()
    assert isinstance(store, FirestoreBatches) and store._collection.id == "jobs-batches"
    store.close()
    assert batch_opener("none") is None


def _finished(store: BatchStore, batch_id: str, deadline: float, *, sent: bool = True) -> None:
    """A batch of two children, both done: final, and its completion handed over if ``sent``."""
    store.create(batch_id, TOPIC, "reports.done", ["a", "b"], deadline)
    store.commit(batch_id)
    store.record(batch_id, "a", True)
    assert store.record(batch_id, "b", True) is not None
    if sent:
        store.sent(batch_id)


def _old_batches(path: Path, clock: FakeClock) -> None:
    """Twelve batches whose deadline passed over a week ago and whose completions were handed
    over, one whose completion was not, and one six days past its deadline."""
    deadline = clock()
    first = SqliteBatches(path, clock=clock)
    for i in range(12):
        _finished(first, f"old-{i}", deadline)
    _finished(first, "unsent", deadline, sent=False)
    _finished(first, "recent", deadline + DAY)
    first.close()
    clock.advance(batch_store.KEPT_AFTER_DEADLINE + 1)


def _kept(path: Path) -> list[str]:
    """The batches the file still has (no ledger outlives its record)."""
    with sqlite3.connect(path) as conn:
        batches = {row[0] for row in conn.execute("SELECT batch_id FROM batches")}
        children = {row[0] for row in conn.execute("SELECT batch_id FROM batch_children")}
    assert children <= batches
    return sorted(batches)


def test_sqlite_deletes_a_batch_kept_a_week_past_its_deadline_once_handed_over(
    tmp_path: Path,
) -> None:
    # Given old batches, and a store opened on them (opening deletes nothing: the dashboard
    # and the CLI open it for each read)
    path, clock = tmp_path / "b.db", FakeClock(1_800_000_000.0)
    _old_batches(path, clock)
    store = SqliteBatches(path, clock=clock)
    assert len(_kept(path)) == 14
    # When a worker starts (its middleware purges, then hands over the unsent completion),
    # Then ten of the old ones are deleted, never the unsent one nor the recent one
    schedule = MemorySchedule()
    Batches(store, schedule, Firer(schedule, TOPIC, publisher=None)).start()
    assert len(_kept(path)) == 4 and {"unsent", "recent"} <= set(_kept(path))
    # ... and a thousand calls later the other two, and the one handed over meanwhile
    for _ in range(1000):
        store.get("recent")
    assert _kept(path) == ["recent"]
    store.close()


def test_a_sqlite_purge_deletes_a_few_ledger_rows_at_a_time_and_one_that_fails_fails_no_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Given old batches of two children each, and purges of three ledger rows at most
    path, clock = tmp_path / "b.db", FakeClock(1_800_000_000.0)
    _old_batches(path, clock)
    monkeypatch.setattr(batches_sqlite, "_PURGED_ROWS", 3)
    store = SqliteBatches(path, clock=clock)
    # When it purges, Then one batch goes whole and the next loses a child, keeping its record
    store.purge()
    with sqlite3.connect(path) as conn:
        left = dict(conn.execute("SELECT batch_id, COUNT(*) FROM batch_children GROUP BY 1"))
    assert len(_kept(path)) == 13 and sorted(left.values()).count(1) == 1
    # When the file refuses the purge (a full disk, say) at the thousandth call
    written = batches_sqlite._purge

    def full(conn: sqlite3.Connection, now: float) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(batches_sqlite, "_purge", full)
    calls = [store.get("recent") for _ in range(1001)]
    # Then that call and the ones after it answer, and the purge says why it did not happen
    assert all(batch is not None for batch in calls)
    assert "old batches not purged" in caplog.text and "disk is full" in caplog.text
    # ... and once the file takes writes again, a thousand calls later, the purge goes on
    monkeypatch.setattr(batches_sqlite, "_purge", written)
    for _ in range(1000):
        store.get("recent")
    assert len(_kept(path)) == 12
    store.close()


def test_a_child_final_as_failed_or_cancelled_turns_done_but_never_into_the_other(
    make_store: StoreFactory,
) -> None:
    # Given a committed batch of 4: one dead-lettered, one cancelled
    store = make_store()
    _committed(store, 4)
    store.record("b1", "child-0", False)
    store.record("b1", "child-1", False, cancelled=True)
    # When the dead-lettered one is then cancelled, and the cancelled one dead-lettered
    assert store.record("b1", "child-0", False, cancelled=True) is None
    assert store.record("b1", "child-1", False) is None
    # Then each keeps the outcome it had (a move between them leaves the counts as they
    # were: a completion made meanwhile would count it either way)
    store.record("b1", "child-2", True)
    completion = store.record("b1", "child-3", True)
    assert completion is not None
    payload = completion.payload()
    assert (payload["failed"], payload["cancelled"]) == (1, 1)
    assert (payload["failed_job_ids"], payload["cancelled_job_ids"]) == (["child-0"], ["child-1"])
    # ... and one replayed to success would have turned done (see the replay test above)


def test_a_firestore_batch_id_gone_to_its_ttl_policy_is_created_again(
    firestore_emulator: LocalEmulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a batch finalized, whose record and children a TTL policy deleted (its tallies,
    # which carry no expire_at, left behind)
    monkeypatch.setenv(firestore_emulator.env_var, firestore_emulator.host)
    store = FirestoreBatches(FIRESTORE_PROJECT, f"test-{uuid.uuid4().hex[:12]}", timeout=5.0)
    _committed(store, 4)
    assert store.expire("b1") is not None
    record = store._collection.document(firestore_batches._key("b1"))
    for child in record.collection("children").stream():
        child.reference.delete()
    record.delete()
    assert list(record.collection("tallies").stream())
    # When a batch of that id is created again, with other children, Then it is, and it
    # completes from its own children's outcomes
    store.create("b1", TOPIC, "reports.done", ["x-1", "x-2"], deadline=2_000_000_000.0)
    store.commit("b1")
    store.record("b1", "x-1", True)
    completion = store.record("b1", "x-2", False)
    assert completion is not None
    assert (completion.payload()["succeeded"], completion.payload()["failed"]) == (1, 1)
    store.close()


def test_a_firestore_batchs_record_and_children_carry_when_a_ttl_policy_may_delete_them(
    firestore_emulator: LocalEmulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a batch of 40 children (in several tallies) with a deadline
    monkeypatch.setenv(firestore_emulator.env_var, firestore_emulator.host)
    store = FirestoreBatches(FIRESTORE_PROJECT, f"test-{uuid.uuid4().hex[:12]}")
    job_ids, deadline = _create(store, 40), 2_000_000_000.0
    # When it is committed, a child is recorded and the deadline finalizes it
    store.commit("b1")
    store.record("b1", job_ids[0], True)
    assert store.expire("b1") is not None
    # Then its record and every child (the one recorded too) say when: a week past its
    # deadline; its tallies do not (a worker of an earlier release would fail to read them)
    record = store._collection.document(firestore_batches._key("b1"))
    documents = [record.get(), *record.collection("children").stream()]
    assert len(documents) == 1 + 40
    expected = datetime.fromtimestamp(deadline + batch_store.KEPT_AFTER_DEADLINE, tz=UTC)
    assert {document.get("expire_at") for document in documents} == {expected}
    tallies = [document.to_dict() for document in record.collection("tallies").stream()]
    assert tallies and all(set(tally) == {"total", "done", "failed", "final"} for tally in tallies)
    store.close()


def test_a_completion_goes_to_the_schedule_due_now_as_its_own_job() -> None:
    store, schedule = MemoryBatches(), MemorySchedule()
    _committed(store, 1)
    due = deliver(store.record("b1", "child-0", True), store, schedule, clock=lambda: 100.0)
    assert due == 100.0
    [entry] = schedule.entries()
    assert (entry.topic, entry.job_id, entry.due) == (TOPIC, "batch:b1:complete", 100.0)
    assert entry.attributes == {c.ATTR_JOB: "reports.done", c.ATTR_JOB_ID: "batch:b1:complete"}
    assert json.loads(entry.data)["finalized_by"] == LAST_CHILD
    batch = store.get("b1")
    assert batch is not None and batch.completion_sent
    assert deliver(None, store, schedule) is None


def test_a_store_file_from_before_batches_kept_their_trace_opens_and_keeps_it(
    tmp_path: Path,
) -> None:
    # Given a store file whose batches table predates the trace column, in use by an older
    # worker (one batch in it)
    path = tmp_path / "old.db"
    old = sqlite3.connect(path)
    old.execute(
        "CREATE TABLE batches (batch_id TEXT PRIMARY KEY, topic TEXT NOT NULL, on_complete TEXT "
        "NOT NULL, total INTEGER NOT NULL, deadline REAL NOT NULL, committed INTEGER NOT NULL, "
        "done INTEGER NOT NULL, failed INTEGER NOT NULL, finalized_by TEXT NOT NULL, "
        "completion_sent INTEGER NOT NULL)"
    )
    old.execute("INSERT INTO batches VALUES ('old', 't', 'j.done', 1, 9e9, 1, 0, 0, '', 0)")
    old.commit()
    old.close()
    # When two workers open it at once, and a batch is created with its publisher's trace
    first, second = SqliteBatches(path), SqliteBatches(path)
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    first.create("new", "t", "j.done", ["a"], 9e9, trace=traceparent)
    # Then both read both: the old one without a trace, the new one with it
    old_batch, new_batch = second.get("old"), second.get("new")
    assert old_batch is not None and (old_batch.trace, old_batch.children_digest) == ("", "")
    assert new_batch is not None and new_batch.trace == traceparent
    # ... and the old one, kept without the digest of its children, still refuses others
    with pytest.raises(ValueError, match="exists already"):
        first.create("old", "t", "j.done", ["not-its-child"], 9e9)
    first.close()
    second.close()


class _AcksSeeingTheLedger(FakeAcks):
    """Acks that note, as each is sent, which children of b1 the ledger still has pending."""

    def __init__(self, store: BatchStore) -> None:
        super().__init__()
        self.pending_at_ack: list[list[str]] = []
        self._store = store

    def ack(self, ack_id: str, *, confirm: bool = False) -> Future[bool] | None:
        self.pending_at_ack.append(self._store.pending_children("b1"))
        return super().ack(ack_id, confirm=confirm)


class _RecordsWhileADrainEnds(FakeDeadLetters):
    """Publishes failure records; once given a processor, while the end of a drain gives
    each one's message back."""

    processor: Processor | None = None

    def publish(self, delivery: Delivery, failure: Failure) -> str:
        if self.processor is not None:
            self.processor.give_back([delivery], force=True)
        return super().publish(delivery, failure)


def _failing_children() -> Registry:
    """Jobs whose ``t.child`` always fails for good: each run of it is dead-lettered."""
    jobs = Registry()

    @jobs.job("t.child")
    def child(ctx: JobContext, payload: dict[str, Any]) -> None:
        raise PermanentError("never", error_type="bad_input")

    return jobs


@pytest.mark.parametrize("record", ["out", "not-out", "out-as-a-drain-ends"])
def test_a_dead_lettered_child_is_written_once_its_record_is_out_and_before_its_ack(
    make_store: StoreFactory, record: str
) -> None:
    # Given a committed batch of two, and a worker whose job for its children always fails
    store = make_store()
    _committed(store, 2)
    jobs = _failing_children()
    schedule = MemorySchedule()
    acks = _AcksSeeingTheLedger(store)
    records = _RecordsWhileADrainEnds(fail=record == "not-out")
    batches = Batches(store, schedule, Firer(schedule, TOPIC, publisher=None))
    processor = Processor(
        jobs, acks, FakeLeaser(), records, [batches], ProcessorSettings(Backoff(1.0, 60.0))
    )
    if record == "out-as-a-drain-ends":
        records.processor = processor
    # When one child's message runs and is dead-lettered
    attributes = {c.ATTR_JOB: "t.child", c.ATTR_JOB_ID: "child-0", c.ATTR_BATCH_ID: "b1"}
    processor.process(make_delivery(b"{}", attributes))
    if record != "out":
        # Then, its record not published, or its message given back meanwhile (it comes
        # back), it is not acked and not written
        assert acks.acked == [] and len(acks.modacked) == 1
        assert store.pending_children("b1") == ["child-0", "child-1"]
        return
    # Then the ledger had it failed when its ack was sent (a crash after the ack cannot leave
    # the batch waiting for its deadline)
    assert acks.pending_at_ack == [["child-1"]] and processor.stats == {"dead_lettered": 1}
    assert len(records.records) == 1 and store.pending_children("b1") == ["child-1"]


class _ScheduleThatBlips(MemorySchedule):
    """A schedule whose first ``blips`` adds fail as an unavailable store does."""

    def __init__(self, blips: int) -> None:
        super().__init__()
        self.blips = blips

    def add(self, entry: Entry) -> bool:
        if self.blips > 0:
            self.blips -= 1
            raise StoreUnavailable("a blip")
        return super().add(entry)


def test_a_dead_lettered_last_child_whose_completion_is_not_handed_over_hands_it_over_soon(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a committed batch of one, and a schedule whose first two adds fail
    store = MemoryBatches()
    _committed(store, 1)
    jobs = _failing_children()
    schedule = _ScheduleThatBlips(blips=2)
    batches = Batches(store, schedule, Firer(schedule, TOPIC, publisher=None))
    processor = Processor(
        jobs, FakeAcks(), FakeLeaser(), FakeDeadLetters(), [batches],
        ProcessorSettings(Backoff(1.0, 60.0)),
    )  # fmt: skip
    try:
        # When its child is dead-lettered, finalizing the batch, and the hand-over of its
        # completion to the schedule fails
        attributes = {c.ATTR_JOB: "t.child", c.ATTR_JOB_ID: "child-0", c.ATTR_BATCH_ID: "b1"}
        processor.process(make_delivery(b"{}", attributes))
        assert processor.stats == {"dead_lettered": 1}
        # Then the completion is handed over once the store is back, not at the deadline
        assert wait_for(lambda: schedule.entries() != [], timeout=10)
        assert [e.job_id for e in schedule.entries()] == ["batch:b1:complete"]
        assert wait_for(lambda: store.unsent() == [], timeout=5)
        # And the log says the child was recorded, not that it was not
        messages = [r.getMessage() for r in caplog.records if r.name.startswith("workerpool")]
        assert not any("not recorded" in m for m in messages), messages
        assert any("not handed over" in m for m in messages), messages
    finally:
        batches.close(5)


class _DoneRecords(MemoryStore):
    """An idempotency store that may refuse to record a job done."""

    def __init__(self, *, refuse: bool) -> None:
        super().__init__()
        self._refuse = refuse

    def complete_many(self, completions: Sequence[tuple[str, str]], owner: str) -> None:
        if self._refuse:
            raise StoreUnavailable("down")
        super().complete_many(completions, owner)


class _SlowDoneRecords(MemoryStore):
    """An idempotency store whose writes of done records wait until let through."""

    def __init__(self) -> None:
        super().__init__()
        self.writing = threading.Event()
        self.let_through = threading.Event()

    def complete_many(self, completions: Sequence[tuple[str, str]], owner: str) -> None:
        self.writing.set()
        self.let_through.wait(10)
        super().complete_many(completions, owner)


class _LedgerSeeingDoneRecords(MemoryBatches):
    """A ledger that notes, as each child is written, whether its job was recorded done."""

    def __init__(self, done: MemoryStore) -> None:
        super().__init__()
        self._done = done
        self.done_when_written: list[tuple[str, bool]] = []

    def record(self, batch_id: str, job_id: str, succeeded: bool, *,
               cancelled: bool = False) -> Completion | None:  # fmt: skip
        self.done_when_written.append((job_id, self._done.completed_at(job_id) is not None))
        return super().record(batch_id, job_id, succeeded, cancelled=cancelled)


def _child_worker(
    done: MemoryStore, ledger: BatchStore, acks: FakeAcks, *, complete_patience: float
) -> tuple[Processor, Idempotency]:
    """A started worker whose job ``t.child`` succeeds, with the idempotency middleware (on
    ``done``) inside the batches' (on ``ledger``), as the defaults have them."""
    jobs = Registry()
    jobs.job("t.child")(lambda ctx, payload: None)
    schedule = MemorySchedule()
    idempotency = Idempotency(done, "w1", Timers(), complete_patience=complete_patience)
    batches = Batches(ledger, schedule, Firer(schedule, TOPIC, publisher=None))
    processor = Processor(
        jobs, acks, FakeLeaser(), FakeDeadLetters(), [batches, idempotency],
        ProcessorSettings(Backoff(1.0, 60.0)),
    )  # fmt: skip
    idempotency.start()
    return processor, idempotency


@pytest.mark.parametrize("done_record", ["written", "refused"])
def test_a_child_counts_done_in_its_batch_only_once_its_job_is_recorded_done(
    done_record: str,
) -> None:
    # Given a committed batch of two, and a worker with the idempotency middleware inside
    # the batches', whose store may refuse to record a job done
    done = _DoneRecords(refuse=done_record == "refused")
    ledger = _LedgerSeeingDoneRecords(done)
    _committed(ledger, 2)
    acks = FakeAcks()
    processor, idempotency = _child_worker(done, ledger, acks, complete_patience=0.2)
    try:
        # When one child's message runs and its job succeeds
        attributes = {c.ATTR_JOB: "t.child", c.ATTR_JOB_ID: "child-0", c.ATTR_BATCH_ID: "b1"}
        processor.process(make_delivery(b"{}", attributes))
    finally:
        idempotency.close(5)
    if done_record == "refused":
        # Then, its done record refused, it is neither counted in its batch nor acked: its
        # message comes back, to run again with the batch still open
        assert ledger.done_when_written == [] and acks.acked == []
        assert ledger.pending_children("b1") == ["child-0", "child-1"]
        return
    # Then its job was recorded done before the ledger counted it, and before its ack
    assert ledger.done_when_written == [("child-0", True)] and len(acks.acked) == 1
    assert ledger.pending_children("b1") == ["child-1"]


def test_a_child_handed_back_while_its_done_record_is_written_keeps_its_claim_until_then() -> None:
    # Given a committed batch of two, and a worker whose store writes a done record slowly
    done = _SlowDoneRecords()
    ledger = MemoryBatches()
    _committed(ledger, 2)
    acks = FakeAcks()
    processor, idempotency = _child_worker(done, ledger, acks, complete_patience=5)
    attributes = {c.ATTR_JOB: "t.child", c.ATTR_JOB_ID: "child-0", c.ATTR_BATCH_ID: "b1"}
    slot = threading.Thread(target=processor.process, args=(make_delivery(b"{}", attributes),))
    try:
        # When its job succeeds, and the drain deadline hands its message back while the
        # done record is being written
        slot.start()
        assert done.writing.wait(10)
        assert processor.interrupt_running() == 1
        assert len(acks.modacked) == 1
        # Then no other worker can claim the job meanwhile: its claim is not released
        assert wait_for(lambda: not idempotency.keeper.releasing(("child-0", "m-1")), 10)
        assert isinstance(done.claim("child-0", "w2", "m-2", 60), HeldElsewhere)
        # And once written, the job is done and the child counted
        done.let_through.set()
        slot.join(10)
        assert done.completed_at("child-0") is not None
        assert ledger.pending_children("b1") == ["child-1"] and acks.acked == []
    finally:
        done.let_through.set()
        idempotency.close(5)
    assert not isinstance(done.claim("child-0", "w2", "m-3", 60), Claimed)
