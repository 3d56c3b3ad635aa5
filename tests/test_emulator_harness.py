"""The emulator harness: a local process group here, testcontainers where Docker answers."""

from __future__ import annotations

import os

import pytest
from google.cloud import pubsub_v1

from workerpool.testing import docker_engine_answers, pubsub_emulator
from workerpool.testing.emulator import LocalEmulator, gcloud_available


def _round_trip(host: str) -> bytes:
    previous = os.environ.get("PUBSUB_EMULATOR_HOST")
    os.environ["PUBSUB_EMULATOR_HOST"] = host
    try:
        publisher, subscriber = pubsub_v1.PublisherClient(), pubsub_v1.SubscriberClient()
        topic = publisher.create_topic(name="projects/harness/topics/harness-t").name
        sub = subscriber.create_subscription(
            name="projects/harness/subscriptions/harness-s", topic=topic
        ).name
        publisher.publish(topic, b"ping").result(30)
        received = subscriber.pull(subscription=sub, max_messages=1, timeout=10)
        subscriber.close()
        publisher.stop()
        return bytes(received.received_messages[0].message.data)
    finally:
        if previous is None:
            os.environ.pop("PUBSUB_EMULATOR_HOST", None)
        else:
            os.environ["PUBSUB_EMULATOR_HOST"] = previous


@pytest.mark.skipif(
    not docker_engine_answers(),
    reason="no Docker engine answers here: the suite runs the emulator as a local gcloud "
    "process group instead (see the local-process test)",
)
def test_testcontainers_emulator_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PUBSUB_EMULATOR_HOST", raising=False)
    with pubsub_emulator("harness") as (host, how):
        assert how == "testcontainers"
        assert _round_trip(host) == b"ping"


def test_local_emulator_process_group_round_trip_and_is_killed() -> None:
    assert gcloud_available(), "the gcloud CLI with its Pub/Sub emulator is required"
    emulator = LocalEmulator("pubsub", project="harness").start()
    try:
        assert _round_trip(emulator.host) == b"ping"
        process = emulator._process
        assert process is not None
    finally:
        emulator.stop()
    # The whole group is gone, Java server included, not just the gcloud wrapper.
    with pytest.raises(ProcessLookupError):
        os.killpg(process.pid, 0)
