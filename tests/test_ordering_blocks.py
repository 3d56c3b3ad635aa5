"""The blocked-keys store (memory, SQLite and Firestore), the ``ordered_exhausted`` option,
and the middleware's answers when the store cannot be read."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import FIRESTORE_PROJECT
from tests.support import store_handles, wait_for
from workerpool import JobContext, RetryableError, options
from workerpool.errors import ConfigError
from workerpool.idempotency import SqliteStore
from workerpool.ops.dlq import FailureRecord, Replayed
from workerpool.ordering import (
    Block,
    BlockedKeys,
    MemoryBlocks,
    SqliteBlocks,
    blocked_lines,
    blocked_status,
    open_blocked_keys,
)
from workerpool.ordering.middleware import KeyBlocks
from workerpool.ordering.replay import replay_then_unblock
from workerpool.registry import Registry
from workerpool.stores import StoreUnavailable
from workerpool.testing.fakes import (
    FakeAcks,
    FakeDeadLetters,
    FakeLeaser,
    make_delivery,
    slot_run,
)
from workerpool.worker.limits import PoolLimits
from workerpool.worker.ordering import Sequencer
from workerpool.worker.outcome import Deferred, Unavailable
from workerpool.worker.pool import Pool
from workerpool.worker.processor import Processor, ProcessorSettings
from workerpool.worker.run import Run


@pytest.mark.parametrize("kind", ["memory", "sqlite", "firestore"])
def test_a_key_is_blocked_until_unblocked_whoever_opens_the_store(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given two handles on one store, as a worker and an operator's command have
    def firestore(collection: str) -> BlockedKeys:
        from workerpool.ordering.firestore import FirestoreBlocks

        return FirestoreBlocks(FIRESTORE_PROJECT, collection)

    def memory() -> BlockedKeys:
        return MemoryBlocks()

    def sqlite() -> BlockedKeys:
        return SqliteBlocks(tmp_path / "claims.db")

    with store_handles(
        kind, request, monkeypatch, memory=memory, sqlite=sqlite, firestore=firestore
    ) as handle:
        worker, operator = handle(), handle()
        # When the worker blocks a key
        worker.block("key-a", "demo.sleep", "job-1")
        # Then the operator sees it, and only it
        assert operator.blocker("key-a") == "job-1" and operator.blocker("key-b") is None
        listed = [(b.key, b.job, b.job_id) for b in operator.all()]
        assert listed == [("key-a", "demo.sleep", "job-1")]
        # And once the operator unblocks it, the worker sees it go on; unblocking it again
        # says it was not blocked
        assert operator.unblock("key-a") and not operator.unblock("key-a")
        assert worker.blocker("key-a") is None and worker.all() == []


def test_the_sqlite_store_is_shared_by_whoever_opens_the_file(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'claims.db'}"
    open_blocked_keys(url).block("key-a", "demo.sleep", "job-1")
    assert blocked_lines(url) == ["blocked ordering key key-a: job demo.sleep (job-1)"]
    assert open_blocked_keys(url).unblock("key-a") and blocked_lines(url) == []


def test_a_store_that_keeps_no_blocks_is_one_clear_error() -> None:
    with pytest.raises(ConfigError, match="not none"):
        open_blocked_keys("none")
    assert blocked_lines("none") == []


def test_the_option_takes_record_or_block_only() -> None:
    options.check("j", {"ordered_exhausted": "block"})
    options.check("j", {"ordered_exhausted": "record"})
    with pytest.raises(ValueError, match="'record' or 'block'"):
        options.check("j", {"ordered_exhausted": "stop"})


class _Unreachable(MemoryBlocks):
    def blocker(self, key: str) -> str | None:
        raise StoreUnavailable("blocked keys: no answer in 5s")

    def all(self) -> list[Block]:
        raise StoreUnavailable("blocked keys: no answer in 5s")


def _keyed_run(key: str) -> Run:
    run = slot_run("job-1")
    run.delivery = dataclasses.replace(run.delivery, ordering_key=key)
    return run


def test_a_keyed_run_waits_while_its_key_is_blocked_and_when_that_cannot_be_read() -> None:
    blocks = MemoryBlocks()
    blocks.block("key-a", "demo.sleep", "job-0")
    assert isinstance(KeyBlocks(blocks).before(_keyed_run("key-a")), Deferred)
    assert KeyBlocks(blocks).before(_keyed_run("key-b")) is None
    # ... but the job that blocked it runs, come back before its failure record went out
    blocks.block("key-c", "demo.sleep", "job-1")
    assert KeyBlocks(blocks).before(_keyed_run("key-c")) is None
    # An outage is neither a run out of turn nor a failure of the job: it comes back later
    down = KeyBlocks(_Unreachable()).before(_keyed_run("key-a"))
    assert isinstance(down, Unavailable) and "no answer" in down.reason


def test_the_gauge_counts_the_keys_blocked_now_by_job_and_nothing_when_unread() -> None:
    blocks = MemoryBlocks()
    middleware = KeyBlocks(blocks, ["demo.blocking_sleep"])
    assert middleware.blocked_now() == {"demo.blocking_sleep": 0}
    blocks.block("key-a", "demo.blocking_sleep", "job-1")
    blocks.block("key-b", "demo.blocking_sleep", "job-2")
    blocks.block("key-c", "other.job", "job-3")
    assert middleware.blocked_now() == {"demo.blocking_sleep": 2, "other.job": 1}
    blocks.unblock("key-a")
    blocks.unblock("key-b")
    assert middleware.blocked_now() == {"demo.blocking_sleep": 0, "other.job": 1}
    assert KeyBlocks(_Unreachable(), ["demo.blocking_sleep"]).blocked_now() is None


def test_status_says_in_one_line_when_the_blocked_keys_cannot_be_read() -> None:
    assert blocked_status("none") == []
    [line] = blocked_status("firestore://p")  # not a store URL at all
    assert line.startswith("blocked ordering keys not read: ")


class _Replayer:
    """Replays the records it is given, as the dead-letter subscription would hold them."""

    def __init__(self, records: list[FailureRecord]) -> None:
        self.records = records
        self.replayed: list[str] = []

    def __call__(self, job_id: str) -> list[Replayed]:
        found = [r for r in self.records if r.job_id == job_id][:1]
        self.replayed += [r.job_id for r in found]
        return [Replayed(r, "replayed", "projects/p/topics/t") for r in found]


def _record(job_id: str) -> FailureRecord:
    return FailureRecord("ack-1", "m-1", b"{}", {"job": "demo.sleep", "job_id": job_id}, None)


def test_replay_unblocks_at_once_a_key_whose_job_completed_meanwhile(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'claims.db'}"
    open_blocked_keys(url).block("key-a", "demo.sleep", "job-1")
    store = SqliteStore(tmp_path / "claims.db")
    store.claim("job-1", "w", "m-1", 30)
    store.complete("job-1", "w", "m-1")
    replayer, said = _Replayer([_record("job-1")]), list[str]()
    replay_then_unblock(url, "key-a", replayer, 5, said.append)
    assert replayer.replayed == [] and blocked_lines(url) == []
    assert said[-1] == "job demo.sleep (job-1) completed; ordering key key-a unblocked"


def test_replay_without_the_jobs_failure_record_leaves_the_key_blocked(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'claims.db'}"
    open_blocked_keys(url).block("key-a", "demo.sleep", "job-1")
    replayer = _Replayer([_record("job-2")])
    with pytest.raises(ConfigError, match=r"no failure record of job demo.sleep \(job-1\)"):
        replay_then_unblock(url, "key-a", replayer, 5, lambda line: None)
    assert replayer.replayed == [] and len(blocked_lines(url)) == 1


class _RefusesWrites(MemoryBlocks):
    """The first ``failures`` blocks written fail, as a store out of reach."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    def block(self, key: str, job: str, job_id: str) -> None:
        if self.failures:
            self.failures -= 1
            raise StoreUnavailable("blocked-keys store: database is locked")
        super().block(key, job, job_id)


@pytest.mark.parametrize("failures", [0, 1])
def test_a_key_is_blocked_before_its_failure_record_and_ack_or_its_message_comes_back(
    failures: int,
) -> None:
    # Given a job that blocks its key once it exhausts its attempts (one here), and a
    # blocked-keys store whose first write fails (or none)
    ran: list[str] = []
    jobs = Registry()

    @jobs.job("ledger.apply", max_attempts=1, ordered_exhausted="block")
    def apply(ctx: JobContext, payload: dict[str, Any]) -> None:
        ran.append(ctx.job_id)
        if ctx.job_id == "acct-0":
            raise RetryableError("upstream down")

    acks, leases, records = FakeAcks(), FakeLeaser(), FakeDeadLetters()
    blocks = _RefusesWrites(failures)
    processor = Processor(jobs, acks, leases, records, [KeyBlocks(blocks, ["ledger.apply"])],
                          ProcessorSettings(ordered=True))  # fmt: skip
    pool = Pool(processor, leases, PoolLimits(2, 4), sequencer=Sequencer(3))
    pool.start()
    try:
        # When the key's first job fails for good, with its next one behind it
        pool.admit([
            make_delivery(b"{}", {"job": "ledger.apply", "job_id": job_id}, message_id=job_id,
                          ordering_key="acct")
            for job_id in ("acct-0", "acct-1")
        ])  # fmt: skip
        assert wait_for(lambda: pool.held == 0, timeout=10, interval=0.005)
    finally:
        pool.quiet()
    # Then the next job never ran. Written, the key is blocked and the failure recorded and
    # acked; not written, no record went out, and both messages came back, in order
    assert ran == ["acct-0"]
    if failures:
        assert blocks.all() == [] and records.records == [] and acks.acked == []
        assert [ack_id for ack_id, _ in acks.modacked] == ["ack-acct-0", "ack-acct-1"]
    else:
        assert [b.job_id for b in blocks.all()] == ["acct-0"] and len(records.records) == 1
        assert acks.acked == ["ack-acct-0"]
