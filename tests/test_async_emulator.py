"""``async def`` jobs on the real emulator: one bound with sync jobs, timeouts, retries and
failure records as for sync jobs. (Draining and duplicates across processes are the sync
tests, run with the async demo job too: test_drain_emulator.py, test_duplicates_emulator.py.)"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.support import ledger_events, spawn_worker, wait_for, worker_processes
from workerpool import AsyncJobContext, RetryableError
from workerpool import constants as c
from workerpool.registry import Registry
from workerpool.testing.pubsub import PubSubResources, wait_settled


def _peak(runs: list[dict[str, Any]]) -> int:
    """The most runs in progress at once, from their start and end times."""
    events = sorted([(r["start"], 1) for r in runs] + [(r["end"], -1) for r in runs])
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


def _both_kinds_ran_at_once(runs: list[dict[str, Any]]) -> bool:
    sync = [r for r in runs if r["job_id"].startswith("sync-")]
    async_ = [r for r in runs if r["job_id"].startswith("async-")]
    return any(a["start"] < s["end"] and s["start"] < a["end"] for a in async_ for s in sync)


def _drain_worker(
    pubsub_resources: PubSubResources, tmp_path: Path, n: int, messages: dict[str, list[str]]
) -> list[dict[str, Any]]:
    """Run ``messages`` ({job name: job ids}, 0.3 s each) on one ``workerpool run`` process
    with ``--max-outstanding n``; return the ledger's finished runs."""
    pubsub_resources.provision(ack_deadline=60)
    ledger = tmp_path / "ledger.jsonl"
    total = sum(len(ids) for ids in messages.values())
    with worker_processes() as workers:
        worker = spawn_worker(pubsub_resources, ledger, "--max-outstanding", str(n), starts=False)
        workers.append(worker)
        for job, job_ids in messages.items():
            pubsub_resources.publish_many(job, [(job_id, {"seconds": 0.3}) for job_id in job_ids])
        all_done = wait_for(lambda: len(ledger_events(ledger, "done")) >= total, timeout=120)
        assert all_done, worker.output()[-3000:]
        worker.signal(signal.SIGTERM)
        assert worker.wait(30) == 0, worker.output()[-3000:]
    return ledger_events(ledger, "done")


@pytest.mark.parametrize("n", [1, 8, 64])
def test_async_jobs_in_a_real_worker_never_exceed_and_reach_n(
    pubsub_resources: PubSubResources, tmp_path: Path, n: int
) -> None:
    # Given a backlog of 4 x N async jobs of 0.3 s, When one worker process runs them
    job_ids = [f"async-{i}" for i in range(4 * n)]
    runs = _drain_worker(pubsub_resources, tmp_path, n, {"demo.async_sleep": job_ids})
    # Then N ran at once at the peak, never more, and each job ran once
    print(f"\nN={n}: peak {_peak(runs)} async runs at once")
    assert _peak(runs) == n
    assert sorted(Counter(r["job_id"] for r in runs).items()) == sorted(
        (job_id, 1) for job_id in job_ids
    )


def test_a_mixed_pool_counts_sync_and_async_runs_under_one_bound(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given 30 sync and 30 async jobs of 0.3 s on one subscription
    messages = {
        "demo.sleep": [f"sync-{i}" for i in range(30)],
        "demo.async_sleep": [f"async-{i}" for i in range(30)],
    }
    # When one worker with 6 slots runs them
    runs = _drain_worker(pubsub_resources, tmp_path, 6, messages)
    # Then never more than 6 ran at once, sync and async together, and both kinds overlapped
    print(f"\nmixed pool of 6: peak {_peak(runs)} runs at once")
    assert _peak(runs) == 6
    assert _both_kinds_ran_at_once(runs)
    assert len(runs) == 60 and len({r["job_id"] for r in runs}) == 60


def test_an_async_job_past_its_timeout_gets_cancelled_error_and_is_retried(
    pubsub_resources: PubSubResources,
) -> None:
    # Given an async job with a 1 s timeout whose first attempt would sleep for 60 s
    pubsub_resources.provision()
    jobs, seen = Registry(), []
    lock = threading.Lock()

    @jobs.job("t.async_slow", timeout=1, max_attempts=3)
    async def slow(ctx: AsyncJobContext, payload: dict[str, Any]) -> None:
        try:
            await asyncio.sleep(60 if ctx.delivery_attempt == 1 else 0)
        except asyncio.CancelledError:
            with lock:
                seen.append((ctx.delivery_attempt, "cancelled", ctx.timed_out.is_set()))
            raise
        with lock:
            seen.append((ctx.delivery_attempt, "done", ctx.timed_out.is_set()))

    pubsub_resources.publish("t.async_slow", {}, job_id="slow-1")
    # When a worker runs it
    with pubsub_resources.worker(jobs, max_outstanding=2, min_backoff=1.0) as worker:
        assert wait_for(lambda: len(seen) == 2, timeout=60), seen
        stats = wait_settled(worker, 2)  # the retry's end, once its success is recorded
    # Then CancelledError reached it at its timeout, and the retry ran to the end
    assert seen == [(1, "cancelled", True), (2, "done", False)]
    assert stats == {"retried": 1, "done": 1}


@pytest.mark.parametrize("retry_policy", [True, False], ids=["retry-policy", "no-retry-policy"])
def test_an_async_job_that_raises_is_retried_then_dead_lettered(
    pubsub_resources: PubSubResources, retry_policy: bool
) -> None:
    # Given an async job that always raises RetryableError after an await, max_attempts=3
    pubsub_resources.provision(retry_policy=retry_policy)
    jobs, attempts = Registry(), []

    @jobs.job("t.async_flaky", max_attempts=3)
    async def flaky(ctx: AsyncJobContext, payload: dict[str, Any]) -> None:
        await asyncio.sleep(0.01)
        attempts.append((ctx.job_id, ctx.delivery_attempt))
        raise RetryableError("upstream said no")

    for i in range(3):
        pubsub_resources.publish("t.async_flaky", {}, job_id=f"flaky-{i}")
    # When a worker runs them
    with pubsub_resources.worker(jobs, max_outstanding=3, min_backoff=1.0, max_backoff=4.0):
        records = pubsub_resources.dead_letters(expected=3, timeout=60)
    # Then each was delivered 3 times, then recorded once on the dead-letter topic
    assert sorted(attempts) == sorted((f"flaky-{i}", a) for i in range(3) for a in (1, 2, 3))
    assert sorted(r.attributes[c.ATTR_JOB_ID] for r in records) == ["flaky-0", "flaky-1", "flaky-2"]
    assert {r.attributes[c.ATTR_ERROR_TYPE] for r in records} == {c.ERR_ATTEMPTS_EXHAUSTED}
    assert all(r.attributes[c.ATTR_DELIVERY_ATTEMPT] == "3" for r in records)
    assert all("upstream said no" in r.attributes[c.ATTR_ERROR_MESSAGE] for r in records)
