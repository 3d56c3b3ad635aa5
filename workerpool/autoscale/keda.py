"""A KEDA external scaler: KEDA asks it whether the fleet should run and how many replicas it
should have, and sizes its target (a Deployment) to exactly that count.

It serves KEDA's gRPC ``externalscaler.ExternalScaler`` service (``externalscaler.proto``):

- ``StreamIsActive`` (trigger type ``external-push``): KEDA keeps the stream open; the first
  answer goes out at once and another at every change, so a fleet at zero wakes as soon as a
  message waits, not at KEDA's next poll.
- ``IsActive``: the same answer, polled (trigger type ``external``).
- ``GetMetricSpec``: one metric, ``workerpool-replicas``, with a target of 1 per replica.
- ``GetMetrics``: the desired replica count as that metric's value. With the ``AverageValue``
  metric type (KEDA's default) the HPA asks for ceil(value / target) replicas: our count.

The numbers come from a callable, called from the server's threads for every request (and once
a ``poll`` interval for each open stream), so it should return the autoscaler's latest decision
rather than compute one. When it raises, the RPC fails with UNAVAILABLE and KEDA retries: a
stale answer is never made up.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc  # type: ignore[import-untyped,unused-ignore]  # no stubs installed

from workerpool.autoscale import externalscaler_pb2 as pb
from workerpool.autoscale import externalscaler_pb2_grpc as pb_grpc
from workerpool.autoscale.actuator import Actuator, Beat
from workerpool.autoscale.policy import Decision, Signals
from workerpool.constants import KEDA_METRIC
from workerpool.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Estimate:
    """What KEDA is told: whether the fleet should run at all, and how many replicas."""

    active: bool
    desired: int

    @classmethod
    def of(cls, signals: Signals, decision: Decision) -> Estimate:
        """Active while work waits or runs, and while the policy still holds replicas through
        its scale-down delay: KEDA's cooldown towards zero starts only once the policy itself
        says zero."""
        waiting = bool(signals.backlog) or bool(signals.oldest_age)
        return cls(waiting or signals.in_flight > 0 or decision.desired > 0, decision.desired)


class KedaTarget(Actuator):
    """The autoscaler's "actuator" when KEDA scales: nothing is changed here, the count is
    what KEDA is told (the latest ``Estimate``, served by ``KedaScaler``), and KEDA's HPA
    changes the Deployment to it."""

    name = "keda"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._estimate: Estimate | None = None

    def decided(self, signals: Signals, decision: Decision) -> None:
        with self._lock:
            self._estimate = Estimate.of(signals, decision)

    def estimate(self) -> Estimate:
        """For ``KedaScaler``: the latest decision (an error before the first: KEDA retries)."""
        with self._lock:
            if self._estimate is None:
                raise LookupError("no decision yet")
            return self._estimate

    def current(self) -> int:
        with self._lock:
            return 0 if self._estimate is None else self._estimate.desired

    def scale(self, desired: int, beats: Sequence[Beat]) -> str:
        return f"KEDA is told {desired} replicas"


class _Scaler(pb_grpc.ExternalScalerServicer):
    def __init__(self, estimate: Callable[[], Estimate], poll: float) -> None:
        self._estimate = estimate
        self._poll = poll

    def _now(self, context: Any) -> Estimate:
        try:
            return self._estimate()
        except Exception as exc:  # the store, the probe, a bug: KEDA logs it and retries
            log.warning("KEDA asked for an estimate and none could be had: %s", exc)
            context.abort(grpc.StatusCode.UNAVAILABLE, f"no estimate: {exc}")
            raise  # not reached: abort raises

    def IsActive(self, request: pb.ScaledObjectRef, context: Any) -> pb.IsActiveResponse:
        return pb.IsActiveResponse(result=self._now(context).active)

    def StreamIsActive(
        self, request: pb.ScaledObjectRef, context: Any
    ) -> Iterator[pb.IsActiveResponse]:
        ended = threading.Event()
        context.add_callback(ended.set)  # KEDA went away, or the server stops: end at once
        last: bool | None = None
        while not ended.is_set():
            active = self._now(context).active
            if active != last:
                yield pb.IsActiveResponse(result=active)
                last = active
            ended.wait(self._poll)

    def GetMetricSpec(self, request: pb.ScaledObjectRef, context: Any) -> pb.GetMetricSpecResponse:
        # Both target fields: KEDA reads targetSizeFloat when it is above 0, else targetSize.
        spec = pb.MetricSpec(metricName=KEDA_METRIC, targetSize=1, targetSizeFloat=1.0)
        return pb.GetMetricSpecResponse(metricSpecs=[spec])

    def GetMetrics(self, request: pb.GetMetricsRequest, context: Any) -> pb.GetMetricsResponse:
        if request.metricName != KEDA_METRIC:
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"unknown metric {request.metricName!r}: this scaler serves {KEDA_METRIC!r}",
            )
        desired = self._now(context).desired
        value = pb.MetricValue(
            metricName=KEDA_METRIC, metricValue=desired, metricValueFloat=float(desired)
        )
        return pb.GetMetricsResponse(metricValues=[value])


class KedaScaler:
    """The gRPC server a ScaledObject's ``scalerAddress`` points at (plain text: run it inside
    the cluster, beside KEDA). ``port`` is the port it listens on (``address`` may ask for 0)."""

    def __init__(
        self,
        estimate: Callable[[], Estimate],
        address: str = "[::]:9090",
        *,
        poll: float = 1.0,
        streams: int = 8,
    ) -> None:
        # Each open StreamIsActive holds a thread; the rest serve the unary calls. A call
        # beyond them all is refused (RESOURCE_EXHAUSTED, which KEDA retries) rather than
        # queued behind streams that never end.
        threads = streams + 4
        self._server = grpc.server(
            ThreadPoolExecutor(max_workers=threads), maximum_concurrent_rpcs=threads
        )
        pb_grpc.add_ExternalScalerServicer_to_server(  # type: ignore[no-untyped-call]
            _Scaler(estimate, poll), self._server
        )
        try:
            self.port: int = self._server.add_insecure_port(address)
        except RuntimeError:  # grpc's "Failed to bind to address ..."
            raise ConfigError(f"KEDA scaler address {address}: cannot listen there") from None

    def start(self) -> KedaScaler:
        self._server.start()
        log.info("KEDA external scaler listening on port %d", self.port)
        return self

    def stop(self, grace: float = 1.0) -> None:
        """Stop answering; open streams are cancelled after ``grace`` seconds."""
        self._server.stop(grace).wait()
