"""The collaborators of the data path, as Protocols: the real ones talk to Pub/Sub, the test
fakes in tests/fakes.py type-check against the same shapes."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol

from workerpool.worker.delivery import Delivery
from workerpool.worker.failures import Failure


class Acks(Protocol):
    def ack(self, ack_id: str, *, confirm: bool = False) -> Future[bool] | None:
        """Queue an ack; with ``confirm``, a future that says whether Pub/Sub took it."""

    def modack(self, ack_ids: list[str], seconds: float) -> None:
        """Queue new ack deadlines; 0 releases the messages for redelivery now."""

    def extend(self, deliveries: list[Delivery], seconds: float) -> None:
        """Queue lease extensions, skipped at send time for messages settled meanwhile."""


class Leases(Protocol):
    @property
    def extension(self) -> float: ...

    def add(self, deliveries: list[Delivery]) -> None: ...

    def remove(self, delivery: Delivery) -> None: ...


class FailureRecords(Protocol):
    def publish(self, delivery: Delivery, failure: Failure) -> str:
        """Publish the failure record; return its message id, or raise."""
