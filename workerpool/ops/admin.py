"""Topics and subscriptions: idempotent provisioning and reading a subscription's settings."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from google.api_core import exceptions as gexc
from google.protobuf import duration_pb2

from workerpool.errors import ConfigError


def topic_path(project: str, topic: str) -> str:
    return topic if topic.startswith("projects/") else f"projects/{project}/topics/{topic}"


def subscription_path(project: str, subscription: str) -> str:
    if subscription.startswith("projects/"):
        return subscription
    return f"projects/{project}/subscriptions/{subscription}"


@dataclass(frozen=True)
class SubscriptionInfo:
    name: str
    topic: str
    ack_deadline_seconds: int
    dead_letter_topic: str
    max_delivery_attempts: int
    has_retry_policy: bool
    exactly_once: bool
    filter: str
    # Seconds; 0 when not set (what ``workerpool status`` shows beyond the above).
    min_backoff: float = 0.0
    max_backoff: float = 0.0
    retention_seconds: float = 0.0
    # Pub/Sub delivers each ordering key's messages in order (the worker runs them so).
    message_ordering: bool = False


def require_topic(publisher: Any, topic: str) -> None:
    """ConfigError if ``topic`` does not exist. A publisher not allowed to look (Pub/Sub's
    publisher role cannot) is let through: its publish will say."""
    try:
        publisher.get_topic(request={"topic": topic}, timeout=30)
    except gexc.NotFound:
        raise ConfigError(f"topic {topic} does not exist") from None
    except gexc.PermissionDenied:
        pass


def describe_subscription(subscriber: Any, subscription: str) -> SubscriptionInfo:
    """Read the subscription; a missing one is a configuration error."""
    try:
        sub = subscriber.get_subscription(request={"subscription": subscription}, timeout=30)
    except gexc.NotFound:
        raise ConfigError(f"subscription {subscription} does not exist") from None
    has_retry = sub.retry_policy is not None and (
        sub.retry_policy.minimum_backoff.total_seconds() > 0
        or sub.retry_policy.maximum_backoff.total_seconds() > 0
    )
    return SubscriptionInfo(
        name=sub.name,
        topic=sub.topic,
        ack_deadline_seconds=sub.ack_deadline_seconds,
        dead_letter_topic=sub.dead_letter_policy.dead_letter_topic,
        max_delivery_attempts=sub.dead_letter_policy.max_delivery_attempts,
        has_retry_policy=has_retry,
        exactly_once=sub.enable_exactly_once_delivery,
        filter=sub.filter,
        min_backoff=sub.retry_policy.minimum_backoff.total_seconds() if has_retry else 0.0,
        max_backoff=sub.retry_policy.maximum_backoff.total_seconds() if has_retry else 0.0,
        retention_seconds=sub.message_retention_duration.total_seconds(),
        message_ordering=sub.enable_message_ordering,
    )


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
