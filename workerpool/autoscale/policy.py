"""How many replicas the fleet should have: a pure function of what it sees.

Demand is counted in slots: the jobs running now, the messages waiting, and (by Little's law)
the slots a steady arrival rate keeps busy. Replicas are sized so their slots run at the
target utilisation. Scale-up is immediate; scale-down only to the highest count recommended
during the stabilisation window, so a lull between bursts does not shed replicas that the
next burst needs (Kubernetes' HPA does the same). The count never falls below what the jobs
running now need (not even to meet a lowered max), so no decision asks for a replica that
still runs work to go away. A single waiting message wakes a fleet at zero (at least one,
not "more than one").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Signals:
    """What the fleet sees at ``now`` (seconds, any monotonic clock). ``None``: not known."""

    now: float
    current: int  # replicas now
    slots_per_replica: int  # each replica's max_outstanding
    in_flight: int = 0  # jobs running across the fleet
    backlog: int | None = None  # messages waiting on the subscription
    oldest_age: float | None = None  # seconds the oldest waiting message has waited
    arrival_rate: float | None = None  # messages per second published
    service_rate: float | None = None  # jobs per second one busy slot completes

    def __post_init__(self) -> None:
        if self.slots_per_replica < 1:
            raise ValueError(f"slots_per_replica must be at least 1, got {self.slots_per_replica}")


@dataclass(frozen=True)
class Policy:
    target_utilisation: float = 0.8
    scale_down_delay: float = 90.0  # seconds of lower recommendations before scaling down
    min_replicas: int = 0
    max_replicas: int = 30

    def __post_init__(self) -> None:
        if not 0 < self.target_utilisation <= 1:
            raise ValueError(f"target_utilisation must be in (0, 1], got {self.target_utilisation}")
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError("need 0 <= min_replicas <= max_replicas")
        if self.scale_down_delay < 0:
            raise ValueError("scale_down_delay must be 0 or more")


@dataclass(frozen=True)
class Decision:
    desired: int
    reason: str
    # The recommendations still inside the stabilisation window: pass them to the next call.
    history: tuple[tuple[float, int], ...] = field(default=(), repr=False)


def decide(
    signals: Signals, policy: Policy, history: tuple[tuple[float, int], ...] = ()
) -> Decision:
    """The replica count to ask for now, why, and the window to carry to the next decision."""
    floor = math.ceil(signals.in_flight / signals.slots_per_replica)
    raw, why = _recommend(signals, policy)
    if raw is None:
        raw, why = max(signals.current, floor), "signals missing: keep the current count"
    raw = max(policy.min_replicas, min(policy.max_replicas, max(raw, floor)))
    # A max lowered below what runs now does not take replicas from running jobs: the fleet
    # comes down to it as they finish.
    raw = max(raw, min(floor, signals.current))
    recent = [(at, n) for at, n in history if signals.now - at < policy.scale_down_delay]
    window = (*recent, (signals.now, raw))
    if raw >= signals.current:
        return Decision(raw, why, window)
    held = max(count for _, count in window)
    if held > raw:
        return Decision(
            min(held, signals.current),
            f"{why}; holding {held} until {policy.scale_down_delay:g} s of lower demand",
            window,
        )
    return Decision(raw, why, window)


def _recommend(signals: Signals, policy: Policy) -> tuple[int | None, str]:
    if signals.backlog is None and signals.arrival_rate is None:
        return None, ""
    waiting = signals.backlog or 0
    if waiting == 0 and (signals.oldest_age or 0) > 0:
        waiting = 1  # the backlog figure lags; a message that has waited is one to run
    steady = 0.0
    if signals.arrival_rate and signals.service_rate:
        steady = signals.arrival_rate / signals.service_rate  # busy slots, by Little's law
    slots = max(signals.in_flight + waiting, steady)
    if slots == 0:
        return 0, "no work waiting or running"
    capacity = signals.slots_per_replica * policy.target_utilisation
    replicas = math.ceil(slots / capacity)
    return replicas, (
        f"{slots:g} slots of demand ({signals.in_flight} running, {waiting} waiting, "
        f"{steady:.1f} for the arrival rate) at {policy.target_utilisation:.0%} of "
        f"{signals.slots_per_replica} per replica"
    )
