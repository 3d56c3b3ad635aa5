"""A job that checkpoints after each of its 100 steps, on real worker processes and the
emulator: its worker killed (kill -9) or drained (SIGTERM) half-way, the next run of its job id
starts from the last checkpoint, the job finishes once, and its checkpoint is gone after."""

from __future__ import annotations

import json
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

from tests.support import WorkerProcess, ledger_events, spawn_worker, wait_for, worker_processes
from workerpool.progress import SqliteJobState
from workerpool.testing.pubsub import PubSubResources

# A killed worker's message comes back after its lease (10 s at least) and its claim lapses.
FAST_RECOVERY = ("--lease-extension", "10", "--claim-ttl", "6", "--max-outstanding", "2")
JOB_ID = "backfill-1"
STEPS = 100


def _steps(ledger: Path, pid: int | None = None) -> list[int]:
    return [e["step"] for e in ledger_events(ledger, "step", pid)]


def _checkpoint(ledger: Path) -> Any:
    store = SqliteJobState(ledger.parent / "claims.db")
    try:
        text = store.load(JOB_ID)
    finally:
        store.close()
    return None if text is None else json.loads(text)


def _stop_near_step_50(
    pubsub_resources: PubSubResources, ledger: Path, how: signal.Signals, *args: str
) -> tuple[WorkerProcess, int]:
    """A worker running the job, stopped with ``how`` once its step 50 is done: the worker and
    the checkpoint's next step once it is gone."""
    first = spawn_worker(pubsub_resources, ledger, *FAST_RECOVERY, *args)
    pubsub_resources.publish("demo.steps", {"steps": STEPS, "step_seconds": 0.05}, job_id=JOB_ID)
    assert wait_for(lambda: max(_steps(ledger), default=-1) >= 49, timeout=60), first.output()
    first.signal(how)
    first.wait(30)
    checkpoint = _checkpoint(ledger)
    assert checkpoint is not None
    return first, int(checkpoint["next"])


def _finish_on_a_second_worker(
    pubsub_resources: PubSubResources, ledger: Path, workers: list[WorkerProcess]
) -> WorkerProcess:
    second = spawn_worker(pubsub_resources, ledger, *FAST_RECOVERY)
    workers.append(second)
    assert wait_for(lambda: ledger_events(ledger, "done"), timeout=90), second.output()
    return second


def test_a_job_killed_half_way_resumes_from_its_last_checkpoint(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given a worker running a job of 100 steps of 50 ms, checkpointing after each
    pubsub_resources.provision(ack_deadline=10)
    ledger = tmp_path / "ledger.jsonl"
    with worker_processes() as workers:
        # When its process is killed (kill -9) near step 50 and another worker starts
        first, resume_at = _stop_near_step_50(pubsub_resources, ledger, signal.SIGKILL)
        workers.append(first)
        killed_at = time.monotonic()
        second = _finish_on_a_second_worker(pubsub_resources, ledger, workers)
        recovered = time.monotonic() - killed_at
        # Then the next run starts at the step after the last one checkpointed,
        [resumed] = ledger_events(ledger, "resume", second.pid)
        assert resumed["step"] == resume_at
        assert 49 < resume_at < STEPS
        # every step is done, at most one of them twice (the one under way at the kill),
        steps = _steps(ledger)
        twice = [step for step, count in Counter(steps).items() if count > 1]
        assert sorted(set(steps)) == list(range(STEPS))
        assert len(twice) <= 1, twice
        # the job finishes once, and its checkpoint is gone after
        assert len(ledger_events(ledger, "done")) == 1
        assert wait_for(lambda: _checkpoint(ledger) is None, timeout=10)
        time.sleep(3)  # nothing runs it again
        assert len(ledger_events(ledger, "resume")) == 2
    print(
        f"\nkilled after step {max(_steps(ledger, first.pid))}, resumed at {resume_at}, "
        f"steps done twice {twice}, finished {recovered:.1f} s after the kill"
    )


def test_a_job_handed_back_by_a_drain_resumes_from_its_last_checkpoint(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given a worker with a 1 s drain deadline running a job of 100 steps of 50 ms
    pubsub_resources.provision(ack_deadline=10)
    ledger = tmp_path / "ledger.jsonl"
    with worker_processes() as workers:
        # When it gets SIGTERM near step 50 (the job is handed back at the deadline) and
        # another worker starts
        first, resume_at = _stop_near_step_50(
            pubsub_resources, ledger, signal.SIGTERM, "--drain-timeout", "1"
        )
        workers.append(first)
        assert ledger_events(ledger, "cancelled", first.pid), first.output()
        second = _finish_on_a_second_worker(pubsub_resources, ledger, workers)
        # Then the next run starts where the handed-back one stopped: no step done twice
        [resumed] = ledger_events(ledger, "resume", second.pid)
        assert resumed["step"] == resume_at == max(_steps(ledger, first.pid)) + 1
        steps = _steps(ledger)
        assert sorted(steps) == list(range(STEPS))
        assert len(ledger_events(ledger, "done")) == 1
        assert wait_for(lambda: _checkpoint(ledger) is None, timeout=10)
    print(f"\nhanded back after step {resume_at - 1}, resumed at {resume_at}")
