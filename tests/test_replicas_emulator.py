"""Two real worker processes on one subscription share the backlog fairly."""

from __future__ import annotations

import signal
from collections import Counter
from pathlib import Path

from tests.support import read_ledger, spawn_worker, wait_for, worker_processes
from workerpool.testing.pubsub import PubSubResources


def test_two_workers_share_a_backlog_without_hoarding(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given 40 one-second jobs and two worker processes with max_outstanding=2 each
    pubsub_resources.provision()
    ledger = tmp_path / "ledger.jsonl"
    with worker_processes() as workers:
        for _ in range(2):
            workers.append(
                spawn_worker(pubsub_resources, ledger, "--max-outstanding", "2", starts=False)
            )
        pubsub_resources.publish_many(
            "demo.sleep", [(f"job-{i}", {"seconds": 1.0}) for i in range(40)]
        )
        # When they run until the backlog is done
        assert wait_for(lambda: len(read_ledger(ledger)) >= 40, timeout=90)
        for worker in workers:
            worker.signal(signal.SIGTERM)
        codes = [worker.wait(30) for worker in workers]
    runs = read_ledger(ledger)
    # Then every job ran once, each worker ran a fair share, and 4 slots were kept busy
    assert sorted(r["job_id"] for r in runs) == sorted(f"job-{i}" for i in range(40))
    per_worker = Counter(r["pid"] for r in runs)
    assert len(per_worker) == 2 and min(per_worker.values()) >= 16, per_worker
    makespan = max(r["end"] for r in runs) - min(r["start"] for r in runs)
    busy = sum(r["end"] - r["start"] for r in runs)
    utilisation = busy / (4 * makespan)
    print(f"per worker {dict(per_worker)}, makespan {makespan:.2f}s, utilisation {utilisation:.2f}")
    assert utilisation > 0.75
    assert codes == [0, 0]
