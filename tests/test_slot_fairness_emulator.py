"""Bulk keys' shares are max-min fair across replicas, shown with real worker processes on the
Pub/Sub emulator sharing an SQLite store: each replica reads its own subscription, so its
backlog is its own, and the key's record is sampled while they run."""

from __future__ import annotations

import json
import signal
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from tests.support import (
    ledger_events,
    overlap,
    shared_store,
    start_bulk_workers,
    subscriptions_of_their_own,
    wait_for,
    worker_processes,
)
from workerpool.testing.pubsub import PubSubResources

LIMIT = 20
BIG = 3
BIG_JOBS = 500  # each big replica's backlog, of 0.1 s jobs: about 8 s of the key at its limit
SMALL_JOBS = 10


@contextmanager
def _sampled_shares(db: Path, key: str) -> Iterator[list[tuple[float, dict[str, int]]]]:
    """Every 0.1 s, the live shares of ``key`` (granted slots by replica) from its record."""
    samples: list[tuple[float, dict[str, int]]] = []
    stop = threading.Event()

    def sample() -> None:
        with sqlite3.connect(db) as conn:
            while not stop.wait(0.1):
                row = conn.execute("SELECT record FROM slots WHERE key = ?", (key,)).fetchone()
                if row is None:
                    continue
                now = time.time()
                shares = json.loads(row[0]).get("shares", [])
                live = {s["replica"]: s["granted"] for s in shares if s["until"] > now}
                samples.append((now, live))

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join(5)


@pytest.mark.alone
def test_a_replica_with_a_small_backlog_gets_its_share_at_once_and_the_rest_split_evenly(
    pubsub_resources: PubSubResources, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # Given 4 worker processes (N = 16) on a key of 20 slots leased in bulk, each reading a
    # subscription of its own, three of them with a backlog of 500 jobs of 100 ms
    with ExitStack() as stack:
        subs = subscriptions_of_their_own(stack, pubsub_resources, BIG + 1)
        ledger = tmp_path / "ledger.jsonl"
        store, extra_env = shared_store("sqlite", request, tmp_path)
        db = tmp_path / "fleet.db"
        workers = stack.enter_context(worker_processes())
        start_bulk_workers(workers, subs, ledger, LIMIT, store, extra_env)
        bigs = workers[1:]
        samples = stack.enter_context(_sampled_shares(db, "demo-slots"))
        for n, sub in enumerate(subs[1:]):
            jobs = [(f"big{n}-{i}", {"seconds": 0.1}) for i in range(BIG_JOBS)]
            sub.publish_many("demo.slot_sleep", jobs)
        total = BIG * BIG_JOBS + SMALL_JOBS
        # When, with the big ones' backlogs well under way, the fourth gets 10 jobs of 100 ms
        assert wait_for(lambda: len(ledger_events(ledger, "done")) >= 400, timeout=60)
        published = time.time()
        small_jobs = [(f"small-{i}", {"seconds": 0.1}) for i in range(SMALL_JOBS)]
        subs[0].publish_many("demo.slot_sleep", small_jobs)
        finished = wait_for(lambda: len(ledger_events(ledger, "done")) >= total, timeout=120)
        assert finished, f"{len(ledger_events(ledger, 'done'))} of {total} done"
        for worker in workers:
            worker.signal(signal.SIGTERM)
        codes = [worker.wait(30) for worker in workers]
    done = ledger_events(ledger, "done")
    small_starts = [r["start"] for r in done if r["job_id"].startswith("small-")]
    big_done = [r for r in done if r["job_id"].startswith("big")]
    backlog_until = min(
        max(r["start"] for r in big_done if r["pid"] == w.pid) for w in bigs
    )  # from then on one big replica has no backlog left
    all_started = max(
        min(r["start"] for r in big_done if r["pid"] == w.pid) for w in bigs
    )  # from then on every big replica runs jobs (a process slow to start has none before)
    peak, _ = overlap([(r["start"], r["end"]) for r in done])
    # The big replicas' shares, sampled while all three had a backlog (each replica's id in
    # the record names its process)
    pids = {w.pid: n for n, w in enumerate(bigs)}
    spreads = []
    means = [0.0] * BIG
    steady = [s for at, s in samples if all_started + 2 <= at <= backlog_until]
    for shares in steady:
        granted = [0] * BIG
        for replica, slots in shares.items():
            for pid, n in pids.items():
                if str(pid) in replica:
                    granted[n] = slots
        spreads.append(max(granted) - min(granted))
        means = [m + g / len(steady) for m, g in zip(means, granted, strict=True)]
    within_one = sum(1 for s in spreads if s <= 1) / len(spreads)
    print(
        f"small: last of {SMALL_JOBS} started {max(small_starts) - published:.2f}s after "
        f"publishing; big shares over {len(steady)} samples: mean "
        f"{[round(m, 2) for m in means]}, spread <= 1 in {within_one:.3f}, max {max(spreads)}; "
        f"peak {peak}"
    )
    # Then the small one's jobs all started within 2 s of being published; the big ones'
    # shares differed by at most 1 slot on average, by 2 at most while one shrank to let
    # another grow (slots move only as a share gives them back); never more
    # than 20 ran at once; every job ran once
    assert max(small_starts) - published <= 2
    assert max(means) - min(means) <= 1
    assert max(spreads) <= 2
    assert peak == LIMIT
    assert len(done) == total
    assert codes == [0] * (BIG + 1)
