"""Fleet-wide concurrency limits, shown with real worker processes on the Pub/Sub emulator,
sharing an SQLite store on one host or the Firestore emulator's store."""

from __future__ import annotations

import signal
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import FIRESTORE_PROJECT
from tests.support import (
    WorkerProcess,
    ledger_events,
    spawn_worker,
    wait_for,
    worker_processes,
)
from workerpool.testing.emulator import LocalEmulator
from workerpool.testing.pubsub import PubSubResources

# The jobs that take slots, and a limit for the key that is not under test here.
SLOT_JOBS = ("--jobs", "workerpool_jobs.demo_slots", "--concurrency", "tenant:*=1")


def _overlap(intervals: list[tuple[float, float]]) -> tuple[int, float]:
    """The most intervals open at once, and the time-weighted mean of how many were open
    between the first start and the last end."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    open_now = peak = 0
    area = 0.0
    last = events[0][0]
    for when, change in events:
        area += open_now * (when - last)
        open_now += change
        peak = max(peak, open_now)
        last = when
    span = events[-1][0] - events[0][0]
    return peak, area / span


def _store_url(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> tuple[str, dict[str, str]]:
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'fleet.db'}", {}
    emulator: LocalEmulator = request.getfixturevalue("firestore_emulator")
    collection = f"fleet-{uuid.uuid4().hex[:10]}"
    return f"firestore://{FIRESTORE_PROJECT}/{collection}", {emulator.env_var: emulator.host}


@pytest.mark.parametrize("kind", ["sqlite", "firestore"])
def test_a_key_limit_is_exact_across_four_worker_processes(
    kind: str, pubsub_resources: PubSubResources, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # Given 4 worker processes with 8 slots each sharing one store, and a key of limit 3
    pubsub_resources.provision()
    ledger = tmp_path / "ledger.jsonl"
    store, extra_env = _store_url(kind, tmp_path, request)
    jobs = [(f"export-{i}", {"seconds": 0.5}) for i in range(200)]
    with worker_processes() as workers:
        for _ in range(4):
            workers.append(
                spawn_worker(
                    pubsub_resources, ledger, *SLOT_JOBS, "--max-outstanding", "8",
                    "--concurrency", "demo-slots=3", store=store, extra_env=extra_env,
                )
            )  # fmt: skip
        assert wait_for(lambda: all(w.ready() for w in workers), timeout=60)
        # When 200 jobs of 0.5 s that take a slot of the key are published
        pubsub_resources.publish_many("demo.slot_sleep", jobs)
        assert wait_for(lambda: len(ledger_events(ledger, "done")) >= 200, timeout=180)
        for worker in workers:
            worker.signal(signal.SIGTERM)
        codes = [worker.wait(30) for worker in workers]
    done = ledger_events(ledger, "done")
    peak, busy = _overlap([(r["start"], r["end"]) for r in done])
    per_worker = Counter(r["pid"] for r in done)
    print(f"{kind}: peak {peak} running, {busy / 3:.3f} of 3 slots busy, per worker {per_worker}")
    # Then never more than 3 ran at once across the fleet (the jobs' own ledger), the 3 slots
    # were kept busy while the backlog lasted, every job ran once, none was dead-lettered
    assert peak == 3
    assert busy / 3 >= 0.90
    assert sorted(r["job_id"] for r in done) == sorted(job_id for job_id, _ in jobs)
    assert len(per_worker) == 4
    assert pubsub_resources.dead_letters(expected=1, timeout=2) == []
    assert codes == [0, 0, 0, 0]


def test_slots_of_a_killed_worker_free_within_their_ttl(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given a key of limit 2 with a 6 s slot TTL, and worker A running 2 long jobs of it
    pubsub_resources.provision()
    ledger = tmp_path / "ledger.jsonl"
    flags: list[Any] = [
        *SLOT_JOBS, "--concurrency", "demo-slots=2", "--slot-ttl", "6", "--claim-ttl", "6",
        "--lease-extension", "10", "--drain-timeout", "2",
    ]  # fmt: skip
    with worker_processes() as workers:
        a = _spawn(workers, pubsub_resources, ledger, [*flags, "--max-outstanding", "2"])
        pubsub_resources.publish_many(
            "demo.slot_sleep", [(f"long-{i}", {"seconds": 60}) for i in range(2)]
        )
        assert wait_for(lambda: len(ledger_events(ledger, "start", a.pid)) == 2, timeout=30)
        # ... and worker B waiting for the key with 4 short jobs
        b = _spawn(workers, pubsub_resources, ledger, [*flags, "--max-outstanding", "4"])
        pubsub_resources.publish_many(
            "demo.slot_sleep", [(f"short-{i}", {"seconds": 0.5}) for i in range(4)]
        )
        time.sleep(3)
        assert ledger_events(ledger, "start", b.pid) == []  # A holds both slots
        # When A is killed outright (no release of anything)
        a.process.kill()
        killed = time.time()
        a.wait(10)
        # Then B gets the slots once A's leases lapse, within the TTL, and nothing is lost:
        # A's two long jobs come back and run on B too
        assert wait_for(lambda: len(ledger_events(ledger, "start", b.pid)) >= 1, timeout=20)
        freed_after = min(r["start"] for r in ledger_events(ledger, "start", b.pid)) - killed
        assert wait_for(lambda: len(ledger_events(ledger, "done", b.pid)) >= 4, timeout=60)
        assert wait_for(lambda: _started_on(ledger, b) >= {"long-0", "long-1"}, timeout=60)
        b.signal(signal.SIGTERM)  # A's long jobs now run on B: the drain hands them back
        assert b.wait(30) == 0
    starts = ledger_events(ledger, "start")
    runs = [(r["start"], killed if r["pid"] == a.pid else _end(ledger, r)) for r in starts]
    peak, _ = _overlap(runs)
    print(f"slots free {freed_after:.2f}s after the kill; peak {peak} running")
    assert 0 < freed_after <= 6 + 1.5
    assert peak <= 2


def _started_on(ledger: Path, worker: WorkerProcess) -> set[str]:
    return {r["job_id"] for r in ledger_events(ledger, "start", worker.pid)}


def _spawn(
    workers: list[WorkerProcess], env: PubSubResources, ledger: Path, flags: list[Any]
) -> WorkerProcess:
    worker = spawn_worker(env, ledger, *flags, store=f"sqlite:///{ledger.parent / 'fleet.db'}")
    workers.append(worker)
    assert wait_for(worker.ready, timeout=30)
    return worker


def _end(ledger: Path, start: dict[str, Any]) -> float:
    """When the run that logged ``start`` ended (now, if it still runs)."""
    for entry in ledger_events(ledger, "done") + ledger_events(ledger, "cancelled"):
        if (entry["message_id"], entry["start"]) == (start["message_id"], start["start"]):
            return float(entry["end"])
    return time.time()
