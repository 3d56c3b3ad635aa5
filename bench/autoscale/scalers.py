"""What sizes the fleet in each run: workerpool's autoscaler, a KEDA-like one, always-on.

``Ours`` is workerpool's own loop (``Autoscaler``: ``SignalReader``, ``decide``, an actuator)
with only its outside world simulated: the heartbeat store holds the model's beats, the
probe's pull and Cloud Monitoring's API answer from the model. So what it does here is what
the code does, given what those sources would say.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

from opentelemetry.metrics import NoOpMeterProvider

from bench.autoscale.fleet import SUBSCRIPTION, Fleet, Point
from workerpool.autoscale.actuator import Actuator, Beat, least_busy
from workerpool.autoscale.controller import Autoscaler
from workerpool.autoscale.policy import Policy
from workerpool.autoscale.probe import Probe
from workerpool.autoscale.signals import SignalReader
from workerpool.heartbeats import MemoryHeartbeats
from workerpool.ops.monitoring import UNDELIVERED, BacklogReader


class _Subscriber:
    """Pub/Sub as the probe sees it: a pull gets the oldest waiting messages it does not hold
    already, as many as it asks for if that many wait; given back, they wait as before."""

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet
        self._held = 0

    def pull(self, request: dict[str, Any], timeout: float, retry: None) -> SimpleNamespace:
        seen = self._fleet.probe(request["max_messages"], self._held)
        self._held += seen
        received = SimpleNamespace(ack_id="m", message=SimpleNamespace(ordering_key=""))
        return SimpleNamespace(received_messages=[received] * seen)

    def modify_ack_deadline(self, request: dict[str, Any], timeout: float) -> None:
        self._held = 0


class _Response:
    def __init__(self, body: dict[str, Any]) -> None:
        self._body = body

    def raise_for_status(self) -> None:
        pass

    def json(self) -> dict[str, Any]:
        return self._body


class _MonitoringApi:
    """Cloud Monitoring's timeSeries.list: the newest point ``source`` gives, if any."""

    def __init__(self, source: Callable[[], Point | None]) -> None:
        self._source = source

    def get(self, url: str, params: dict[str, str], timeout: float) -> _Response:
        point = self._source()
        if point is None:
            return _Response({})
        value = point.undelivered if UNDELIVERED in params["filter"] else point.oldest_age
        # The model's seconds stand for POSIX ones, as the reader's clock is the model's.
        taken = datetime.fromtimestamp(point.at, UTC).isoformat().replace("+00:00", "Z")
        body = {"value": {"doubleValue": value}, "interval": {"endTime": taken}}
        return _Response({"timeSeries": [{"points": [body]}]})


class _Actuator(Actuator):
    """A scale-in as the process actuator and a Cloud Run count lowered with the in-flight
    work in mind do it: replicas still starting go first, then the least busy by their
    beats; they drain."""

    name = "model"

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet

    def current(self) -> int:
        return self._fleet.current()

    def scale(self, desired: int, beats: Sequence[Beat]) -> str:
        missing = desired - self._fleet.current()
        if missing > 0:
            self._fleet.start(missing)
            return f"started {missing}"
        chosen = self._fleet.starting()[:-missing]
        chosen += [b.replica for b in least_busy(beats, -missing - len(chosen))]
        for name in chosen:
            self._fleet.drain(name)
        return f"draining {len(chosen)}"


@dataclass
class Ours:
    policy: Policy = field(default_factory=Policy)
    monitoring: bool = True  # False: where Cloud Monitoring cannot be read (the emulator)
    every: float = 1.0  # `workerpool autoscale --interval`'s default

    @property
    def name(self) -> str:
        besides = "" if self.monitoring else ", no Monitoring"
        return f"workerpool{besides} ({self.policy.scale_down_delay:g} s window)"

    def bind(self, fleet: Fleet) -> Callable[[], object]:
        fleet.heartbeats = MemoryHeartbeats()
        clock = fleet.clock
        backlog = None
        if self.monitoring:
            api = _MonitoringApi(fleet.monitoring)
            backlog = BacklogReader(SUBSCRIPTION, session=api, env={}, clock=clock)
        reader = SignalReader(
            SUBSCRIPTION,
            fleet.heartbeats,
            probe=Probe(_Subscriber(fleet), SUBSCRIPTION, clock=clock),
            backlog=backlog,
            slots_per_replica=fleet.setup.slots,
            max_replicas=self.policy.max_replicas,
            clock=clock,
        )
        loop = Autoscaler(
            reader,
            _Actuator(fleet),
            self.policy,
            interval=self.every,
            meter_provider=NoOpMeterProvider(),
            clock=clock,
        )
        return loop.step


@dataclass
class KedaLike:
    """KEDA's Pub/Sub scaler driving an HPA: every 30 s it reads Cloud Monitoring's backlog
    (the same lagged points), active only when that is above 0, and asks for one replica per
    ``per_replica`` unacked messages; it scales in only to the highest count of the last
    ``cooldown`` seconds, and a scale-in stops pods mid-run (Kubernetes removes the replicas
    still starting, then the newest)."""

    per_replica: float = 8.0  # the same 80 % of 10 slots ours aims at (KEDA's default: 10)
    cooldown: float = 300.0
    every: float = 30.0
    name: str = "KEDA-like"

    def bind(self, fleet: Fleet) -> Callable[[], None]:
        recent: deque[tuple[float, int]] = deque()

        def step() -> None:
            point = fleet.monitoring()
            backlog = 0 if point is None else point.undelivered
            wanted = min(fleet.setup.max_replicas, math.ceil(backlog / self.per_replica))
            recent.append((fleet.now, wanted))
            while recent[0][0] <= fleet.now - self.cooldown:
                recent.popleft()
            current = fleet.current()
            target = wanted if wanted >= current else max(n for _, n in recent)
            if target > current:
                fleet.start(target - current)
            victims = fleet.starting()[::-1] + fleet.serving()[::-1]
            for name in victims[: max(0, current - target)]:
                fleet.kill(name)

        return step


@dataclass
class AlwaysOn:
    replicas: int
    every: float = math.inf

    @property
    def name(self) -> str:
        return f"always-on ({self.replicas})"

    def bind(self, fleet: Fleet) -> Callable[[], None]:
        fleet.start(self.replicas, warm=True)
        return lambda: None
