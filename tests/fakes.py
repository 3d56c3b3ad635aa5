"""In-process fakes for pure-logic tests of the processor (no Pub/Sub involved)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime

from workerpool.deadletter import Failure
from workerpool.delivery import Delivery


@dataclass
class FakeAcks:
    acked: list[str] = field(default_factory=list)
    modacked: list[tuple[str, float]] = field(default_factory=list)

    def ack(self, ack_id: str, *, confirm: bool = False) -> None:
        self.acked.append(ack_id)

    def modack(self, ack_ids: list[str], seconds: float) -> None:
        self.modacked.extend((ack_id, seconds) for ack_id in ack_ids)

    def extend(self, deliveries: list[Delivery], seconds: float) -> None:
        pass


class FakeLeaser:
    extension = 30.0

    def add(self, deliveries: list[Delivery]) -> None:
        pass

    def remove(self, delivery: Delivery) -> None:
        pass


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
