"""The autoscaler, live on the Pub/Sub emulator: its probe of a fleet at zero, then the
process actuator, a real ``workerpool autoscale`` process starting and draining real
``workerpool run`` processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.support import child_pids, ledger_events, read_ledger, wait_for
from workerpool.autoscale.probe import Probe
from workerpool.autoscale.signals import SignalReader
from workerpool.heartbeats import MemoryHeartbeats
from workerpool.publishing import JobMessage, publish_many
from workerpool.testing.pubsub import PubSubResources

MAX, SLOTS, JOBS, SECONDS, WINDOW = 4, 4, 200, 1.0, 10.0


class CountingSubscriber:
    """The subscriber client, counting the probe's pulls."""

    def __init__(self, client: object) -> None:
        self._client = client
        self.pulls = 0

    def pull(self, **kwargs: object) -> object:
        self.pulls += 1
        return self._client.pull(**kwargs)  # type: ignore[attr-defined]

    def modify_ack_deadline(self, **kwargs: object) -> object:
        return self._client.modify_ack_deadline(**kwargs)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("max_replicas", "sees"), [(50, 200), (None, 300)], ids=["K=200", "K=1000"]
)
def test_one_probe_at_zero_counts_the_burst_and_every_message_is_at_once_deliverable(
    pubsub_resources: PubSubResources, max_replicas: int | None, sees: int
) -> None:
    # Given 300 messages waiting and a fleet at zero (replicas of 4 slots: K = min(1000, max x 4))
    pubsub_resources.provision()  # dead-letter policy on: each delivery is counted
    pubsub_resources.publish_many("demo.sleep", [(f"job-{i}", {}) for i in range(300)])
    subscriber = CountingSubscriber(pubsub_resources.subscriber)
    reader = SignalReader(
        pubsub_resources.subscription_path, MemoryHeartbeats(),
        probe=Probe(subscriber, pubsub_resources.subscription_path), backlog=None,
        slots_per_replica=4, max_replicas=max_replicas,
    )  # fmt: skip
    # When the reader reads at zero replicas
    began = time.monotonic()
    woke = reader.read(0)
    probed_in, pulls = time.monotonic() - began, subscriber.pulls
    # ... then 5 rounds while the replicas it woke start slowly (none beats)
    starting = []
    for _ in range(5):
        time.sleep(0.5)
        starting.append(reader.read(8))
    # Then one probe saw min(K, 300) (the emulator gives 100 a pull), every later round kept
    # that finding without probing again
    assert (woke.probed, woke.signals.backlog) == (sees, sees)
    assert [(s.probed, s.signals.backlog) for s in starting] == [(None, sees)] * 5
    assert subscriber.pulls == pulls
    # ... and all 300 come at once to the next pull (not after their 10 s ack deadline): each
    # probed message delivered once more, the others not at all
    attempts: dict[str, int] = {}
    again = time.monotonic()
    deadline = again + 5
    while len(attempts) < 300 and time.monotonic() < deadline:
        response = pubsub_resources.subscriber.pull(
            request={"subscription": pubsub_resources.subscription_path, "max_messages": 100},
            timeout=5,
        )
        received = response.received_messages
        attempts |= {m.message.attributes["job_id"]: m.delivery_attempt for m in received}
        if received:
            pubsub_resources.subscriber.acknowledge(
                request={
                    "subscription": pubsub_resources.subscription_path,
                    "ack_ids": [m.ack_id for m in received],
                }
            )
    print(
        f"\nprobe saw {woke.probed} in {probed_in:.2f}s ({pulls} pulls), none in 5 rounds "
        f"after; all 300 pulled in {time.monotonic() - again:.2f}s; delivery attempts "
        f"{dict(Counter(attempts.values()))}"
    )
    assert Counter(attempts.values()) == Counter({2: sees, 1: 300 - sees})


def test_a_probe_of_an_ordered_subscription_leaves_each_keys_order_as_it_was(
    pubsub_resources: PubSubResources,
) -> None:
    # Given ten jobs of one ordering key waiting on an ordered subscription (no retry policy:
    # the emulator then redelivers a lapsed lease at once)
    pubsub_resources.provision(ordered=True, retry_policy=False)
    messages = [JobMessage("demo.sleep", {}, f"job-{i}", ordering_key="k") for i in range(10)]
    for _ in publish_many(pubsub_resources.publisher, pubsub_resources.topic_path, messages):
        pass
    # When a probe sees the first three and gives them back
    assert Probe(pubsub_resources.subscriber, pubsub_resources.subscription_path).count(3) == 3
    # Then the key's jobs come in their order still
    seen: list[str] = []
    deadline = time.monotonic() + 20
    while len(seen) < 10 and time.monotonic() < deadline:
        response = pubsub_resources.subscriber.pull(
            request={"subscription": pubsub_resources.subscription_path, "max_messages": 10},
            timeout=5,
        )
        received = response.received_messages
        seen += [m.message.attributes["job_id"] for m in received]
        if received:
            pubsub_resources.subscriber.acknowledge(
                request={
                    "subscription": pubsub_resources.subscription_path,
                    "ack_ids": [m.ack_id for m in received],
                }
            )
    assert seen == [f"job-{i}" for i in range(10)]


def test_the_fleet_wakes_from_zero_grows_to_its_max_drains_and_returns_to_zero(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given an autoscaler (process actuator, 0..4 replicas of 4 slots, a 10 s window) and no
    # worker
    pubsub_resources.provision(retry_policy=False)
    ledger, log = tmp_path / "ledger.jsonl", tmp_path / "autoscale.log"
    env = {
        **os.environ,
        "PUBSUB_EMULATOR_HOST": pubsub_resources.host,
        "WORKERPOOL_DEMO_LEDGER": str(ledger),
        "WORKERPOOL_DEMO_LEDGER_STARTS": "1",
    }
    command = [
        sys.executable, "-m", "workerpool", "autoscale",
        "--project", pubsub_resources.project, "--subscription", pubsub_resources.subscription,
        "--idempotency-store", f"sqlite:///{tmp_path / 'fleet.db'}",
        "--max", str(MAX), "--scale-down-delay", str(WINDOW), "--interval", "0.5",
        "--", "--jobs", "workerpool_jobs.demo", "--max-outstanding", str(SLOTS),
        "--heartbeat-interval", "0.5", "--min-backoff", "1",
    ]  # fmt: skip
    with open(log, "wb") as out:
        scaler = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    fleet: list[tuple[float, int]] = []  # (time, replicas)

    def sample_until(done: object, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            fleet.append((time.time(), len(child_pids(scaler.pid))))
            if callable(done) and done():
                return True
            time.sleep(0.2)
        return False

    try:
        # When the subscription stays idle for 30 s (three windows)
        assert wait_for(lambda: "autoscaling" in log.read_text(), timeout=30)
        idle_from = time.time()
        sample_until(None, 30)
        idle = [n for at, n in fleet if at >= idle_from]
        idle_log = log.read_text()
        # ... then 200 jobs of 1 s are published
        published = time.time()
        pubsub_resources.publish_many(
            "demo.sleep", [(f"job-{i}", {"seconds": SECONDS}) for i in range(JOBS)]
        )
        finished = sample_until(lambda: len(ledger_events(ledger, "done")) >= JOBS, 120)
        last_end = time.time()
        # ... and left idle again
        back_to_zero = sample_until(lambda: not child_pids(scaler.pid), WINDOW + 30)
        zero_at = time.time()
        scaler.send_signal(signal.SIGTERM)
        code = scaler.wait(60)
    finally:
        if scaler.poll() is None:
            scaler.kill()
    output = log.read_text()
    starts = ledger_events(ledger, "start")
    ends = [r for r in read_ledger(ledger) if r["outcome"] != "start"]
    busy = [n for at, n in fleet if published <= at <= last_end]
    first_start = min(r["start"] for r in starts) - published
    print(
        f"\nidle {len(idle)} samples, most replicas {max(idle)}; first start "
        f"{first_start:.2f}s after the publish; most replicas {max(busy)}; all done "
        f"{last_end - published:.1f}s after the publish; back to 0 {zero_at - last_end:.1f}s "
        f"after the last end; decisions logged {output.count('autoscale: ')}"
    )
    # Then nothing ran while idle, the first job started within 5 s of the publish, the fleet
    # grew to its max and ran every job once, start to end (a scale-in interrupted none),
    # then went back to 0 after its window; the autoscaler exits 0
    assert max(idle) == 0 and "started" not in idle_log, idle_log
    assert finished, output[-3000:]
    assert first_start <= 5.0
    assert max(busy) == MAX
    assert Counter(r["job_id"] for r in starts) == Counter(f"job-{i}" for i in range(JOBS))
    assert Counter((r["job_id"], r["outcome"]) for r in ends) == Counter(
        (f"job-{i}", "done") for i in range(JOBS)
    )
    assert back_to_zero, output[-3000:]
    assert zero_at - last_end >= WINDOW
    assert code == 0, output[-3000:]
