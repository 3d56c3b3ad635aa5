"""The Pub/Sub clients a worker and the CLI commands use.

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
