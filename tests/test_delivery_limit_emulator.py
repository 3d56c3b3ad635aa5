"""The subscription's dead-letter policy counts every delivery: waiting must not use it up."""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from tests.support import wait_for
from workerpool import Defer, JobContext, RetryableError
from workerpool import constants as c
from workerpool.registry import Registry
from workerpool.telemetry import Telemetry
from workerpool.testing.pubsub import PubSubResources

DELIVERIES = 5  # the fewest a dead-letter policy allows


def test_a_job_that_waits_longer_than_the_policy_allows_still_runs_once(
    pubsub_resources: PubSubResources,
) -> None:
    # Given a subscription that dead-letters after 5 deliveries, and jobs that wait 11 times
    pubsub_resources.provision(retry_policy=False, max_delivery_attempts=DELIVERIES)
    jobs, lock = Registry(), threading.Lock()
    calls: dict[str, list[int]] = defaultdict(list)
    messages: dict[str, set[str]] = defaultdict(set)
    done: list[str] = []

    @jobs.job("t.patient")
    def patient(ctx: JobContext, payload: dict[str, Any]) -> None:
        with lock:
            calls[ctx.job_id].append(ctx.delivery_attempt)
            messages[ctx.job_id].add(ctx.message_id)
            if len(calls[ctx.job_id]) <= payload["waits"]:
                raise Defer("its turn has not come", delay=payload["delay"])
            done.append(ctx.job_id)

    # one right back, one a second later (its copy waits for that in the schedule), and one
    # without a job id (it goes by its first message id)
    pubsub_resources.publish("t.patient", {"waits": 11, "delay": 0}, job_id="soon")
    pubsub_resources.publish("t.patient", {"waits": 11, "delay": 1}, job_id="later")
    first_id = pubsub_resources.publish("t.patient", {"waits": 11, "delay": 0})
    # When a worker runs them
    reader = InMemoryMetricReader()
    telemetry = Telemetry(meter_provider=MeterProvider(metric_readers=[reader]))
    with pubsub_resources.worker(jobs, max_outstanding=3, telemetry=telemetry):
        finished = wait_for(lambda: len(done) >= 3, timeout=90)
        records = pubsub_resources.dead_letters(expected=1, timeout=3)
    # Then each ran to its end once, after 11 waits over more deliveries than the policy allows
    assert finished, f"done {done}; calls {dict(calls)}"
    assert sorted(done) == sorted(["soon", "later", first_id])
    assert set(calls) == {"soon", "later", first_id}  # the copies kept the job id
    for attempts in calls.values():
        assert len(attempts) == 12 and max(attempts) == DELIVERIES
        assert attempts.count(1) >= 3, f"not renewed as fresh messages: {attempts}"
    # and nothing reached the dead-letter topic
    assert records == []
    # And every copy is counted once: a job's messages, but its first, were copies
    copies = sum(len(ids) - 1 for ids in messages.values())
    assert copies >= 6
    assert _renewed(reader) == {"t.patient": copies}


@pytest.mark.parametrize(
    ("store", "runs", "error_type"),
    [("none", DELIVERIES, c.ERR_DELIVERY_LIMIT), ("memory://", 7, c.ERR_ATTEMPTS_EXHAUSTED)],
    ids=["tries-per-delivery", "tries-per-job-id"],
)
def test_a_failing_job_allowed_more_tries_than_deliveries_ends_as_one_record(
    pubsub_resources: PubSubResources, store: str, runs: int, error_type: str
) -> None:
    # Given a job allowed 7 tries on a subscription that dead-letters after 5 deliveries
    pubsub_resources.provision(retry_policy=False, max_delivery_attempts=DELIVERIES)
    jobs, tries = Registry(), []

    @jobs.job("t.flaky", max_attempts=7)
    def flaky(ctx: JobContext, payload: dict[str, Any]) -> None:
        tries.append(ctx.delivery_attempt)
        raise RetryableError("upstream said no")

    pubsub_resources.publish("t.flaky", {}, job_id="flaky-1")
    # When it always fails
    with pubsub_resources.worker(jobs, idempotency_store=store, min_backoff=0.5, max_backoff=1.0):
        records = pubsub_resources.dead_letters(expected=1, timeout=60)
        more = pubsub_resources.dead_letters(expected=1, timeout=3)
    # Then it ends as one failure record of ours, saying why: with a store that counts its
    # tries by job id, after all 7 (a copy goes on from the 5th delivery); without, at the
    # delivery limit, which Pub/Sub would have forwarded raw
    assert len(records) == 1 and more == []
    attributes = records[0].attributes
    assert attributes[c.ATTR_ERROR_TYPE] == error_type
    assert "upstream said no" in attributes[c.ATTR_ERROR_MESSAGE]
    assert attributes[c.ATTR_JOB_ID] == "flaky-1"
    assert len(tries) == runs and max(tries) <= DELIVERIES


def _renewed(reader: InMemoryMetricReader) -> dict[str, int]:
    """The renewed-messages counter, by job."""
    data = reader.get_metrics_data()
    assert data is not None
    return {
        str((point.attributes or {})[c.LABEL_JOB]): point.value  # type: ignore[union-attr]
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == c.METRIC_MESSAGES_RENEWED
        for point in metric.data.data_points
    }
