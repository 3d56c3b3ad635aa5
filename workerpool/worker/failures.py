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
    out, as few as need be (last in key order first, as the 100-attribute limit drops them);
    else the data is cut and every attribute kept (but one, where there are 100), and
    ``ATTR_DATA_CUT`` says how long it was (such a record cannot be replayed). The error
    message says what was left out.
    """
    if publish_request_size(topic, data, attributes) <= limit:
        return data, attributes
    message = truncate_utf8(
        attributes.get(c.ATTR_ERROR_MESSAGE, ""), c.MAX_ATTRIBUTE_VALUE_BYTES - 160
    )
    ours = {*c.FAILURE_ATTRIBUTES, *_PRIORITY}
    droppable = sorted((k for k in attributes if k not in ours), reverse=True)

    def noted(kept: dict[str, str], dropped: int, cut: int) -> dict[str, str]:
        note = (
            f" [cut to fit one publish request: {dropped} original attributes dropped,"
            f" data {len(data)} -> {cut} bytes]"
        )
        return {**kept, c.ATTR_ERROR_MESSAGE: message + note}

    record = dict(attributes)
    for dropped in range(len(droppable) + 1):  # the data whole, if leaving originals out will do
        if dropped:
            del record[droppable[dropped - 1]]
        whole = noted(record, dropped, len(data))
        if publish_request_size(topic, data, whole) <= limit:
            return data, whole
    # Else the data is cut, every original attribute kept: its length said in an attribute
    # of its own (a replay must not send a part), in place of an original one where the
    # record has no room for one more.
    record, dropped = dict(attributes), 0
    if len(record) >= c.MAX_ATTRIBUTES and droppable:
        del record[droppable[0]]
        dropped = 1
    record[c.ATTR_DATA_CUT] = str(len(data))
    # (The note is longest with the data's own length: the cut one has no more digits.)
    excess = publish_request_size(topic, data, noted(record, dropped, len(data))) - limit
    cut = data[: max(0, len(data) - excess)]
    return cut, noted(record, dropped, len(cut))


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
