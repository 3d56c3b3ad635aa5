"""The autoscaler's loop: read the signals, decide, act, say why.

Each round reads the fleet (``SignalReader``), lets the actuator tend its replicas (restart
those due), asks the policy for a count, and tells the actuator when the count differs from
what there is. A decision is logged in one line (the signals, the count wanted, the count there
is, why, and what the actuator did) whenever it differs from the last one logged (with a
``Leader``, it is also kept beside its lease, for the dashboard), and exported as gauges;
replicas exiting before their first beat (a crash loop) are a counter. A store that cannot be
read leaves the count as it is: signals missing is never a reason to scale in. With a
``Leader``, a round acts only while this autoscaler holds the subscription's lease.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, MeterProvider, Observation

from workerpool import constants as c
from workerpool.autoscale.actuator import Actuator, Beat
from workerpool.autoscale.leader import Leader
from workerpool.autoscale.policy import Decision, Policy, Signals, decide
from workerpool.autoscale.signals import Observation as Seen
from workerpool.autoscale.signals import SignalReader
from workerpool.errors import ActuatorError
from workerpool.leadership import Noted
from workerpool.stores import StoreError

log = logging.getLogger(__name__)


class Autoscaler:
    def __init__(
        self,
        reader: SignalReader,
        actuator: Actuator,
        policy: Policy,
        *,
        interval: float = 1.0,
        meter_provider: MeterProvider | None = None,
        clock: Callable[[], float] = time.time,
        on_decision: Callable[[Signals, Decision], None] | None = None,
        leader: Leader | None = None,
    ) -> None:
        """``on_decision`` is told every decision with its signals (the KEDA scaler answers
        from the latest); with a ``leader``, ``run`` acts only in rounds it leads."""
        self._leader = leader
        self._reader = reader
        self._on_decision = on_decision
        self._actuator = actuator
        self._policy = policy
        self._interval = interval
        self._clock = clock
        self._history: tuple[tuple[float, int], ...] = ()
        self._logged: tuple[object, ...] = ()
        self._gauges: dict[str, float] = {}
        meter = metrics.get_meter(c.INSTRUMENTATION_NAME, meter_provider=meter_provider)
        for name, description in (
            ("replicas", "Replicas there are, as the actuator counts them."),
            ("desired", "Replicas the policy asks for."),
            ("running", "Jobs running across the replicas that serve."),
            (
                "waiting",
                "Messages known to wait: held and not started, seen by a probe, or counted "
                "by Cloud Monitoring and not taken since.",
            ),
        ):
            meter.create_observable_gauge(
                f"workerpool.autoscale.{name}", callbacks=[self._observer(name)],
                description=description,
            )  # fmt: skip
        meter.create_observable_counter(
            "workerpool.autoscale.exits_at_start",
            callbacks=[lambda options: [Observation(self._actuator.exits_at_start())]],
            description="Replicas that exited before their first heartbeat (a crash loop: "
            "each is restarted after a backoff).",
        )

    def step(self) -> Decision:
        """One round: read, decide, act."""
        unreadable: StoreError | None = None
        try:
            beats: list[Beat] | None = self._reader.beats()
        except StoreError as exc:
            unreadable, beats = exc, None
        tended = self._actuator.tend(beats)
        current = self._actuator.current()
        seen = None if beats is None else self._reader.read(current, beats)
        if unreadable is not None:
            log.warning("heartbeats unreadable (%s): keeping %d replicas", unreadable, current)
        signals = seen.signals if seen is not None else Signals(self._clock(), current, 1)
        decision = decide(signals, self._policy, self._history)
        self._history = decision.history
        if self._on_decision is not None:
            self._on_decision(signals, decision)
        action = "no change"
        if decision.desired != current:
            action = self._actuator.scale(decision.desired, [] if seen is None else seen.beats)
        self._report(seen, decision, current, "; ".join(filter(None, (action, tended))))
        return decision

    def run(self, stop: threading.Event) -> None:
        """Rounds every ``interval`` seconds (a probe's own wait counts) until ``stop``."""
        while not stop.is_set():
            began = time.monotonic()
            try:
                if self._leader is None or self._leader.active():
                    self.step()
            except ActuatorError as exc:  # its one line says what and why; the next round tries
                log.warning("autoscale round failed: %s", exc)
            except Exception:  # a bug: logged whole, the next round tries
                log.exception("autoscale round failed")
            stop.wait(max(0.0, self._interval - (time.monotonic() - began)))

    def _report(self, seen: Seen | None, decision: Decision, current: int, action: str) -> None:
        s = None if seen is None else seen.signals
        self._gauges = {
            "replicas": current,
            "desired": decision.desired,
            "running": 0 if s is None else s.in_flight,
            "waiting": 0 if s is None or s.backlog is None else s.backlog,
        }
        key = (decision.desired, current, decision.reason, action, seen and seen.summary())
        if key == self._logged:
            return
        self._logged = key
        signals = "signals missing" if seen is None else seen.summary()
        log.info(
            "autoscale: %s; desired %d, actual %d: %s; %s",
            signals,
            decision.desired,
            current,
            decision.reason,
            action,
        )
        if self._leader is not None:
            self._leader.note(
                Noted(self._clock(), current, decision.desired, signals, decision.reason, action)
            )

    def _observer(self, name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            if name in self._gauges:
                yield Observation(self._gauges[name])

        return observe

    def close(self) -> None:
        """Drain the actuator's replicas (from the thread that ran the rounds: the process
        actuator's replicas die with it), then give the lead up."""
        self._reader.close()
        self._actuator.close()
        if self._leader is not None:
            self._leader.close()
