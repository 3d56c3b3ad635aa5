"""Publisher duplicates across two real worker processes: each job's side effect happens once."""

from __future__ import annotations

import signal
import sqlite3
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.support import (
    WorkerProcess,
    ledger_events,
    pull_once,
    shared_store,
    spawn_worker,
    wait_for,
    worker_processes,
)
from workerpool.testing.pubsub import PubSubResources

JOBS = 200


def _leftovers(pubsub_resources: PubSubResources) -> list[str]:
    """Job ids still on the subscription (nothing should be: every copy was acked)."""
    return [m.message.attributes["job_id"] for m in pull_once(pubsub_resources)]


def _tails(ledger: Path, workers: list[WorkerProcess]) -> str:
    """What a failure message needs: how far the jobs got, and the end of each worker's log."""
    done = {r["job_id"] for r in ledger_events(ledger, "done")}
    logs = "\n".join("\n".join(w.output().splitlines()[-15:]) for w in workers)
    return f"{len(done)}/{JOBS} jobs done\n{logs}"


@pytest.mark.parametrize(
    ("kind", "sleep_job"),
    [("sqlite", "demo.sleep"), ("firestore", "demo.sleep"), ("sqlite", "demo.async_sleep")],
)
def test_each_duplicated_job_runs_once_across_two_workers(
    kind: str,
    sleep_job: str,
    pubsub_resources: PubSubResources,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    # Given 200 job ids each published twice (half back to back, half a whole pass apart), and
    # two worker processes running 8 jobs at a time over one shared idempotency store
    pubsub_resources.provision()
    store, extra_env = shared_store(kind, request, tmp_path)
    ledger = tmp_path / "ledger.jsonl"
    job_ids = [f"job-{i}" for i in range(JOBS)]
    half = JOBS // 2
    messages = [j for j in job_ids[:half] for _ in range(2)] + job_ids[half:] + job_ids[half:]
    with worker_processes() as workers:
        # (one after the other: two workers creating a new SQLite store at the same moment hit
        # the bug test_a_worker_waits_for_a_busy_new_sqlite_store_instead_of_crashing shows)
        for _ in range(2):
            worker = spawn_worker(
                pubsub_resources, ledger, "--max-outstanding", "8", store=store, extra_env=extra_env
            )
            workers.append(worker)
            assert wait_for(worker.ready, timeout=60), worker.output()

        # When both consume the 400 messages
        began = time.monotonic()
        pubsub_resources.publish_many(sleep_job, [(j, {"seconds": 0.05}) for j in messages])
        all_done = wait_for(lambda: len(ledger_events(ledger, "done")) >= JOBS, timeout=120)
        assert all_done, _tails(ledger, workers)
        took = time.monotonic() - began
        # (give the last copies, pulled after their job was done, time to be settled)
        time.sleep(3.0)
        for worker in workers:
            worker.signal(signal.SIGTERM)
        codes = [worker.wait(30) for worker in workers]
        outputs = [worker.output() for worker in workers]
        pids = [worker.pid for worker in workers]

    # Then each job id's side effect happened exactly once
    starts = Counter(r["job_id"] for r in ledger_events(ledger, "start"))
    done = Counter(r["job_id"] for r in ledger_events(ledger, "done"))
    per_worker = Counter(r["pid"] for r in ledger_events(ledger, "done"))
    twice = {job_id: n for job_id, n in starts.items() if n > 1}
    print(
        f"\n{kind}, {sleep_job}: {len(messages)} messages, {sum(starts.values())} runs, "
        f"{len(messages) - sum(starts.values())} duplicates dropped, {len(twice)} ids run twice, "
        f"runs per worker {[per_worker[p] for p in pids]}, {took:.1f}s"
    )
    assert sorted(done) == sorted(job_ids)
    assert not twice, twice
    assert set(done.values()) == {1}
    # And both workers took part, every copy was acked, and both exited cleanly
    assert all(per_worker[p] > 0 for p in pids), per_worker
    assert _leftovers(pubsub_resources) == []
    assert codes == [0, 0], outputs


def test_a_worker_waits_for_a_busy_new_sqlite_store_instead_of_crashing(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given a new SQLite store that another process is writing to for 3 s (as a second worker
    # does while it sets up the same new store, when both start at the same moment)
    pubsub_resources.provision()
    ledger = tmp_path / "ledger.jsonl"
    path = tmp_path / "new-claims.db"
    other = sqlite3.connect(path, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        # When a worker starts on that store
        with worker_processes() as workers:
            worker = spawn_worker(pubsub_resources, ledger, store=f"sqlite:///{path}")
            workers.append(worker)
            time.sleep(3.0)
            other.execute("COMMIT")
            pubsub_resources.publish("demo.sleep", {"seconds": 0.1}, job_id="after-the-lock")
            wait_for(lambda: ledger_events(ledger, "done") or not worker.alive(), timeout=30)
            ran = bool(ledger_events(ledger, "done"))
            alive = worker.alive()
            output = worker.output()
            worker.signal(signal.SIGTERM)
            code = worker.wait(30)
    finally:
        other.close()
    print(f"\nworker alive after the lock: {alive}, exit code {code}")
    # Then it waits for the lock (the store's busy timeout is 5 s) and runs jobs; it does not
    # crash at startup with "database is locked"
    last_line = output.strip().splitlines()[-1] if output.strip() else ""
    crashed_on_lock = "database is locked" in output
    assert not crashed_on_lock, last_line
    assert alive and ran, last_line
    assert code == 0, last_line
