"""In-process stand-ins for the parts of the data path that talk to Pub/Sub: what the
processor acks, nacks and records, kept in lists. ``run_job`` runs a job through a real
``Processor`` with them; the project's own pure-logic tests use them too.

They have the shapes of ``workerpool.worker.interfaces``, so the processor, pool and leaser
take them without a ``type: ignore``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from workerpool.context import Flag, JobContext
from workerpool.registry import JobSpec
from workerpool.worker.delivery import Delivery
from workerpool.worker.envelope import Job
from workerpool.worker.failures import Failure
from workerpool.worker.outcome import Outcome
from workerpool.worker.run import Permit, Run


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
    data: bytes,
    attributes: dict[str, str],
    *,
    message_id: str = "m-1",
    attempt: int | None = 1,
    ordering_key: str = "",
) -> Delivery:
    return Delivery(
        ack_id=f"ack-{message_id}",
        message_id=message_id,
        data=data,
        attributes=attributes,
        published=time.time(),
        delivery_attempt=attempt,
        ordering_key=ordering_key,
    )


class RoomyPermit:
    """A run's permit in a pool with room for every waiter."""

    def __init__(self) -> None:
        self.held = True

    def put_down(self) -> bool:
        self.held = False
        return True

    def pick_up(self) -> bool:
        self.held = True
        return True

    def start_when_held(self, start: Callable[[bool], None]) -> None:
        start(True)


def slot_run(
    job_id: str,
    permit: Permit | None = None,
    *,
    key: str = "bigquery-exports",
    hand_back: Callable[[Run, Outcome], bool] = lambda run, outcome: True,
) -> Run:
    """A run as the middleware sees it, of a job that takes a slot of ``key`` (for tests
    and benchmarks of the slots, outside a pool)."""
    spec = JobSpec("demo.slot", lambda ctx, payload: None, options={"concurrency": key})
    message_id = f"m-{job_id}"
    job = Job(spec, job_id, {}, message_id, 1, None, {})
    ctx = JobContext(spec.name, job_id, message_id, 1, None, Flag())
    delivery = make_delivery(b"{}", {}, message_id=message_id)
    return Run(job, ctx, delivery, hand_back, permit=permit or RoomyPermit())
