"""The data path's calls on the client's gRPC channel send what the client's own methods send,
and fail as they fail. A gRPC server in this process stands in for Pub/Sub: it records each
call's metadata and request (the emulator cannot show them)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import grpc  # type: ignore[import-untyped,unused-ignore]
import pytest
from google.api_core import exceptions as gexc
from google.cloud.pubsub_v1 import SubscriberClient
from google.protobuf.empty_pb2 import Empty
from google.pubsub_v1.services.subscriber.transports import SubscriberGrpcTransport
from google.pubsub_v1.types import (
    AcknowledgeRequest,
    ModifyAckDeadlineRequest,
    PullRequest,
    PullResponse,
)

from workerpool.worker.rpc import subscriber_rpc

SUBSCRIPTION = "projects/p/subscriptions/jobs"
MISSING = "projects/p/subscriptions/gone"
_REQUESTS = {
    "Pull": PullRequest.pb(),
    "Acknowledge": AcknowledgeRequest.pb(),
    "ModifyAckDeadline": ModifyAckDeadlineRequest.pb(),
}


@dataclass
class Seen:
    calls: list[tuple[str, dict[str, str], Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Subscriber(grpc.GenericRpcHandler):  # type: ignore[misc]
    def __init__(self, seen: Seen) -> None:
        self._seen = seen

    def service(self, details: Any) -> Any:
        method = details.method.rsplit("/", 1)[-1]
        request_type = _REQUESTS.get(method)
        if request_type is None:
            return None

        def handle(request: Any, context: Any) -> Any:
            with self._seen.lock:
                self._seen.calls.append((method, dict(context.invocation_metadata()), request))
            if request.subscription == MISSING:
                context.abort(grpc.StatusCode.NOT_FOUND, "Subscription does not exist")
            if method != "Pull":
                return Empty()
            response = PullResponse.pb()()
            received = response.received_messages.add(ack_id="ack-1")
            received.message.data = b"{}"
            received.message.attributes["job"] = "demo.noop"
            return response

        return grpc.unary_unary_rpc_method_handler(
            handle,
            request_deserializer=request_type.FromString,
            response_serializer=lambda response: response.SerializeToString(),
        )


@pytest.fixture
def served() -> Iterator[tuple[Any, Seen]]:
    seen = Seen()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((_Subscriber(seen),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    client = SubscriberClient(
        transport=SubscriberGrpcTransport(host=f"127.0.0.1:{port}", channel=channel)
    )
    try:
        yield client, seen
    finally:
        channel.close()
        server.stop(None)


def _sent(seen: Seen, method: str) -> list[tuple[dict[str, str], Any]]:
    return [(metadata, request) for name, metadata, request in seen.calls if name == method]


def test_a_pull_on_the_channel_sends_the_metadata_the_clients_own_pull_sends(
    served: tuple[Any, Seen],
) -> None:
    client, seen = served
    client.pull(request={"subscription": SUBSCRIPTION, "max_messages": 7}, retry=None)
    received = subscriber_rpc(client, SUBSCRIPTION).pull(7, 5.0)

    assert [r.ack_id for r in received] == ["ack-1"]
    assert received[0].message.attributes["job"] == "demo.noop"
    (by_client, client_request), (ours, our_request) = _sent(seen, "Pull")
    for key in ("x-goog-request-params", "x-goog-api-client"):
        assert ours[key] == by_client[key], key
    assert ours["x-goog-request-params"] == f"subscription={SUBSCRIPTION}"
    assert our_request == client_request


def test_acks_and_deadline_changes_on_the_channel_carry_their_ids_and_the_routing(
    served: tuple[Any, Seen],
) -> None:
    client, seen = served
    rpc = subscriber_rpc(client, SUBSCRIPTION)
    rpc.acknowledge(["a", "b"], 5.0)
    rpc.modify_ack_deadline(["c"], 42, 5.0)

    ((ack_metadata, ack),) = _sent(seen, "Acknowledge")
    ((modack_metadata, modack),) = _sent(seen, "ModifyAckDeadline")
    assert (ack.subscription, list(ack.ack_ids)) == (SUBSCRIPTION, ["a", "b"])
    assert (modack.subscription, list(modack.ack_ids), modack.ack_deadline_seconds) == (
        SUBSCRIPTION,
        ["c"],
        42,
    )
    for metadata in (ack_metadata, modack_metadata):
        assert metadata["x-goog-request-params"] == f"subscription={SUBSCRIPTION}"


def test_a_failed_call_on_the_channel_raises_what_the_clients_own_call_raises(
    served: tuple[Any, Seen],
) -> None:
    client, _ = served
    with pytest.raises(gexc.NotFound) as by_client:
        client.pull(request={"subscription": MISSING, "max_messages": 1}, retry=None)
    rpc = subscriber_rpc(client, MISSING)
    with pytest.raises(gexc.NotFound) as ours:
        rpc.pull(1, 5.0)
    assert ours.value.message == by_client.value.message
    with pytest.raises(gexc.NotFound):
        rpc.acknowledge(["a"], 5.0)


def test_a_client_without_a_grpc_transport_is_called_through_its_methods() -> None:
    calls: list[tuple[str, Any]] = []
    pulled = PullResponse.pb()()
    pulled.received_messages.add(ack_id="ack-9")

    def pull(request: Any, timeout: float, retry: Any) -> Any:
        calls.append(("pull", (request, timeout, retry)))
        return PullResponse.wrap(pulled)

    def acknowledge(request: Any, timeout: float, retry: Any) -> None:
        calls.append(("ack", (list(request.ack_ids), timeout, retry)))

    def modify_ack_deadline(request: Any, timeout: float, retry: Any) -> None:
        calls.append(("modack", (list(request.ack_ids), request.ack_deadline_seconds, retry)))

    client = SimpleNamespace(
        pull=pull, acknowledge=acknowledge, modify_ack_deadline=modify_ack_deadline
    )
    rpc = subscriber_rpc(client, SUBSCRIPTION)
    assert [r.ack_id for r in rpc.pull(3, 2.0)] == ["ack-9"]
    rpc.acknowledge(["x"], 1.0)
    rpc.modify_ack_deadline(["y"], 0, 1.0)

    assert calls == [
        ("pull", ({"subscription": SUBSCRIPTION, "max_messages": 3}, 2.0, None)),
        ("ack", (["x"], 1.0, None)),
        ("modack", (["y"], 0, None)),
    ]
