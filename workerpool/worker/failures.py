"""Writing failure records to the dead-letter topic (``workerpool.ops.dlq`` reads them).

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
from workerpool.worker.delivery import Delivery
from workerpool.worker.text import truncate_utf8

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
    # (Pub/Sub sets CloudPubSubDeadLetter* only as it forwards a message to a dead-letter
    # topic: from a publisher, they would pass this record for one forwarded by Pub/Sub,
    # whose replay goes to the topic they name.)
    originals = sorted(
        (
            k
            for k in delivery.attributes
            if k not in added and not k.startswith(c.ATTR_PUBSUB_DEAD_LETTER_PREFIX)
        ),
        key=lambda k: (k not in _PRIORITY, k),
    )
    kept = {k: delivery.attributes[k] for k in originals[:room]}
    return {**kept, **added}


def _field_size(length: int) -> int:
    """Bytes of one length-delimited protobuf field: tag, varint length, payload."""
    return 1 + max(1, (length.bit_length() + 6) // 7) + length


def publish_request_size(topic: str, data: bytes, attributes: dict[str, str]) -> int:
    """Bytes of the PublishRequest carrying this one message (as the client counts them)."""
    entries = sum(
        _field_size(_field_size(len(k.encode())) + _field_size(len(v.encode())))
        for k, v in attributes.items()
    )
    return _field_size(len(topic.encode())) + _field_size(_field_size(len(data)) + entries)


def fit_record(
    topic: str, data: bytes, attributes: dict[str, str], limit: int = c.MAX_PUBLISH_REQUEST_BYTES
) -> tuple[bytes, dict[str, str]]:
    """The record, made to fit one publish request.

    A message that was within Pub/Sub's limit can exceed it once the failure attributes are
    added; refused, its record would never be written and the message never acked. If the
    data fits beside the failure and priority attributes, other original attributes are left
    out (last in key order first, as the 100-attribute limit drops them); else the data is cut
    and every attribute kept, and ``ATTR_DATA_CUT`` says how long it was (such a record cannot
    be replayed). The error message says what was left out.
    """
    if publish_request_size(topic, data, attributes) <= limit:
        return data, attributes
    record = dict(attributes)
    message = truncate_utf8(record.get(c.ATTR_ERROR_MESSAGE, ""), c.MAX_ATTRIBUTE_VALUE_BYTES - 160)
    record[c.ATTR_ERROR_MESSAGE] = message + " " * 160  # room for the note below
    ours = {*c.FAILURE_ATTRIBUTES, *_PRIORITY}
    droppable = sorted((k for k in record if k not in ours), reverse=True)
    dropped = 0
    if publish_request_size(topic, data, {k: record[k] for k in record if k in ours}) <= limit:
        while publish_request_size(topic, data, record) > limit:
            del record[droppable[dropped]]
            dropped += 1
    cut = data  # else the data must be cut anyway: keep every attribute
    if publish_request_size(topic, data, record) > limit:
        # Said in an attribute of its own (a replay must not send a part), in place of an
        # original one where the record has no room for one more.
        if len(record) >= c.MAX_ATTRIBUTES and dropped < len(droppable):
            del record[droppable[dropped]]
            dropped += 1
        record[c.ATTR_DATA_CUT] = str(len(data))
        excess = publish_request_size(topic, data, record) - limit
        cut = data[: max(0, len(data) - excess)]
    record[c.ATTR_ERROR_MESSAGE] = (
        f"{message} [cut to fit one publish request: {dropped} original attributes dropped,"
        f" data {len(data)} -> {len(cut)} bytes]"
    )
    return cut, record


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
        data, attributes = fit_record(self.topic, delivery.data, attributes)
        future = self._publisher.publish(self.topic, data, **attributes)
        message_id: str = future.result(timeout=self._timeout)
        return message_id
