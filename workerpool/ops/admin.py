"""Topics and subscriptions, provisioned idempotently."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from google.api_core import exceptions as gexc
from google.protobuf import duration_pb2

from workerpool.pubsub import subscription_path, topic_path


@dataclass(frozen=True)
class ProvisionRequest:
    project: str
    topic: str
    subscription: str
    dead_letter_topic: str
    dead_letter_subscription: str = ""
    ack_deadline: int = 60
    max_delivery_attempts: int = 10
    min_backoff: float = 10.0
    max_backoff: float = 600.0
    filter: str = ""
    retry_policy: bool = True
    exactly_once: bool = False
    ordered: bool = False  # message ordering: a key's messages delivered in order


def _seconds(value: float) -> duration_pb2.Duration:
    duration = duration_pb2.Duration()
    duration.FromTimedelta(timedelta(seconds=value))
    return duration


def provision(publisher: Any, subscriber: Any, req: ProvisionRequest) -> list[tuple[str, bool]]:
    """Create what is missing; return ``(resource, created)`` for each, in creation order."""
    topic = topic_path(req.project, req.topic)
    dlq_topic = topic_path(req.project, req.dead_letter_topic)
    dlq_sub = subscription_path(
        req.project, req.dead_letter_subscription or f"{req.dead_letter_topic}-sub"
    )
    subscription: dict[str, Any] = {
        "name": subscription_path(req.project, req.subscription),
        "topic": topic,
        "ack_deadline_seconds": req.ack_deadline,
        "dead_letter_policy": {
            "dead_letter_topic": dlq_topic,
            "max_delivery_attempts": req.max_delivery_attempts,
        },
        "filter": req.filter,
        "enable_exactly_once_delivery": req.exactly_once,
        "enable_message_ordering": req.ordered,
    }
    if req.retry_policy:
        subscription["retry_policy"] = {
            "minimum_backoff": _seconds(req.min_backoff),
            "maximum_backoff": _seconds(req.max_backoff),
        }
    steps: list[tuple[str, Callable[[], Any]]] = [
        (topic, lambda: publisher.create_topic(request={"name": topic})),
        (dlq_topic, lambda: publisher.create_topic(request={"name": dlq_topic})),
        (
            dlq_sub,
            lambda: subscriber.create_subscription(
                request={"name": dlq_sub, "topic": dlq_topic, "ack_deadline_seconds": 60}
            ),
        ),
        (subscription["name"], lambda: subscriber.create_subscription(request=subscription)),
    ]
    results = []
    for resource, create in steps:
        try:
            create()
            results.append((resource, True))
        except gexc.AlreadyExists:
            results.append((resource, False))
    return results
