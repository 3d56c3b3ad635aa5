"""Pub/Sub plumbing: the clients a worker and the CLI commands use, resource paths, and a
subscription's settings read once.

Why the emulator gets a channel of our own: with ``PUBSUB_EMULATOR_HOST`` set,
google-cloud-pubsub 2.44 connects through a bare ``grpc.insecure_channel(target=host)``,
without the options its gRPC transports give the channel they build for production (below),
so gRPC's default 4 MiB receive cap applies. Measured on the emulator: a 9.5 MB message
published fine, but every pull whose batch held it failed with ``ResourceExhausted: Received
message larger than max (9500323 vs. 4194304)``; the batch stayed leased, came back after its
ack deadline and failed again, small messages of that batch included. Pub/Sub allows 10 MB a
message, so on the emulator each client gets an insecure channel with the production options.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import grpc  # type: ignore[import-untyped,unused-ignore]  # no stubs installed
from google.api_core import exceptions as gexc
from google.auth.exceptions import DefaultCredentialsError
from google.cloud.pubsub_v1 import PublisherClient, SubscriberClient
from google.cloud.pubsub_v1.types import PublisherOptions
from google.pubsub_v1.services.publisher.transports import PublisherGrpcTransport
from google.pubsub_v1.services.subscriber.transports import SubscriberGrpcTransport

from workerpool.errors import ConfigError

# What google.pubsub_v1's gRPC transports pass when they create the channel themselves.
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_metadata_size", 4 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 30_000),
)


def _emulator_channel() -> tuple[str, grpc.Channel] | None:
    host = os.environ.get("PUBSUB_EMULATOR_HOST")
    return (host, grpc.insecure_channel(host, options=CHANNEL_OPTIONS)) if host else None


def subscriber_client() -> Any:
    """A ``SubscriberClient``; on the emulator, over a channel without the 4 MiB cap."""
    emulator = _emulator_channel()
    if emulator is None:
        return SubscriberClient()
    host, channel = emulator  # a transport given a channel ignores credentials
    return SubscriberClient(transport=SubscriberGrpcTransport(host=host, channel=channel))


def publisher_client() -> Any:
    """A ``PublisherClient`` with message ordering on (a message with an ordering key is
    published after the key's earlier ones; one without is published as ever); on the
    emulator, over a channel without the 4 MiB cap."""
    options = PublisherOptions(enable_message_ordering=True)
    emulator = _emulator_channel()
    if emulator is None:
        return PublisherClient(publisher_options=options)
    host, channel = emulator
    return PublisherClient(
        publisher_options=options,
        transport=PublisherGrpcTransport(host=host, channel=channel),
    )


def connect() -> Clients:
    """``Clients``; no credentials to be found is a ConfigError (the CLI's one line)."""
    try:
        return Clients()
    except DefaultCredentialsError:
        raise ConfigError(
            "no Google Cloud credentials found: run with a service account, set "
            "GOOGLE_APPLICATION_CREDENTIALS, or set PUBSUB_EMULATOR_HOST to use an emulator"
        ) from None


@dataclass
class Clients:
    subscriber: Any = field(default_factory=subscriber_client)
    publisher: Any = field(default_factory=publisher_client)

    def close(self) -> None:
        self.subscriber.close()
        self.publisher.stop()


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
