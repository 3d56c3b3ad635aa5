"""Keys leased in bulk, shown with real worker processes on the Pub/Sub emulator sharing an
SQLite store or the Firestore emulator's: a fleet runs fast jobs at the key's limit with a few
store writes a second (counted by SQLite itself; on Firestore, by each worker process as the
emulator accepts them, ``tests.store_writes``). A share holder killed outright:
test_slots_emulator.py's killed-worker test, in both modes."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tests import store_writes
from tests.support import (
    count_slot_writes,
    ledger_events,
    overlap,
    run_to_the_end,
    shared_store,
    slot_writes,
    start_bulk_workers,
    worker_processes,
)
from workerpool.testing.pubsub import PubSubResources

LIMIT = 20
# (jobs, seconds each) by store: at the limit, a backlog of 20 s, the first one or two of them
# spent rebalancing the key's shares from what each replica asked for first. On Firestore,
# jobs of 0.5 s: every job's claim and completion are writes too, and the emulator serves
# about 200 a second in all (with jobs of 0.1 s, 85 jobs ran a second: 0.47 of the slots).
WORK = {"sqlite": (4000, 0.1), "firestore": (800, 0.5)}


@pytest.mark.alone
@pytest.mark.parametrize("kind", ["sqlite", "firestore"])
def test_a_bulk_key_runs_fast_jobs_at_its_limit_with_few_writes(
    kind: str, pubsub_resources: PubSubResources, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # Given 4 worker processes with N = 16 each sharing a store, a key of 20 slots leased in
    # bulk, and the writes of the key's records counted: by SQLite itself, or on Firestore by
    # each worker as the emulator accepts them
    pubsub_resources.provision(retry_policy=False)
    ledger = tmp_path / "ledger.jsonl"
    store, extra_env = shared_store(kind, request, tmp_path, warm=True)
    db = tmp_path / "fleet.db"  # (shared_store's SQLite file)
    counting: tuple[str, ...] = ()
    if kind == "sqlite":
        count_slot_writes(db)
    else:
        extra_env[store_writes.ENV] = str(db)
        counting = ("--jobs", "tests.store_writes")
    count, seconds = WORK[kind]
    jobs = [(f"fast-{i}", {"seconds": seconds}) for i in range(count)]
    with worker_processes() as workers:
        start_bulk_workers(
            workers, [pubsub_resources] * 4, ledger, LIMIT, store, extra_env, *counting
        )
        # When 4,000 jobs of 100 ms (800 of 0.5 s) that take a slot of the key are published
        pubsub_resources.publish_many("demo.slot_sleep", jobs)
        codes = run_to_the_end(workers, ledger, count, timeout=120)
    done = ledger_events(ledger, "done")
    runs = [(r["start"], r["end"]) for r in done]
    first_start = min(start for start, _ in runs)
    backlog_until = max(start for start, _ in runs)  # from then on nothing waits for a slot
    peak, busy = overlap(runs, until=backlog_until)
    written = slot_writes(db)
    writes = sum(1 for _, at in written if first_start <= at <= backlog_until)
    backlog = backlog_until - first_start
    per_second = writes / backlog
    per_worker = Counter(r["pid"] for r in done)
    print(
        f"{kind}: peak {peak} running, {busy / LIMIT:.3f} of {LIMIT} slots busy over "
        f"{backlog:.1f}s of backlog ({count / backlog:.0f}"
        f" runs/s), {writes} writes of the key's records ({per_second:.2f}/s, "
        f"{writes / count:.4f} a run), per worker {sorted(per_worker.values())}"
    )
    # Then never more than 20 ran at once across the fleet (the jobs' own ledger), and the 20
    # were reached; the slots were kept busy while the backlog lasted; the key's records
    # were written at most 5 times a second; every job ran once
    assert peak == LIMIT
    assert busy / LIMIT >= 0.9
    assert 0 < per_second <= 5
    assert sorted(r["job_id"] for r in done) == sorted(job_id for job_id, _ in jobs)
    assert len(per_worker) == 4
    assert codes == [0, 0, 0, 0]
