"""Per-tenant keys leased in bulk (``"tenant:*" = "5/bulk"``), shown with real worker
processes on the Pub/Sub emulator sharing an SQLite store that counts the writes of the keys'
records: each tenant runs at its limit, never above it, with a few writes of its key a
second."""

from __future__ import annotations

import signal
import statistics
from pathlib import Path

import pytest

from tests.support import (
    count_slot_writes,
    ledger_events,
    overlap,
    shared_store,
    slot_writes,
    spawn_worker,
    wait_for,
    worker_processes,
)
from workerpool.testing.pubsub import PubSubResources

TENANTS = 25
LIMIT = 5
# 2,000 jobs of 200 ms in all: a tenant's 80 take 3.2 s at its limit. A key's fixed writes
# (each replica's first ask and its giving back, 4 with both replicas) weigh on a key in use
# for a second or two, so a tenant's backlog here lasts a few seconds.
JOBS = 80


@pytest.mark.alone
def test_per_tenant_bulk_keys_hold_each_tenant_to_its_limit_with_few_writes_each(
    pubsub_resources: PubSubResources, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # Given 2 worker processes (N = 32) sharing an SQLite store that counts the writes of the
    # keys' records, each tenant's key of 5 slots leased in bulk
    pubsub_resources.provision(retry_policy=False)
    ledger = tmp_path / "ledger.jsonl"
    store, extra_env = shared_store("sqlite", request, tmp_path)
    db = tmp_path / "fleet.db"
    count_slot_writes(db)
    jobs = [
        (f"t{t}-{i}", {"seconds": 0.2, "tenant": f"t{t}"})
        for t in range(TENANTS)
        for i in range(JOBS)
    ]
    with worker_processes() as workers:
        for _ in range(2):
            workers.append(
                spawn_worker(
                    pubsub_resources, ledger, "--jobs", "workerpool_jobs.demo_slots",
                    "--concurrency", "demo-slots=1",
                    "--concurrency", f"tenant:*={LIMIT}/bulk",
                    "--max-outstanding", "32", store=store, extra_env=extra_env,
                )
            )  # fmt: skip
        ready = wait_for(lambda: all(w.ready() for w in workers), timeout=60)
        assert ready, workers[0].output()[-2000:]
        # When 25 tenants' jobs of 200 ms are published, 80 a tenant, tenant after tenant (so
        # a few tenants have a backlog at a time, split between the replicas, each more than
        # the tenant's limit)
        pubsub_resources.publish_many("demo.tenant_sleep", jobs)
        finished = wait_for(lambda: len(ledger_events(ledger, "done")) >= len(jobs), timeout=240)
        assert finished, f"{len(ledger_events(ledger, 'done'))} of {len(jobs)} done"
        for worker in workers:
            worker.signal(signal.SIGTERM)
        codes = [worker.wait(30) for worker in workers]
    done = ledger_events(ledger, "done")
    peaks, busy = {}, {}
    for t in range(TENANTS):
        runs = [(r["start"], r["end"]) for r in done if r["job_id"].startswith(f"t{t}-")]
        # (busy: while the tenant's backlog lasted, until its last job started)
        peaks[t], busy[t] = overlap(runs, until=max(start for start, _ in runs))
    written: dict[str, list[float]] = {}
    for key, at in slot_writes(db):
        written.setdefault(key, []).append(at)
    # A key's rate: its writes over the seconds it was written in, a period added (a key
    # written twice at once is 2 writes in a second, not infinitely many a second)
    rates = {key: len(times) / (times[-1] - times[0] + 1.0) for key, times in written.items()}
    again = sum(1 for r in done if r["attempt"] > 1)
    ninth = statistics.quantiles(rates.values(), n=10)[-1]
    print(
        f"tenants: peaks {sorted(set(peaks.values()))}; writes a second of a key: highest "
        f"{max(rates.values()):.2f}, 0.9 of keys at most {ninth:.2f}, median "
        f"{statistics.median(rates.values()):.2f} "
        f"({sum(map(len, written.values()))} writes of {len(written)} keys); slots busy while "
        f"a tenant's backlog lasted: median {statistics.median(busy.values()) / LIMIT:.2f}, "
        f"lowest {min(busy.values()) / LIMIT:.2f}; {again} jobs delivered again"
    )
    # Then each tenant ran exactly 5 at once at its peak, never more (the jobs' own ledger);
    # every tenant's key was written about twice a second at most over the time it was in use
    # (the busiest: 1.96-2.82 a second in four runs while a share gave back at once the slots
    # its runs stopped using between pulls, 1.34-2.02 in seven since it keeps them a period;
    # a key in use for a few seconds is mostly rounds while its slots move, which come twice
    # a period from each replica: 17 writes in 7.4 s made the 2.02, where a run's lease each
    # would have been 160);
    # every job ran once, at its first delivery (none turned away or waiting out its
    # patience while its replica had room)
    assert peaks == dict.fromkeys(range(TENANTS), LIMIT)
    assert set(written) == {f"tenant:t{t}" for t in range(TENANTS)}
    assert max(rates.values()) <= 2.5
    assert sorted(r["job_id"] for r in done) == sorted(job_id for job_id, _ in jobs)
    assert again == 0
    assert codes == [0, 0]
