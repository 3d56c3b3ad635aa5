"""In-process stand-ins for the parts of the data path that talk to Pub/Sub: what the
processor acks, nacks and records, kept in lists. ``run_job`` runs a job through a real
``Processor`` with them; the project's own pure-logic tests use them too.

They have the shapes of ``workerpool.worker.interfaces``, so the processor, pool and leaser
take them without a ``type: ignore``.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import UTC, datetime

from workerpool.worker.delivery import Delivery
from workerpool.worker.failures import Failure


@dataclass
class FakeAcks:
    acked: list[str] = field(default_factory=list)
    modacked: list[tuple[str, float]] = field(default_factory=list)
    extended: list[tuple[str, float]] = field(default_factory=list)

    def ack(self, ack_id: str, *, confirm: bool = False) -> Future[bool] | None:
        self.acked.append(ack_id)
        return None

    def modack(self, ack_ids: list[str], seconds: float) -> None:
        self.modacked.extend((ack_id, seconds) for ack_id in ack_ids)

    def extend(self, deliveries: list[Delivery], seconds: float) -> None:
        self.extended.extend((d.ack_id, seconds) for d in deliveries if not d.settled)


@dataclass
class FakeLeaser:
    extension: float = 30.0
    held: dict[str, Delivery] = field(default_factory=dict)

    def add(self, deliveries: list[Delivery]) -> None:
        self.held.update((d.ack_id, d) for d in deliveries)

    def remove(self, delivery: Delivery) -> None:
        self.held.pop(delivery.ack_id, None)


@dataclass
class FakeDeadLetters:
    records: list[tuple[Delivery, Failure]] = field(default_factory=list)
    fail: bool = False

    def publish(self, delivery: Delivery, failure: Failure) -> str:
        if self.fail:
            raise RuntimeError("dead-letter topic unavailable")
        self.records.append((delivery, failure))
        return str(len(self.records))


def make_delivery(
    data: bytes, attributes: dict[str, str], *, message_id: str = "m-1", attempt: int | None = 1
) -> Delivery:
    return Delivery(
        ack_id=f"ack-{message_id}",
        message_id=message_id,
        data=data,
        attributes=attributes,
        publish_time=datetime.now(UTC),
        delivery_attempt=attempt,
    )
