"""Messages near Pub/Sub's 10 MB limit run through a real worker on the emulator.

The library's own emulator channel caps what it receives at 4 MiB (see workerpool/pubsub.py):
without the channel ``Clients`` builds, every pull holding one of these fails with
ResourceExhausted, and the whole batch, small messages included, comes back and fails again.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from typing import Any

import pytest
from google.api_core import exceptions as gexc

from tests.support import wait_for
from workerpool import JobContext
from workerpool.pubsub import subscriber_client
from workerpool.registry import Registry
from workerpool.testing.pubsub import PubSubResources
from workerpool.worker.pool import Pool

BIG = 9_500_000  # bytes of message data: over gRPC's 4 MiB default, under Pub/Sub's 10 MB


def big_payload(tag: str) -> dict[str, Any]:
    payload = {"tag": tag, "blob": ""}
    payload["blob"] = "x" * (BIG - len(json.dumps(payload)))
    return payload


class Runs:
    """What the job saw: job id -> runs, and the size of each payload's blob."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.sizes: dict[str, int] = {}
        self._lock = threading.Lock()

    def registry(self) -> Registry:
        jobs = Registry()

        @jobs.job("t.big")
        def run(ctx: JobContext, payload: dict[str, Any]) -> None:
            with self._lock:
                self.counts[ctx.job_id] += 1
                self.sizes[ctx.job_id] = len(payload["blob"])

        return jobs

    def total(self) -> int:
        with self._lock:
            return sum(self.counts.values())


def dead_letter_count(pubsub_resources: PubSubResources) -> int:
    """Messages waiting on the dead-letter subscription (pulled with a channel that can
    receive a 9.5 MB failure record, which PubSubResources's own subscriber cannot)."""
    subscriber = subscriber_client()
    try:
        response = subscriber.pull(
            request={
                "subscription": pubsub_resources.dead_letter_subscription_path,
                "max_messages": 100,
            },
            timeout=1,
            retry=None,
        )
        return len(response.received_messages)
    except gexc.DeadlineExceeded:
        return 0
    finally:
        subscriber.close()


def test_a_9_5_mb_message_runs_through_a_worker(pubsub_resources: PubSubResources) -> None:
    # Given one 9.5 MB job (the publisher's default channel sends without a cap)
    pubsub_resources.provision()
    runs = Runs()
    pubsub_resources.publish("t.big", big_payload("one"), job_id="big-1")
    # When a worker with the default 10 MiB payload limit runs it
    with pubsub_resources.worker(runs.registry()) as worker:
        assert wait_for(lambda: worker.processor.stats["done"] >= 1, timeout=30), dict(
            worker.processor.stats
        )
        stats = dict(worker.processor.stats)
    # Then it ran once, with its whole payload, and was acked
    assert runs.counts == {"big-1": 1}
    assert runs.sizes["big-1"] > 9_400_000
    assert stats == {"done": 1}
    assert dead_letter_count(pubsub_resources) == 0


def test_a_batch_mixing_big_and_small_messages_loses_none(
    pubsub_resources: PubSubResources, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given two 9.5 MB jobs among 20 small ones, all waiting before the worker starts
    pubsub_resources.provision()
    runs = Runs()
    payloads = [(f"small-{i}", {"tag": f"small-{i}", "blob": "y" * 100}) for i in range(10)]
    payloads.append(("big-1", big_payload("big-1")))
    payloads += [(f"small-{i}", {"tag": f"small-{i}", "blob": "y" * 100}) for i in range(10, 20)]
    payloads.append(("big-2", big_payload("big-2")))
    pubsub_resources.publish_many("t.big", payloads)
    batches: list[tuple[int, int]] = []  # (messages, of which big) per pull the pool admitted
    admit = Pool.admit

    def recording_admit(self: Pool, deliveries: list[Any]) -> None:
        batches.append((len(deliveries), sum(d.size >= BIG for d in deliveries)))
        admit(self, deliveries)

    monkeypatch.setattr(Pool, "admit", recording_admit)
    # When a worker with room for all of them pulls them
    started = time.monotonic()
    with pubsub_resources.worker(runs.registry(), max_outstanding=32) as worker:
        assert wait_for(lambda: worker.processor.stats["done"] >= 22, timeout=30), (
            dict(worker.processor.stats),
            batches,
        )
        elapsed = time.monotonic() - started
        time.sleep(2)  # room for a duplicate run to show up
        stats = dict(worker.processor.stats)
    print(f"22 jobs in {elapsed:.1f}s; pulls (messages, big): {batches}")
    # Then some pull held big and small messages together, every job ran exactly once with
    # its whole payload, and nothing was dead-lettered
    assert any(big and count > big for count, big in batches), batches
    assert runs.counts == {job_id: 1 for job_id, _ in payloads}
    assert runs.sizes["big-1"] > 9_400_000 and runs.sizes["big-2"] > 9_400_000
    assert stats == {"done": 22}
    assert dead_letter_count(pubsub_resources) == 0
