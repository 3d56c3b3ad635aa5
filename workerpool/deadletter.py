"""Failure records on the dead-letter topic.

A record is the original message (data and attributes) plus attributes saying what failed,
where it came from and who saw it, so ``dlq replay`` can send it back where it came from.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from workerpool import constants as c
from workerpool.delivery import Delivery
from workerpool.text import truncate_utf8

# Original attributes kept first when the 100-attribute limit forces a choice.
_PRIORITY = (c.ATTR_JOB, c.ATTR_JOB_ID, c.ATTR_TRACEPARENT, c.ATTR_TRACESTATE)


def worker_identity() -> str:
    """host-pid-random: unique per process, readable in a failure record or a claim."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class Failure:
    error_type: str
    error_message: str
    job_name: str
    job_id: str
    delivery_attempt: int


def failure_attributes(
    delivery: Delivery, failure: Failure, *, subscription: str, topic: str, worker: str
) -> dict[str, str]:
    added = {
        c.ATTR_JOB: failure.job_name,
        c.ATTR_JOB_ID: failure.job_id,
        c.ATTR_ERROR_TYPE: failure.error_type,
        c.ATTR_ERROR_MESSAGE: failure.error_message,
        c.ATTR_DELIVERY_ATTEMPT: str(failure.delivery_attempt),
        c.ATTR_SOURCE_SUBSCRIPTION: subscription,
        c.ATTR_SOURCE_TOPIC: topic,
        c.ATTR_WORKER: worker,
        c.ATTR_FAILED_AT: datetime.now(UTC).isoformat(timespec="milliseconds"),
    }
    added = {k: truncate_utf8(v) for k, v in added.items() if v}
    room = c.MAX_ATTRIBUTES - len(added)
    originals = sorted(
        (k for k in delivery.attributes if k not in added),
        key=lambda k: (k not in _PRIORITY, k),
    )
    kept = {k: delivery.attributes[k] for k in originals[:room]}
    return {**kept, **added}


class DeadLetterPublisher:
    """Publishes failure records and waits for the server's confirmation."""

    def __init__(
        self,
        publisher: Any,
        topic: str,
        *,
        subscription: str,
        source_topic: str,
        worker: str,
        timeout: float = 30.0,
    ) -> None:
        self._publisher = publisher
        self.topic = topic
        self._subscription = subscription
        self._source_topic = source_topic
        self._worker = worker
        self._timeout = timeout

    def publish(self, delivery: Delivery, failure: Failure) -> str:
        """Return the record's message id; raise if the publish was not confirmed."""
        attributes = failure_attributes(
            delivery,
            failure,
            subscription=self._subscription,
            topic=self._source_topic,
            worker=self._worker,
        )
        future = self._publisher.publish(self.topic, delivery.data, **attributes)
        message_id: str = future.result(timeout=self._timeout)
        return message_id
