"""Leases outlive the subscription's ack deadline for as long as the job runs."""

from __future__ import annotations

import threading
import time
from typing import Any

from tests.support import wait_for
from workerpool import JobContext
from workerpool.registry import Registry
from workerpool.testing.pubsub import PubSubResources


def test_job_running_3x_the_ack_deadline_completes_once_without_redelivery(
    pubsub_resources: PubSubResources,
) -> None:
    # Given a subscription whose ack deadline is 10 s and a job that runs 32 s
    pubsub_resources.provision(ack_deadline=10)
    jobs = Registry()
    starts: list[str] = []
    finished = threading.Event()

    @jobs.job("t.long", timeout=120)
    def long_job(ctx: JobContext, payload: dict[str, Any]) -> None:
        starts.append(ctx.message_id)
        time.sleep(32)
        finished.set()

    message_id = pubsub_resources.publish("t.long", {}, job_id="long-1")
    # When a worker with room for a second copy runs it (a redelivery would start at once)
    with pubsub_resources.worker(jobs, max_outstanding=2, lease_extension=10) as worker:
        assert finished.wait(60)
        assert wait_for(lambda: worker.processor.stats["done"] == 1, timeout=10)
        # Then nothing came back after the ack either, for longer than one ack deadline
        time.sleep(12)
        stats = dict(worker.processor.stats)
    assert starts == [message_id]
    assert stats == {"done": 1}
