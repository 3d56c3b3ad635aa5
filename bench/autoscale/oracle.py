"""The oracle: a lower bound on the least instance-seconds any scaler could bill and meet the
SLA, knowing the whole trace in advance. Jobs run in publish order, as Pub/Sub roughly hands
them out and as in every run here (free to run short jobs first, an oracle could meet a p95
with fewer replicas).

Whatever it does, an oracle pays for
- the work: each job holds one of a replica's ``slots`` for its duration, so replicas are
  billed at least ``work / slots`` seconds while serving;
- a cold start for every replica it starts, and it must start at least ``k`` of them, where
  ``k`` is the fewest always-on replicas that meet the SLA. (At its busiest the oracle has
  some number of replicas serving; that many, serving throughout, start every job no later
  than it does, first come first served, so they meet the SLA too, and ``k`` is no more.)

So ``oracle = work / slots + k * cold_start``, found by a search over always-on fleets (the
p95 wait only falls as replicas are added), and no schedule bills less. It assumes replicas
start exactly when needed, leave the moment their last slot frees and never idle, so it is
lower than any real schedule: a ratio to it overstates the cost of every scaler.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.autoscale.fleet import Outcome, Setup, simulate
from bench.autoscale.scalers import AlwaysOn
from bench.autoscale.traces import Trace


@dataclass(frozen=True)
class Oracle:
    replicas: int  # the fewest always-on replicas that meet the SLA
    instance_seconds: float  # the lower bound
    always_on: Outcome  # those replicas' own run: the always-on baseline


def oracle(trace: Trace, setup: Setup) -> Oracle:
    """Raises ValueError when not even ``max_replicas`` always on meet the SLA."""
    runs: dict[int, Outcome] = {}

    def meets(replicas: int) -> bool:
        runs[replicas] = simulate(trace, AlwaysOn(replicas), setup)
        return runs[replicas].p95_wait <= setup.sla

    low, high = 1, setup.max_replicas
    if not meets(high):
        raise ValueError(f"{trace.name}: {high} replicas always on miss the SLA")
    while low < high:  # the fewest that meet it lies in [low, high]
        middle = (low + high) // 2
        if meets(middle):
            high = middle
        else:
            low = middle + 1
    bound = trace.work / setup.slots + high * setup.cold_start
    return Oracle(high, bound, runs[high])
