"""A worker process paused past its leases (SIGSTOP: a GC pause, a frozen VM) while another
runs its job: real worker processes on the Pub/Sub emulator, sharing an SQLite store."""

from __future__ import annotations

import contextlib
import json
import signal
import sqlite3
from pathlib import Path

import pytest

from tests.fenced_resource import KEY, RESOURCE_ENV, FencedResource, Write
from tests.support import WorkerProcess, spawn_worker, wait_for, worker_processes
from workerpool.testing.pubsub import PubSubResources

TTL = 6  # seconds, of the claim and of the slot (renewed every 2 s)
JOB_ID = "fenced-1"
WORK = 3.0  # seconds each run of the job works between its two writes


@pytest.mark.parametrize("mode", ["per_run", "bulk"])
def test_a_worker_paused_past_its_leases_neither_acks_nor_records_and_its_stale_writes_are_refused(
    mode: str, pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given a key of one slot (leased per run, or in bulk: then A's share holds it), leases
    # of 6 s, and worker A running the job between its two fenced writes
    pubsub_resources.provision(ack_deadline=10)
    resource = FencedResource(tmp_path / "resource.db")
    store = tmp_path / "fleet.db"
    with worker_processes() as workers:
        a = _worker(workers, pubsub_resources, tmp_path, mode)
        assert wait_for(a.ready, timeout=60)
        pubsub_resources.publish("fencing.write", {"seconds": WORK}, job_id=JOB_ID)
        assert wait_for(lambda: _writes(resource, a.pid), timeout=60), a.output()
        # When A is stopped (its leases lapse: its renewals stop with it) until worker B has
        # started the job, then continued
        stopped = a.signal(signal.SIGSTOP)
        b = _worker(workers, pubsub_resources, tmp_path, mode)
        began = wait_for(lambda: _writes(resource, b.pid), timeout=90)
        resumed = a.signal(signal.SIGCONT)
        assert began, b.output()
        assert resumed - stopped > TTL  # (B could only start once A's leases had lapsed)
        # (each settles its message; A's handler ends at once: its work's time has passed)
        for worker in (a, b):
            assert wait_for(lambda w=worker: _settled(w), timeout=30), worker.output()
        assert wait_for(lambda: len(_writes(resource, b.pid)) == 2, timeout=30), b.output()
        a_log = a.output()
    # Then A's stale write was refused, B's accepted: its token is the newer one
    writes = resource.writes()
    assert writes[:2] == [Write(a.pid, 1, "begin", True), Write(b.pid, 2, "begin", True)]
    assert set(writes[2:]) == {Write(a.pid, 1, "end", False), Write(b.pid, 2, "end", True)}
    # And A never settled the job as done: its message went back as a lost claim's, the job
    # id's completion is B's, and A's log says why
    assert (_settled(a), _settled(b)) == (["deferred"], ["done"]), a_log
    assert _completed_by(store).split("-")[-2] == str(b.pid)
    assert "lapsed while it ran" in a_log


def _worker(
    workers: list[WorkerProcess], env: PubSubResources, tmp_path: Path, mode: str
) -> WorkerProcess:
    worker = spawn_worker(
        env, tmp_path / "ledger.jsonl",
        "--jobs", "tests.fencing_jobs", "--max-outstanding", "1",
        "--concurrency", f"{KEY}=1/{mode}",
        "--claim-ttl", str(TTL), "--slot-ttl", str(TTL), "--lease-extension", "10",
        store=f"sqlite:///{tmp_path / 'fleet.db'}",
        extra_env={RESOURCE_ENV: str(tmp_path / "resource.db")},
    )  # fmt: skip
    workers.append(worker)
    return worker


def _settled(worker: WorkerProcess) -> list[str]:
    """How the worker's job log says it settled the job's messages."""
    lines = [json.loads(line) for line in worker.output().splitlines() if line.startswith("{")]
    return [
        line["outcome"]
        for line in lines
        if line.get("logger") == "workerpool.jobs" and line.get("job_id") == JOB_ID
    ]


def _writes(resource: FencedResource, pid: int) -> list[Write]:
    return [write for write in resource.writes() if write.pid == pid]


def _completed_by(store: Path) -> str:
    """The owner of the job id's completion in the idempotency store ("" if none)."""
    with contextlib.closing(sqlite3.connect(store)) as conn:
        row = conn.execute(
            "SELECT owner FROM idempotency WHERE job_id = ? AND completed_at IS NOT NULL",
            (JOB_ID,),
        ).fetchone()
    return "" if row is None else str(row[0])
