"""The KEDA external scaler, through a real gRPC client on a free local port, as KEDA calls it
(no KEDA runs here: its client's calls are the four RPCs of externalscaler.proto)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from google.protobuf import descriptor_pb2

from tests.support import wait_for
from workerpool.autoscale import externalscaler_pb2 as pb
from workerpool.autoscale import externalscaler_pb2_grpc as pb_grpc
from workerpool.autoscale.keda import Estimate, KedaScaler
from workerpool.autoscale.policy import Decision, Signals
from workerpool.errors import ConfigError

REF = pb.ScaledObjectRef(name="workers", namespace="jobs", scalerMetadata={"subscription": "s"})


class _Fleet:
    """The autoscaler's latest estimate, changed by the test; counts how often it is read."""

    def __init__(self, estimate: Estimate) -> None:
        self.estimate = estimate
        self.reads = 0
        self.failure: Exception | None = None

    def __call__(self) -> Estimate:
        self.reads += 1
        if self.failure:
            raise self.failure
        return self.estimate


@pytest.fixture
def fleet() -> _Fleet:
    return _Fleet(Estimate(active=False, desired=0))


@pytest.fixture
def keda(fleet: _Fleet) -> Iterator[pb_grpc.ExternalScalerStub]:
    scaler = KedaScaler(fleet, "127.0.0.1:0", poll=0.05).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{scaler.port}")
    yield pb_grpc.ExternalScalerStub(channel)
    channel.close()
    scaler.stop(grace=0)


def test_is_active_and_get_metrics_tell_the_latest_estimate(
    keda: pb_grpc.ExternalScalerStub, fleet: _Fleet
) -> None:
    request = pb.GetMetricsRequest(scaledObjectRef=REF, metricName="workerpool-replicas")
    assert keda.IsActive(REF).result is False
    assert keda.GetMetrics(request).metricValues[0].metricValue == 0
    fleet.estimate = Estimate(active=True, desired=7)
    assert keda.IsActive(REF).result is True
    (value,) = keda.GetMetrics(request).metricValues
    assert (value.metricName, value.metricValue, value.metricValueFloat) == (
        "workerpool-replicas",
        7,
        7.0,
    )


def test_the_metric_spec_is_one_metric_with_a_target_of_one_per_replica(
    keda: pb_grpc.ExternalScalerStub,
) -> None:
    # With KEDA's default AverageValue type the HPA asks for ceil(value / 1) = our count.
    (spec,) = keda.GetMetricSpec(REF).metricSpecs
    assert (spec.metricName, spec.targetSize, spec.targetSizeFloat) == ("workerpool-replicas", 1, 1)


def test_an_unknown_metric_is_not_found(keda: pb_grpc.ExternalScalerStub) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        keda.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=REF, metricName="cpu"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert "workerpool-replicas" in caught.value.details()


def test_an_estimate_that_fails_is_unavailable_never_a_stale_answer(
    keda: pb_grpc.ExternalScalerStub, fleet: _Fleet
) -> None:
    fleet.failure = RuntimeError("store unreachable")
    request = pb.GetMetricsRequest(scaledObjectRef=REF, metricName="workerpool-replicas")
    for call in (lambda: keda.IsActive(REF), lambda: keda.GetMetrics(request)):
        with pytest.raises(grpc.RpcError) as caught:
            call()
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert caught.value.details() == "no estimate: store unreachable"


def test_stream_is_active_answers_at_once_then_pushes_each_change_only(
    keda: pb_grpc.ExternalScalerStub, fleet: _Fleet
) -> None:
    # Given KEDA's open stream on an idle fleet
    stream = keda.StreamIsActive(REF)
    received: list[tuple[float, bool]] = []

    ended: list[grpc.StatusCode] = []

    def read() -> None:
        try:
            for answer in stream:
                received.append((time.monotonic(), answer.result))
        except grpc.RpcError as exc:
            ended.append(exc.code())

    reader = threading.Thread(target=read)
    reader.start()
    assert wait_for(lambda: len(received) == 1, 5, 0.01)
    assert received[0][1] is False
    # While nothing changes, nothing more is sent (four polls)
    time.sleep(0.2)
    assert len(received) == 1
    # When a message arrives, Then the change is pushed within a poll or two
    changed_at = time.monotonic()
    fleet.estimate = Estimate(active=True, desired=1)
    assert wait_for(lambda: len(received) == 2, 5, 0.01)
    assert received[1][1] is True and received[1][0] - changed_at < 1.0
    # and when the fleet goes idle again, that is pushed too
    fleet.estimate = Estimate(active=False, desired=0)
    assert wait_for(lambda: len(received) == 3, 5, 0.01)
    assert [active for _, active in received] == [False, True, False]
    # When KEDA closes the stream, Then the server stops reading estimates for it
    stream.cancel()
    reader.join(timeout=5)
    assert ended == [grpc.StatusCode.CANCELLED]
    time.sleep(0.1)
    reads = fleet.reads
    time.sleep(0.2)
    assert fleet.reads == reads


def test_a_failing_estimate_ends_the_stream_as_unavailable(
    keda: pb_grpc.ExternalScalerStub, fleet: _Fleet
) -> None:
    stream = keda.StreamIsActive(REF)
    assert next(stream).result is False
    fleet.failure = RuntimeError("store unreachable")
    with pytest.raises(grpc.RpcError) as caught:
        next(stream)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE  # KEDA reopens it with backoff


def test_stream_metric_spec_is_unimplemented_so_keda_falls_back_to_polling_the_spec(
    keda: pb_grpc.ExternalScalerStub,
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        next(keda.StreamMetricSpec(REF))
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_a_call_beyond_its_threads_is_refused_not_queued_behind_open_streams(
    fleet: _Fleet,
) -> None:
    scaler = KedaScaler(fleet, "127.0.0.1:0", poll=0.05, streams=1).start()  # 5 threads
    channel = grpc.insecure_channel(f"127.0.0.1:{scaler.port}")
    keda = pb_grpc.ExternalScalerStub(channel)
    streams = [keda.StreamIsActive(REF) for _ in range(5)]
    assert all(next(stream).result is False for stream in streams)  # each holds a thread
    with pytest.raises(grpc.RpcError) as caught:
        keda.IsActive(REF, timeout=5)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # KEDA retries
    for stream in streams:
        stream.cancel()
    assert wait_for(lambda: _answers(keda), 5, 0.05)
    channel.close()
    scaler.stop(grace=0)


def _answers(keda: pb_grpc.ExternalScalerStub) -> bool:
    try:
        return keda.IsActive(REF, timeout=5).result is False
    except grpc.RpcError:
        return False


def test_the_fleet_is_active_while_work_waits_or_runs_or_the_policy_holds_replicas() -> None:
    def estimate(desired: int, **seen: float | int | None) -> Estimate:
        signals = Signals(now=0, current=1, slots_per_replica=4, **seen)  # type: ignore[arg-type]
        return Estimate.of(signals, Decision(desired, "why"))

    assert estimate(1, backlog=1) == Estimate(active=True, desired=1)
    assert estimate(1, backlog=0, oldest_age=2.0).active  # the backlog figure lags
    assert estimate(1, backlog=0, in_flight=1).active
    assert estimate(2, backlog=0).active  # held through the scale-down delay
    assert estimate(0, backlog=0, oldest_age=0.0) == Estimate(active=False, desired=0)


def test_an_address_it_cannot_listen_on_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"256\.0\.0\.1:1"):
        KedaScaler(lambda: Estimate(False, 0), "256.0.0.1:1")


# KEDA's externalscaler.proto (kedacore/keda, pkg/scalers/externalscaler), field by field: the
# wire format is these numbers and types, so ours must match them exactly.
KEDA_METHODS = {
    "IsActive": ("ScaledObjectRef", "IsActiveResponse", False),
    "StreamIsActive": ("ScaledObjectRef", "IsActiveResponse", True),
    "GetMetricSpec": ("ScaledObjectRef", "GetMetricSpecResponse", False),
    "GetMetrics": ("GetMetricsRequest", "GetMetricsResponse", False),
    "StreamMetricSpec": ("ScaledObjectRef", "GetMetricSpecResponse", True),
}
KEDA_FIELDS = {
    "ScaledObjectRef": {"name": (1, "string"), "namespace": (2, "string"),
                        "scalerMetadata": (3, "map")},
    "IsActiveResponse": {"result": (1, "bool")},
    "GetMetricSpecResponse": {"metricSpecs": (1, "repeated MetricSpec")},
    "MetricSpec": {"metricName": (1, "string"), "targetSize": (2, "int64"),
                   "targetSizeFloat": (3, "double")},
    "GetMetricsRequest": {"scaledObjectRef": (1, "ScaledObjectRef"), "metricName": (2, "string")},
    "GetMetricsResponse": {"metricValues": (1, "repeated MetricValue")},
    "MetricValue": {"metricName": (1, "string"), "metricValue": (2, "int64"),
                    "metricValueFloat": (3, "double")},
}  # fmt: skip


def test_the_service_and_messages_match_kedas_proto_field_for_field() -> None:
    file = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(file)
    assert file.package == "externalscaler"
    (service,) = file.service
    assert service.name == "ExternalScaler"
    methods = {
        m.name: (m.input_type.split(".")[-1], m.output_type.split(".")[-1], m.server_streaming)
        for m in service.method
    }
    assert methods == KEDA_METHODS
    fields = {m.name: {f.name: (f.number, _kind(m, f)) for f in m.field} for m in file.message_type}
    assert fields == KEDA_FIELDS


def _kind(
    message: descriptor_pb2.DescriptorProto, field: descriptor_pb2.FieldDescriptorProto
) -> str:
    field_type = descriptor_pb2.FieldDescriptorProto
    if field.type != field_type.TYPE_MESSAGE:
        kind = field_type.Type.Name(field.type).removeprefix("TYPE_").lower()  # TYPE_INT64: int64
    else:
        kind = field.type_name.split(".")[-1]
        if any(n.name == kind and n.options.map_entry for n in message.nested_type):
            return "map"
    return f"repeated {kind}" if field.label == field_type.LABEL_REPEATED else kind
