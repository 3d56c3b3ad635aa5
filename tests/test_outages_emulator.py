"""Outages: the idempotency store or Pub/Sub itself goes away mid-run and comes back."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest

from tests.support import wait_for
from workerpool import JobContext
from workerpool.idempotency import StoreUnavailable
from workerpool.idempotency.firestore import FirestoreStore
from workerpool.registry import Registry
from workerpool.testing.emulator import LocalEmulator
from workerpool.testing.pubsub import PubSubResources


class RecordingStore(FirestoreStore):
    """Firestore store that notes each completion it recorded and each call that failed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.completed: list[str] = []
        self.unavailable = 0
        self._lock = threading.Lock()

    def complete_many(self, completions: Sequence[tuple[str, str]], owner: str) -> None:
        try:
            super().complete_many(completions, owner)
        except StoreUnavailable:
            with self._lock:
                self.unavailable += 1
            raise
        with self._lock:
            self.completed.extend(job_id for job_id, _ in completions)

    def claim_many(self, claims: Sequence[tuple[str, str]], owner: str, ttl: float) -> Any:
        try:
            return super().claim_many(claims, owner, ttl)
        except StoreUnavailable:
            with self._lock:
                self.unavailable += 1
            raise


def test_store_outage_neither_acks_unrecorded_jobs_nor_loses_any(
    pubsub_resources: PubSubResources, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a worker whose idempotency store is a Firestore emulator, and 60 jobs of 0.3 s
    pubsub_resources.provision(retry_policy=False)
    firestore = LocalEmulator("firestore", project="outage").start()
    monkeypatch.setenv(firestore.env_var, firestore.host)
    store = RecordingStore("outage", "claims", timeout=2.0)
    jobs, runs = Registry(), []

    @jobs.job("t.work")
    def work(ctx: JobContext, payload: dict[str, Any]) -> None:
        time.sleep(0.3)
        runs.append(ctx.job_id)

    pubsub_resources.publish_many("t.work", [(f"job-{i}", {}) for i in range(60)])
    try:
        with pubsub_resources.worker(
            jobs, store=store, max_outstanding=4, max_backoff=4.0, claim_ttl=10.0
        ) as worker:
            assert wait_for(lambda: len(runs) >= 8, timeout=30)
            # When the store is down for 10 s mid-run, then back (empty: the emulator forgets)
            firestore.stop()
            done_before = worker.processor.stats["done"]
            time.sleep(10)
            done_during = worker.processor.stats["done"] - done_before
            firestore.start()
            assert wait_for(lambda: worker.processor.stats["done"] >= 60, timeout=120)
            stats = dict(worker.processor.stats)
    finally:
        firestore.stop()
    # Then the outage was felt, every ack followed a recorded completion, and none was lost
    print(f"store errors {store.unavailable}, acked during outage {done_during}, stats {stats}")
    assert store.unavailable > 0
    assert stats["done"] == len(store.completed) == 60
    assert sorted(set(store.completed)) == sorted(f"job-{i}" for i in range(60))
    # Only jobs running when the store went down may have finished during the outage
    assert done_during <= 4


def test_worker_resumes_after_the_pubsub_emulator_restarts(
    pubsub_resources: PubSubResources,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a worker on an emulator of its own
    emulator = LocalEmulator("pubsub", project=pubsub_resources.project).start()
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", emulator.host)
    env = PubSubResources(pubsub_resources.project, emulator.host)
    jobs, runs = Registry(), []
    jobs.job("t.quick")(lambda ctx, payload: runs.append(ctx.job_id))
    try:
        env.provision()
        env.publish_many("t.quick", [(f"before-{i}", {}) for i in range(10)])
        with (
            caplog.at_level(logging.WARNING, logger="workerpool.worker.puller"),
            env.worker(jobs) as worker,
        ):
            assert wait_for(lambda: len(runs) == 10, timeout=30)
            # When the emulator restarts (losing everything) and is provisioned again
            emulator.stop()
            time.sleep(3)
            emulator.start()
            env.provision()
            env.publish_many("t.quick", [(f"after-{i}", {}) for i in range(10)])
            # Then the same worker carries on with the new jobs, after backing off
            assert wait_for(lambda: len(runs) == 20, timeout=60), runs
            assert worker.pool.quieted is False
    finally:
        env.close()
        emulator.stop()
    failures = [r for r in caplog.records if "pull failed" in r.getMessage()]
    print(f"pull failures logged during the restart: {len(failures)}")
    assert 0 < len(failures) < 30  # it retried, with backoff, not in a tight loop
    assert sorted(runs[10:]) == sorted(f"after-{i}" for i in range(10))
