"""Fresh Pub/Sub resources on an emulator for one test, and an in-process worker on them:
what the pytest plugin's ``pubsub_resources`` and ``worker`` fixtures hand out."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from workerpool.assembly.launcher import Launcher
from workerpool.config import Settings
from workerpool.idempotency import IdempotencyStore
from workerpool.ops.admin import ProvisionRequest, provision
from workerpool.pubsub import (
    Clients,
    publisher_client,
    subscriber_client,
    subscription_path,
    topic_path,
)
from workerpool.registry import Registry, import_job_modules, registry
from workerpool.telemetry import Telemetry


@dataclass
class Record:
    data: bytes
    attributes: dict[str, str]


class PubSubResources:
    """A fresh topic, subscription and dead-letter topic (with a subscription to read the
    failure records) on the emulator at ``host``, made by ``provision`` (or, with the
    defaults, by the first ``publish`` or ``worker``), and an in-process worker on them."""

    def __init__(self, project: str, host: str) -> None:
        self.project = project
        self.host = host
        suffix = uuid.uuid4().hex[:8]
        self.topic = f"t-{suffix}"
        self.subscription = f"s-{suffix}"
        self.dead_letter_topic = f"dlq-{suffix}"
        # Clients' channels: the library's emulator channel cannot receive over 4 MiB
        self.publisher = publisher_client()
        self.subscriber = subscriber_client()
        self.provisioned = False

    @property
    def topic_path(self) -> str:
        return topic_path(self.project, self.topic)

    @property
    def subscription_path(self) -> str:
        return subscription_path(self.project, self.subscription)

    @property
    def dead_letter_subscription_path(self) -> str:
        return subscription_path(self.project, f"{self.dead_letter_topic}-sub")

    def provision(self, **overrides: Any) -> None:
        request = {
            "project": self.project,
            "topic": self.topic,
            "subscription": self.subscription,
            "dead_letter_topic": self.dead_letter_topic,
            "ack_deadline": 10,
            "max_delivery_attempts": 20,
            "min_backoff": 1,
            "max_backoff": 10,
            **overrides,
        }
        provision(self.publisher, self.subscriber, ProvisionRequest(**request))
        self.provisioned = True

    def _ready(self) -> None:
        if not self.provisioned:
            self.provision()

    def publish(self, job: str, data: Any = None, *, job_id: str = "", **attributes: str) -> str:
        body = json.dumps({} if data is None else data).encode()
        return self.publish_raw(
            body, {"job": job, **({"job_id": job_id} if job_id else {}), **attributes}
        )

    def publish_raw(self, data: bytes, attributes: dict[str, str]) -> str:
        self._ready()
        message_id: str = self.publisher.publish(self.topic_path, data, **attributes).result(30)
        return message_id

    def publish_many(self, job: str, payloads: list[tuple[str, Any]]) -> None:
        self._ready()
        futures = [
            self.publisher.publish(
                self.topic_path, json.dumps(data).encode(), job=job, job_id=job_id
            )
            for job_id, data in payloads
        ]
        for future in futures:
            future.result(30)

    def dead_letters(self, expected: int, timeout: float = 30.0) -> list[Record]:
        """Pull and ack failure records until ``expected`` arrived or ``timeout`` passed."""
        records: list[Record] = []
        deadline = time.monotonic() + timeout
        while len(records) < expected and time.monotonic() < deadline:
            response = self.subscriber.pull(
                request={"subscription": self.dead_letter_subscription_path, "max_messages": 100},
                timeout=10,
            )
            if not response.received_messages:
                time.sleep(0.2)
                continue
            self.subscriber.acknowledge(
                request={
                    "subscription": self.dead_letter_subscription_path,
                    "ack_ids": [m.ack_id for m in response.received_messages],
                }
            )
            records.extend(
                Record(bytes(m.message.data), dict(m.message.attributes))
                for m in response.received_messages
            )
        return records

    def settings(self, **overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "project": self.project,
            "subscription": self.subscription,
            "max_outstanding": 4,
            "min_backoff": 1.0,
            "max_backoff": 10.0,
            "drain_timeout": 10.0,
            "idempotency_store": "memory://",
            **overrides,
        }
        return Settings(**values).validate()

    @contextlib.contextmanager
    def worker(
        self,
        jobs: Registry | Sequence[str] = registry,
        *,
        store: IdempotencyStore | None = None,
        telemetry: Telemetry | None = None,
        **overrides: Any,
    ) -> Iterator[Launcher]:
        """A started worker on these resources running ``jobs`` (a registry, or the names of
        job modules to import into the default one), with any setting ``workerpool run``
        takes as a keyword; drained and stopped on exit."""
        if not isinstance(jobs, Registry):
            import_job_modules(jobs)
            jobs = registry
        self._ready()
        settings = self.settings(**overrides)
        launcher = Launcher(
            settings, jobs=jobs, clients=Clients(), store=store, telemetry=telemetry
        ).start()
        try:
            yield launcher
        finally:
            launcher.stop(time.monotonic() + launcher.settings.drain_timeout)

    def close(self) -> None:
        self.subscriber.close()
        self.publisher.stop()


def wait_settled(worker: Launcher, count: int, timeout: float = 30.0) -> dict[str, int]:
    """Wait until ``count`` messages have left ``worker`` (run or not); return how many left
    under each label (``done``, ``retried``, ...). ``TimeoutError`` saying how far it got."""
    deadline = time.monotonic() + timeout
    while True:
        stats = dict(worker.processor.stats)
        if sum(stats.values()) >= count:
            return stats
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{sum(stats.values())} of {count} messages settled: {stats}")
        time.sleep(0.05)
