"""SIGKILL a real worker process again and again: no job is lost, and only killed runs repeat."""

from __future__ import annotations

import itertools
import random
import signal
import time
from collections import defaultdict
from functools import partial
from pathlib import Path
from typing import Any

from tests.support import WorkerProcess, ledger_events, spawn_worker, wait_for, worker_processes
from workerpool.testing.pubsub import PubSubResources

JOBS = 1000
KILLS = 5
# Claims and leases of a killed worker come back after 10 s (the shortest lease Pub/Sub allows).
WORKER_ARGS = ("--max-outstanding", "2", "--claim-ttl", "10", "--lease-extension", "10")


def test_sigkilled_workers_lose_no_job_and_repeat_only_killed_runs(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given 1,000 short jobs, two workers sharing an SQLite store, 10 s claims and ack deadlines
    seed = random.randrange(1_000_000)
    rng = random.Random(seed)
    print(f"\nseed {seed}")
    pubsub_resources.provision(ack_deadline=10)
    ledger = tmp_path / "ledger.jsonl"
    job_ids = [f"job-{i}" for i in range(JOBS)]
    killed_at: dict[int, float] = {}
    began = time.monotonic()
    with worker_processes() as workers:

        def spawn() -> WorkerProcess:
            workers.append(spawn_worker(pubsub_resources, ledger, *WORKER_ARGS))
            return workers[-1]

        steady = spawn()
        # (one after the other: two workers creating a new SQLite store at the same moment hit
        # the bug test_a_worker_waits_for_a_busy_new_sqlite_store_instead_of_crashing shows)
        assert wait_for(steady.ready, timeout=30), steady.output()
        victim = spawn()
        pubsub_resources.publish_many(
            "demo.sleep", [(j, {"seconds": round(rng.uniform(0.02, 0.05), 3)}) for j in job_ids]
        )

        # When one of them is killed with SIGKILL 5 times at random moments while it runs jobs,
        # and restarted each time
        for _ in range(KILLS):
            assert wait_for(partial(ledger_events, ledger, "start", victim.pid), timeout=30), (
                victim.output()
            )
            time.sleep(rng.uniform(0.5, 1.5))
            killed_at[victim.pid] = time.time()
            victim.kill()
            done_then = len({r["job_id"] for r in ledger_events(ledger, "done")})
            alive = killed_at[victim.pid] - victim.launched
            print(f"killed {victim.pid} {alive:.2f}s after its start, {done_then} jobs done")
            victim = spawn()

        # and then both are left to finish
        finished = wait_for(
            lambda: len({r["job_id"] for r in ledger_events(ledger, "done")}) >= JOBS,
            timeout=90,
            interval=0.5,
        )
        took = time.monotonic() - began
        for worker in (steady, victim):
            worker.signal(signal.SIGTERM)
        codes = [worker.wait(30) for worker in (steady, victim)]

    runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for run in ledger_events(ledger, "start"):
        runs[run["job_id"]].append(run)
    done = {r["job_id"] for r in ledger_events(ledger, "done")}
    repeated = {job_id: sorted(rs, key=lambda r: r["start"]) for job_id, rs in runs.items()}
    repeated = {job_id: rs for job_id, rs in repeated.items() if len(rs) > 1}
    deliveries = max(r["attempt"] for rs in runs.values() for r in rs)
    print(
        f"{len(done)}/{JOBS} jobs done in {took:.1f}s, {len(repeated)} run more than once "
        f"(most deliveries of one message: {deliveries}), killed pids {sorted(killed_at)}"
    )
    # Then no job was lost
    assert finished, f"{JOBS - len(done)} jobs never completed: {sorted(set(job_ids) - done)[:20]}"
    assert done == set(job_ids)
    # And a job ran again only after a run of it was killed, never two runs at once: every run
    # but the last was in a worker that was then killed, and the next began after that kill
    for job_id, job_runs in repeated.items():
        for earlier, later in itertools.pairwise(job_runs):
            assert earlier["pid"] in killed_at, (job_id, job_runs)
            assert later["start"] > killed_at[earlier["pid"]], (job_id, job_runs, killed_at)
    # And the workers that were never killed drained and exited cleanly
    assert codes == [0, 0], [steady.output(), victim.output()]
