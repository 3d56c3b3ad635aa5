"""The Pub/Sub clients a worker and the CLI commands use."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from google.cloud.pubsub_v1 import PublisherClient, SubscriberClient


@dataclass
class Clients:
    subscriber: Any = field(default_factory=SubscriberClient)
    publisher: Any = field(default_factory=PublisherClient)

    def close(self) -> None:
        self.subscriber.close()
        self.publisher.stop()
