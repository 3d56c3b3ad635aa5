"""Exactly-once subscriptions: acks are confirmed, and a refused ack is not counted as done."""

from __future__ import annotations

import time
from typing import Any

from google.api_core import exceptions as gexc
from google.rpc import error_details_pb2

from tests.support import wait_for
from workerpool import JobContext
from workerpool.registry import Registry
from workerpool.testing.pubsub import PubSubResources
from workerpool.worker.acks import Acknowledger


class _RefusingClient:
    """acknowledge() refuses some ack ids the way an exactly-once subscription does."""

    def __init__(self, refused: dict[str, str]) -> None:
        self.refused = refused
        self.calls: list[list[str]] = []

    def acknowledge(self, request: Any, **options: Any) -> None:
        self.calls.append(list(request.ack_ids))
        errors = {a: why for a, why in self.refused.items() if a in request.ack_ids}
        if errors:
            info = error_details_pb2.ErrorInfo(
                reason="EXACTLY_ONCE_ACKID_FAILURE", domain="pubsub.googleapis.com"
            )
            info.metadata.update(errors)
            for ack_id, why in list(errors.items()):
                if why.startswith("TRANSIENT_"):
                    del self.refused[ack_id]  # succeeds when retried
            raise gexc.InvalidArgument("ack failed", details=[info])


def test_refused_ack_ids_resolve_false_and_transient_ones_are_retried() -> None:
    client = _RefusingClient(
        {"b": "PERMANENT_FAILURE_INVALID_ACK_ID", "c": "TRANSIENT_FAILURE_UNORDERED_ACK_ID"}
    )
    acks = Acknowledger(client, "projects/p/subscriptions/s")
    # Queued before its thread starts, so all three go in its first request: an ack whose
    # answer is awaited goes at once, with what is queued then.
    futures = {ack_id: acks.ack(ack_id, confirm=True) for ack_id in "abc"}
    acks.start()
    results = {ack_id: f.result(timeout=10) for ack_id, f in futures.items() if f}
    assert acks.close(timeout=10)
    assert results == {"a": True, "b": False, "c": True}
    assert client.calls == [["a", "b", "c"], ["c"]]


def test_job_outliving_its_lease_on_exactly_once_subscription_is_not_counted_done(
    pubsub_resources: PubSubResources,
) -> None:
    # Given an exactly-once subscription and a job that ignores its 1 s timeout for 25 s,
    # so its lease (timeout + one 10 s extension) lapses and the message is redelivered
    pubsub_resources.provision(exactly_once=True, ack_deadline=10, retry_policy=False)
    jobs, runs = Registry(), []

    @jobs.job("t.stubborn", timeout=1)
    def stubborn(ctx: JobContext, payload: dict[str, Any]) -> None:
        runs.append(ctx.message_id)
        time.sleep(25)

    @jobs.job("t.quick")
    def quick(ctx: JobContext, payload: dict[str, Any]) -> None:
        runs.append(ctx.message_id)

    pubsub_resources.publish("t.quick", {}, job_id="quick-1")
    pubsub_resources.publish("t.stubborn", {}, job_id="stubborn-1")
    # When a worker runs them with room for the redelivered copy
    with pubsub_resources.worker(
        jobs, max_outstanding=2, lease_extension=10, min_backoff=1
    ) as worker:
        stats = worker.processor.stats
        assert wait_for(lambda: stats["ack_failed"] == 1, timeout=60), dict(stats)
        # Then the copy was deferred while the first run held the claim, and acked after it
        assert wait_for(lambda: stats["duplicate"] == 1, timeout=30), dict(stats)
        final = dict(stats)
    assert final["done"] == 1  # only t.quick: the stubborn run's ack was refused
    assert final["deferred"] >= 1
    assert len(runs) == 2  # the stubborn job ran once, never twice at the same time
