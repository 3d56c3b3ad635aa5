"""A job that checkpoints after each of its 100 steps, on real worker processes and the
emulator, with the SQLite store and the Firestore one: its worker killed (kill -9) or drained
(SIGTERM) half-way, the next run of its job id starts from the last checkpoint, the job
finishes once, and its checkpoint is gone after."""

from __future__ import annotations

import json
import signal
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support import (
    WorkerProcess,
    ledger_events,
    shared_store,
    spawn_worker,
    wait_for,
    worker_processes,
)
from workerpool.progress import job_state_opener
from workerpool.testing.pubsub import PubSubResources

# A killed worker's message comes back after its lease (10 s at least) and its claim lapses.
FAST_RECOVERY = ("--lease-extension", "10", "--claim-ttl", "6", "--max-outstanding", "2")
JOB_ID = "backfill-1"
STEPS = 100


@dataclass
class Fleet:
    """The workers' shared store, and the ledger their runs write."""

    env: PubSubResources
    ledger: Path
    store: str
    store_env: dict[str, str]

    def spawn(self, *args: str) -> WorkerProcess:
        return spawn_worker(
            self.env, self.ledger, *FAST_RECOVERY, *args,
            store=self.store, extra_env=self.store_env,
        )  # fmt: skip

    @property
    def kind(self) -> str:
        return self.store.partition(":")[0]

    def checkpoint(self) -> Any:
        opener = job_state_opener(self.store)
        assert opener is not None
        store = opener()
        try:
            text = store.load(JOB_ID)
        finally:
            store.close()
        return None if text is None else json.loads(text)


@pytest.fixture(params=["sqlite", "firestore"])
def fleet(
    request: pytest.FixtureRequest,
    pubsub_resources: PubSubResources,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Fleet]:
    store, store_env = shared_store(request.param, request, tmp_path)
    for name, value in store_env.items():
        monkeypatch.setenv(name, value)  # for the test's own reads of the store
    pubsub_resources.provision(ack_deadline=10)
    yield Fleet(pubsub_resources, tmp_path / "ledger.jsonl", store, store_env)


def _steps(ledger: Path, pid: int | None = None) -> list[int]:
    return [e["step"] for e in ledger_events(ledger, "step", pid)]


def _stop_near_step_50(fleet: Fleet, how: signal.Signals, *args: str) -> tuple[WorkerProcess, int]:
    """A worker running the job, stopped with ``how`` once its step 50 is done: the worker and
    the checkpoint's next step once it is gone."""
    first = fleet.spawn(*args)
    fleet.env.publish("demo.steps", {"steps": STEPS, "step_seconds": 0.05}, job_id=JOB_ID)
    assert wait_for(lambda: max(_steps(fleet.ledger), default=-1) >= 49, 60), first.output()
    first.signal(how)
    first.wait(30)
    checkpoint = fleet.checkpoint()
    assert checkpoint is not None
    return first, int(checkpoint["next"])


def _finish_on_a_second_worker(fleet: Fleet, workers: list[WorkerProcess]) -> WorkerProcess:
    second = fleet.spawn()
    workers.append(second)
    assert wait_for(lambda: ledger_events(fleet.ledger, "done"), timeout=90), second.output()
    return second


def test_a_job_killed_half_way_resumes_from_its_last_checkpoint(fleet: Fleet) -> None:
    # Given a worker running a job of 100 steps of 50 ms, checkpointing after each
    ledger = fleet.ledger
    with worker_processes() as workers:
        # When its process is killed (kill -9) near step 50 and another worker starts
        first, resume_at = _stop_near_step_50(fleet, signal.SIGKILL)
        workers.append(first)
        killed_at = time.monotonic()
        second = _finish_on_a_second_worker(fleet, workers)
        recovered = time.monotonic() - killed_at
        # Then the next run starts at the step after the last one checkpointed (step 49 again
        # if the kill came between its ledger line and its checkpoint),
        [resumed] = ledger_events(ledger, "resume", second.pid)
        assert resumed["step"] == resume_at
        assert 49 <= resume_at < STEPS
        # every step is done, at most one of them twice (the one under way at the kill),
        steps = _steps(ledger)
        twice = [step for step, count in Counter(steps).items() if count > 1]
        assert sorted(set(steps)) == list(range(STEPS))
        assert len(twice) <= 1, twice
        # the job finishes once, and its checkpoint is gone after
        assert len(ledger_events(ledger, "done")) == 1
        assert wait_for(lambda: fleet.checkpoint() is None, timeout=10)
        time.sleep(3)  # nothing runs it again
        assert len(ledger_events(ledger, "resume")) == 2
    print(
        f"\n{fleet.kind}: killed after step {max(_steps(ledger, first.pid))}, "
        f"resumed at {resume_at}, steps done twice {twice}, finished {recovered:.1f} s after kill"
    )


def test_a_job_handed_back_by_a_drain_resumes_from_its_last_checkpoint(fleet: Fleet) -> None:
    # Given a worker with a 1 s drain deadline running a job of 100 steps of 50 ms
    ledger = fleet.ledger
    with worker_processes() as workers:
        # When it gets SIGTERM near step 50 (the job is handed back at the deadline) and
        # another worker starts
        first, resume_at = _stop_near_step_50(fleet, signal.SIGTERM, "--drain-timeout", "1")
        workers.append(first)
        assert ledger_events(ledger, "cancelled", first.pid), first.output()
        second = _finish_on_a_second_worker(fleet, workers)
        # Then the next run starts at the step after the last one checkpointed, which is the
        # handed-back run's last step or the one after it: a step that ended as the deadline
        # came has its checkpoint refused (the message was given back), and is done again
        [resumed] = ledger_events(ledger, "resume", second.pid)
        last_done = max(_steps(ledger, first.pid))
        assert resumed["step"] == resume_at
        assert resume_at in (last_done, last_done + 1)
        steps = _steps(ledger)
        twice = [step for step, count in Counter(steps).items() if count > 1]
        assert sorted(set(steps)) == list(range(STEPS))
        assert twice in ([], [last_done]), twice
        if twice:
            assert "checkpoint after its run was handed back" in first.output()
        assert len(ledger_events(ledger, "done")) == 1
        assert wait_for(lambda: fleet.checkpoint() is None, timeout=10)
    print(f"\n{fleet.kind}: handed back after step {last_done}, resumed at {resume_at}")
