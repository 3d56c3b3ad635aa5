"""Poison messages and retries on the real emulator."""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest

from tests.support import wait_for
from workerpool import JobContext, PermanentError, RetryableError
from workerpool import constants as c
from workerpool.registry import Registry
from workerpool.testing.pubsub import PubSubResources, wait_settled


@dataclass
class _Typed:
    size: int


def test_each_poison_case_yields_one_failure_record_on_first_delivery(
    pubsub_resources: PubSubResources,
) -> None:
    # Given a subscription with both poison messages and good jobs
    pubsub_resources.provision()
    jobs, done = Registry(), []

    @jobs.job("t.ok")
    def ok(ctx: JobContext, payload: dict[str, Any]) -> None:
        done.append(ctx.job_id)

    @jobs.job("t.typed", payload=_Typed)
    def typed(ctx: JobContext, payload: _Typed) -> None:
        raise AssertionError("never runs with a bad payload")

    @jobs.job("t.permanent")
    def permanent(ctx: JobContext, payload: dict[str, Any]) -> None:
        raise PermanentError("cannot do that")

    poison = {
        c.ERR_NOT_JSON: (b"\xff not json", {"job": "t.ok", "job_id": "p1"}),
        c.ERR_NOT_OBJECT: (b"[1, 2]", {"job": "t.ok", "job_id": "p2"}),
        c.ERR_MISSING_JOB: (b"{}", {"job_id": "p3"}),
        c.ERR_UNKNOWN_JOB: (b"{}", {"job": "t.nope", "job_id": "p4"}),
        c.ERR_INVALID_PAYLOAD: (b'{"size": "big"}', {"job": "t.typed", "job_id": "p5"}),
        c.ERR_OVERSIZE: (b'{"x": "' + b"a" * 3000 + b'"}', {"job": "t.ok", "job_id": "p6"}),
        c.ERR_PERMANENT: (b"{}", {"job": "t.permanent", "job_id": "p7"}),
    }
    for i in range(10):
        pubsub_resources.publish("t.ok", {}, job_id=f"good-{i}")
    for data, attributes in poison.values():
        pubsub_resources.publish_raw(data, attributes)
    # When a worker runs them
    with pubsub_resources.worker(jobs, max_payload_bytes=2048) as worker:
        records = pubsub_resources.dead_letters(expected=len(poison), timeout=30)
        assert wait_for(lambda: len(done) == 10, timeout=30)
        stats = wait_settled(worker, 10 + len(poison))  # a success counts once recorded
    # Then each poison case has exactly one record with its error type, from delivery 1
    by_type = {r.attributes[c.ATTR_ERROR_TYPE]: r for r in records}
    assert sorted(by_type) == sorted(poison) and len(records) == len(poison)
    for error_type, (data, attributes) in poison.items():
        record = by_type[error_type]
        assert record.data == data
        assert record.attributes[c.ATTR_DELIVERY_ATTEMPT] == "1"
        assert record.attributes[c.ATTR_SOURCE_SUBSCRIPTION] == pubsub_resources.subscription_path
        assert record.attributes[c.ATTR_SOURCE_TOPIC] == pubsub_resources.topic_path
        assert record.attributes[c.ATTR_JOB_ID] == attributes["job_id"]
        for key in (c.ATTR_ERROR_MESSAGE, c.ATTR_WORKER, c.ATTR_FAILED_AT):
            assert record.attributes[key]
    assert by_type[c.ERR_INVALID_PAYLOAD].attributes[c.ATTR_ERROR_MESSAGE] == (
        "size: expected int, got str"
    )
    # ... and the good jobs all completed, none retried
    assert sorted(done) == sorted(f"good-{i}" for i in range(10))
    assert stats == {"done": 10, "dead_lettered": len(poison)}


@pytest.mark.parametrize("retry_policy", [True, False], ids=["retry-policy", "no-retry-policy"])
def test_retryable_failure_backs_off_then_dead_letters(
    pubsub_resources: PubSubResources, retry_policy: bool
) -> None:
    # Given a job that always raises RetryableError, max_attempts=4, backoff from 1 s
    pubsub_resources.provision(retry_policy=retry_policy)
    jobs, seen = Registry(), []
    lock = threading.Lock()

    @jobs.job("t.flaky", max_attempts=4)
    def flaky(ctx: JobContext, payload: dict[str, Any]) -> None:
        with lock:
            seen.append((ctx.job_id, ctx.delivery_attempt, time.monotonic()))
        raise RetryableError("upstream said no")

    # Six at once, since a batch is what the emulator mishandled with a retry policy
    for i in range(6):
        pubsub_resources.publish("t.flaky", {}, job_id=f"flaky-{i}")
    with pubsub_resources.worker(jobs, max_outstanding=6, min_backoff=1.0, max_backoff=8.0):
        records = pubsub_resources.dead_letters(expected=6, timeout=60)
    # Then each was delivered exactly 4 times, with growing gaps, then dead-lettered
    assert len(records) == 6
    assert {r.attributes[c.ATTR_ERROR_TYPE] for r in records} == {c.ERR_ATTEMPTS_EXHAUSTED}
    assert all("upstream said no" in r.attributes[c.ATTR_ERROR_MESSAGE] for r in records)
    assert all(r.attributes[c.ATTR_DELIVERY_ATTEMPT] == "4" for r in records)
    assert sorted(a for _, a, _ in seen) == sorted([1, 2, 3, 4] * 6)
    # Gaps per job: jitter spreads the jobs apart, so gaps across jobs need not grow.
    gaps = {
        job_id: [later - earlier for earlier, later in itertools.pairwise(times)]
        for job_id, times in _attempt_times(seen).items()
    }
    print(f"gaps between attempts (retry policy={retry_policy}): {gaps}")
    for job_gaps in gaps.values():
        assert all(gap >= 0.5 for gap in job_gaps[1:]), f"a hot loop: {gaps}"
        assert job_gaps[2] > job_gaps[0], f"gaps do not grow: {gaps}"


def _attempt_times(seen: list[tuple[str, int, float]]) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {}
    for job_id, _, at in sorted(seen, key=lambda run: (run[0], run[1])):
        times.setdefault(job_id, []).append(at)
    return times
