"""The subscriber's three calls on the data path (Pull, Acknowledge, ModifyAckDeadline), one
RPC each and never retried: the puller and the acknowledger own their retries.

Where the client has a gRPC transport, the calls go straight to its channel, with the metadata
the client's own methods send (the library's version, the subscription to route by). The
client's methods marshal the request, wrap the call in a timeout, a retry and an interceptor,
and wrap the response, at every call: on the emulator, 100 messages a pull, its pull took
5.4-6.6 us of CPU a message against 3.7-4.5 on the channel (measured). Any other client (a REST
transport, a test's stand-in) is called through its methods. Either way a failed call raises
the library's own exceptions (``google.api_core.exceptions``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import grpc  # type: ignore[import-untyped,unused-ignore]  # no stubs installed
from google.api_core import exceptions as gexc
from google.api_core.gapic_v1 import routing_header
from google.protobuf.empty_pb2 import Empty
from google.pubsub_v1.services.subscriber.transports import SubscriberGrpcTransport
from google.pubsub_v1.services.subscriber.transports.base import DEFAULT_CLIENT_INFO
from google.pubsub_v1.types import (
    AcknowledgeRequest,
    ModifyAckDeadlineRequest,
    PullRequest,
    PullResponse,
)

# The requests' and the response's protobuf classes, under the library's proto-plus ones.
_PULL = PullRequest.pb()
_PULLED = PullResponse.pb()
_ACK = AcknowledgeRequest.pb()
_MODACK = ModifyAckDeadlineRequest.pb()
_METHODS = "/google.pubsub.v1.Subscriber/"


class SubscriberRpc(Protocol):
    def pull(self, max_messages: int, timeout: float) -> Sequence[Any]:
        """Up to ``max_messages`` protobuf ``ReceivedMessage``s (none: nothing came)."""
        ...

    def acknowledge(self, ack_ids: list[str], timeout: float) -> None: ...

    def modify_ack_deadline(self, ack_ids: list[str], seconds: int, timeout: float) -> None: ...


def subscriber_rpc(client: Any, subscription: str) -> SubscriberRpc:
    """The calls of ``subscription`` by ``client``: on its gRPC channel where it has one."""
    transport = getattr(client, "transport", None)
    if isinstance(transport, SubscriberGrpcTransport):
        return _OnChannel(transport.grpc_channel, subscription)
    return _ThroughClient(client, subscription)


class _OnChannel:
    def __init__(self, channel: grpc.Channel, subscription: str) -> None:
        self._subscription = subscription
        self._metadata = (
            DEFAULT_CLIENT_INFO.to_grpc_metadata(),  # type: ignore[no-untyped-call]
            routing_header.to_grpc_metadata((("subscription", subscription),)),  # type: ignore[no-untyped-call]
        )
        self._pull = channel.unary_unary(
            _METHODS + "Pull",
            request_serializer=_PULL.SerializeToString,
            response_deserializer=_PULLED.FromString,
        )
        self._ack = channel.unary_unary(
            _METHODS + "Acknowledge",
            request_serializer=_ACK.SerializeToString,
            response_deserializer=Empty.FromString,
        )
        self._modack = channel.unary_unary(
            _METHODS + "ModifyAckDeadline",
            request_serializer=_MODACK.SerializeToString,
            response_deserializer=Empty.FromString,
        )

    def pull(self, max_messages: int, timeout: float) -> Sequence[Any]:
        request = _PULL(subscription=self._subscription, max_messages=max_messages)
        return self._call(self._pull, request, timeout).received_messages  # type: ignore[no-any-return]

    def acknowledge(self, ack_ids: list[str], timeout: float) -> None:
        self._call(self._ack, _ACK(subscription=self._subscription, ack_ids=ack_ids), timeout)

    def modify_ack_deadline(self, ack_ids: list[str], seconds: int, timeout: float) -> None:
        request = _MODACK(
            subscription=self._subscription, ack_ids=ack_ids, ack_deadline_seconds=seconds
        )
        self._call(self._modack, request, timeout)

    def _call(self, stub: grpc.UnaryUnaryMultiCallable, request: Any, timeout: float) -> Any:
        try:
            return stub(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:  # as the library's methods raise it
            raise gexc.from_grpc_error(exc) from exc  # type: ignore[no-untyped-call]


class _ThroughClient:
    def __init__(self, client: Any, subscription: str) -> None:
        self._client = client
        self._subscription = subscription

    def pull(self, max_messages: int, timeout: float) -> Sequence[Any]:
        response = self._client.pull(
            request={"subscription": self._subscription, "max_messages": max_messages},
            timeout=timeout,
            retry=None,
        )
        # The protobuf message under a proto-plus response (the same object, no copy).
        unwrap = getattr(type(response), "pb", None)
        return (response if unwrap is None else unwrap(response)).received_messages  # type: ignore[no-any-return]

    # Each request is made from its protobuf, in one step: the client converts a dict's ack
    # ids to the request one by one (measured: 64 us for 60 ack ids, against 2.6).

    def acknowledge(self, ack_ids: list[str], timeout: float) -> None:
        request = _ACK(subscription=self._subscription, ack_ids=ack_ids)
        self._client.acknowledge(
            request=AcknowledgeRequest.wrap(request), retry=None, timeout=timeout
        )

    def modify_ack_deadline(self, ack_ids: list[str], seconds: int, timeout: float) -> None:
        request = _MODACK(
            subscription=self._subscription, ack_ids=ack_ids, ack_deadline_seconds=seconds
        )
        self._client.modify_ack_deadline(
            request=ModifyAckDeadlineRequest.wrap(request), retry=None, timeout=timeout
        )
