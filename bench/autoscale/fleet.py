"""The fleet model: replicas with a cold start, one subscription, jobs that run in slots.

Event-driven, so times are exact (no step): a run ends, a replica comes up, a killed run's
message comes back, a job is published; and on a period of their own, the scaler's rounds,
the replicas' heartbeats and Cloud Monitoring's points.

- A replica is billed from the moment it is asked for until it leaves; it serves (pulls)
  ``cold_start`` seconds after it was asked for.
- The subscription gives the oldest waiting message to a free slot of a serving replica at
  once (a pull's own latency, milliseconds, is left out); free slots are filled in turn across
  the replicas, as their outstanding pulls are answered. A replica whose slots are all busy
  holds ``prefetch`` more, which its beats report as waiting (here any slot that frees takes
  the oldest message, held or not).
- Drain: a replica asked to go stops pulling and leaves when its last run ends, billed until
  then. Kill: it leaves at once; each run it had is lost, and the run's message comes back
  when its lease lapses (``ack_deadline``) and waits again.
- A probe's pull gets the oldest waiting messages it does not hold already, each one delivery
  more of it (counted per message); given back, they wait as before (the minimum backoff a
  retry policy puts on a message given back is left out: it is about a cold start).
- Cloud Monitoring: a point every 60 s on the subscription's unacked messages (waiting, held
  and running: Pub/Sub counts them all) and the oldest one's age, each readable 120 s after
  its time, so what a reader gets is 120-180 s old, 150 s on average.
"""

from __future__ import annotations

import heapq
import itertools
import math
from bisect import bisect_right
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from bench.autoscale.traces import Trace
from workerpool.heartbeats import Beat, HeartbeatStore

SUBSCRIPTION = "projects/sim/subscriptions/jobs"
LAPSE_AFTER = 3  # a beat lapses after three intervals, as the worker's does


@dataclass(frozen=True)
class Setup:
    slots: int = 10  # each replica's max_outstanding: I/O-bound jobs, one vCPU
    prefetch: int = 2  # workerpool's default
    cold_start: float = 10.0  # asked for -> pulling: a Cloud Run worker pool's Python image
    max_replicas: int = 30
    ack_deadline: float = 60.0  # `workerpool provision`'s default
    beat_every: float = 2.0  # `workerpool run --heartbeat-interval`'s default
    sample_every: float = 60.0  # Cloud Monitoring's Pub/Sub points
    readable_after: float = 120.0
    sla_slack: float = 30.0
    # Idle cost counts from this long after the last run ended: the stabilisation window
    # the targets ask for (scale down only after it: the policy's default, 90 s), plus a beat
    # interval and an autoscaler round for the signals to show that the last run ended.
    idle_grace: float = 93.0

    @property
    def sla(self) -> float:
        """The p95 wait every policy is held to: one cold start, and 30 s."""
        return self.cold_start + self.sla_slack


@dataclass(frozen=True)
class Point:
    """One Cloud Monitoring point on the subscription."""

    at: float
    undelivered: int  # unacked messages: waiting, held or running
    oldest_age: float


@dataclass(eq=False)
class Replica:
    name: str  # billed from its ask until it leaves (``Fleet.replicas``)
    runs: set[int] = field(default_factory=set)
    serving: bool = False
    draining: bool = False
    settled: int = 0  # runs ended since its last beat
    beat_at: float = 0.0


@dataclass(frozen=True)
class Outcome:
    instance_seconds: float
    idle_seconds: float  # billed while no job waited or ran
    idle_cost: float  # of which past ``idle_grace`` after the last run ended
    waits: list[float]  # publish -> start of the run that finished, per finished job, sorted
    killed: int  # runs lost to a scale-in
    unfinished: int  # jobs not finished by the horizon
    peak: int  # most replicas billed at once
    most_probed: int  # the most probe pulls any one message saw (each is a delivery)
    timeline: list[tuple[float, int, int]]  # (time, replicas billed, messages waiting)

    @property
    def p95_wait(self) -> float:
        """Nearest rank: the wait that 95 % of the jobs did not exceed."""
        return self.waits[math.ceil(0.95 * len(self.waits)) - 1] if self.waits else math.nan


class Scaler(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def every(self) -> float:
        """Seconds between its rounds (math.inf: it has none)."""

    def bind(self, fleet: Fleet) -> Callable[[], object]:
        """Set the fleet up for this scaler; return its round."""


class Fleet:
    def __init__(self, trace: Trace, setup: Setup) -> None:
        self.trace, self.setup = trace, setup
        self.now = 0.0
        self.replicas: dict[str, Replica] = {}  # every replica billed now, oldest first
        self.heartbeats: HeartbeatStore | None = None  # beats are written here if set
        self._arrivals, self._durations = trace.arrivals, trace.durations
        self._next = 0  # the oldest job never started: first published, first served
        self._back: deque[int] = deque()  # messages of killed runs, back and waiting
        self._lapsing: list[tuple[float, int]] = []  # ... and when they come back
        self._ends: list[tuple[float, int, str]] = []  # runs: end, job, replica
        self._starting: list[tuple[float, str]] = []  # replicas: ready at, name
        self._serving: list[Replica] = []
        self._turn = 0
        self._room = 0  # free slots of serving replicas
        self._running = 0
        self._named = 0
        self._began = [0.0] * len(trace.arrivals)
        self._probed = [0] * len(trace.arrivals)
        self._waits: list[float] = []
        self._points: list[Point] = []
        self._killed = 0
        self._billed = [0.0, 0.0, 0.0]  # instance-seconds: all, idle, idle past the grace
        self._busy_until = -math.inf  # when a job last waited or ran: before the first, never
        self._peak = 0
        self._timeline: list[tuple[float, int, int]] = []

    # What a scaler sees and does.

    def clock(self) -> float:
        return self.now

    def current(self) -> int:
        """Replicas billed and not draining (starting ones included), as actuators count."""
        return sum(not r.draining for r in self.replicas.values())

    def starting(self) -> list[str]:
        return [r.name for r in self.replicas.values() if not r.serving and not r.draining]

    def serving(self) -> list[str]:
        return [r.name for r in self._serving]

    def waiting(self) -> int:
        """Messages a pull would get now."""
        return len(self._back) + bisect_right(self._arrivals, self.now) - self._next

    def probe(self, most: int, held: int = 0) -> int:
        """A probe's pull, while it holds the ``held`` oldest waiting messages: the next
        oldest, ``most`` at most, each delivered once more (given back, they wait as before)."""
        jobs = list(itertools.islice(self._back, held, held + most))
        first = self._next + max(0, held - len(self._back))
        last = min(first + most - len(jobs), bisect_right(self._arrivals, self.now))
        jobs += range(first, last)
        for job in jobs:
            self._probed[job] += 1
        return len(jobs)

    def monitoring(self) -> Point | None:
        """The newest Cloud Monitoring point readable now."""
        index = math.floor((self.now - self.setup.readable_after) / self.setup.sample_every)
        return self._points[index] if 0 <= index < len(self._points) else None

    def point(self) -> Point:
        """What a Cloud Monitoring point taken now says (readable only later)."""
        published = [self._arrivals[j] for r in self.replicas.values() for j in r.runs]
        published += [self._arrivals[j] for j in self._back]
        published += [self._arrivals[j] for _, j in self._lapsing]
        if self._next < len(self._arrivals) and self._arrivals[self._next] <= self.now:
            published.append(self._arrivals[self._next])
        unacked = self.waiting() + len(self._lapsing) + self._running
        return Point(self.now, unacked, self.now - min(published) if published else 0.0)

    def start(self, count: int, *, warm: bool = False) -> None:
        """Ask for ``count`` replicas; ``warm`` ones serve at once (always-on, started before)."""
        for _ in range(count):
            self._named += 1
            ready = self.now if warm else self.now + self.setup.cold_start
            replica = Replica(f"r{self._named:04d}")
            self.replicas[replica.name] = replica
            heapq.heappush(self._starting, (ready, replica.name))
        self._peak = max(self._peak, len(self.replicas))

    def drain(self, name: str) -> None:
        """Stop pulling, leave when the last run ends (at once if there is none)."""
        replica = self.replicas[name]
        if not replica.serving:
            self._leave(replica)  # still starting: it stops at once, having run nothing
            return
        replica.draining = True
        self._stop_serving(replica)
        self._beat(replica, 0, saturated=False)  # a drain beats at once
        if not replica.runs:
            self._leave(replica)

    def kill(self, name: str) -> None:
        """Leave now; the runs are lost and their messages come back once their leases lapse."""
        replica = self.replicas[name]
        self._stop_serving(replica)
        for job in replica.runs:
            heapq.heappush(self._lapsing, (self.now + self.setup.ack_deadline, job))
        self._killed += len(replica.runs)
        self._running -= len(replica.runs)
        replica.runs.clear()
        self._leave(replica)

    # The run.

    def run(self, scaler: Scaler) -> Outcome:
        step, every = scaler.bind(self), scaler.every
        setup = self.setup
        # Observations first, so a round sees the beats and points of its own instant.
        observers = (self._sample, self._beat_all, step, self._record)
        periods = [setup.sample_every, setup.beat_every, every, self.trace.zoom / 600]
        if self.heartbeats is None:
            periods[1] = math.inf
        rounds = [0, 0, 0, 0]
        due = [0.0 if p < math.inf else math.inf for p in periods]
        soonest = 0.0
        while True:
            now = min(self._next_event(), soonest)
            if now > self.trace.horizon:
                self._bill(self.trace.horizon)
                return self._outcome()
            self._bill(now)
            self.now = now
            self._settle()
            if soonest <= now:
                for i, observe in enumerate(observers):
                    if due[i] <= now:
                        observe()
                        rounds[i] += 1
                        due[i] = rounds[i] * periods[i]
                soonest = min(due)

    def _next_event(self) -> float:
        return min(
            self._arrivals[self._next]
            if self._room and self._next < len(self._arrivals)
            else math.inf,
            self._ends[0][0] if self._ends else math.inf,
            self._starting[0][0] if self._starting else math.inf,
            self._lapsing[0][0] if self._lapsing else math.inf,
        )

    def _settle(self) -> None:
        """What happens at ``now``: runs end, replicas come up, messages come back, then every
        free slot takes the oldest waiting message."""
        while self._ends and self._ends[0][0] <= self.now:
            _, job, name = heapq.heappop(self._ends)
            self._end(job, name)
        while self._starting and self._starting[0][0] <= self.now:
            replica = self.replicas.get(heapq.heappop(self._starting)[1])
            if replica is not None:  # else it was stopped while starting
                self._serve(replica)
        while self._lapsing and self._lapsing[0][0] <= self.now:
            self._back.append(heapq.heappop(self._lapsing)[1])
        while self._room:
            if self._back:
                job = self._back.popleft()
            elif self._next < len(self._arrivals) and self._arrivals[self._next] <= self.now:
                job, self._next = self._next, self._next + 1
            else:
                return
            self._begin(job, self._free_replica())

    def _free_replica(self) -> Replica:
        while True:
            self._turn = (self._turn + 1) % len(self._serving)
            replica = self._serving[self._turn]
            if len(replica.runs) < self.setup.slots:
                return replica

    def _begin(self, job: int, replica: Replica) -> None:
        self._began[job] = self.now
        replica.runs.add(job)
        self._room -= 1
        self._running += 1
        heapq.heappush(self._ends, (self.now + self._durations[job], job, replica.name))

    def _end(self, job: int, name: str) -> None:
        replica = self.replicas.get(name)
        if replica is None or job not in replica.runs:
            return  # the run was killed
        replica.runs.remove(job)
        replica.settled += 1
        self._running -= 1
        self._waits.append(self._began[job] - self._arrivals[job])
        if replica.serving:
            self._room += 1
        elif not replica.runs:
            self._leave(replica)  # drained

    def _serve(self, replica: Replica) -> None:
        replica.serving, replica.beat_at = True, self.now
        self._serving.append(replica)
        self._room += self.setup.slots
        self._beat(replica, 0, saturated=False)  # a worker beats as it starts

    def _stop_serving(self, replica: Replica) -> None:
        if replica.serving:
            replica.serving = False
            self._serving.remove(replica)
            self._room -= self.setup.slots - len(replica.runs)

    def _leave(self, replica: Replica) -> None:
        del self.replicas[replica.name]
        if self.heartbeats is not None:
            self.heartbeats.gone(replica.name)  # a clean exit removes its beat

    # Billing and what observers record.

    def _bill(self, until: float) -> None:
        span, billed = until - self.now, len(self.replicas)
        self._billed[0] += billed * span
        if self._running or self._back or self._lapsing or self.waiting():
            self._busy_until = until
            return
        self._billed[1] += billed * span
        past = max(self.now, self._busy_until + self.setup.idle_grace)
        self._billed[2] += billed * max(0.0, until - past)

    def _sample(self) -> None:
        self._points.append(self.point())

    def _beat_all(self) -> None:
        # Held and not started: while messages wait, every serving replica's slots are busy
        # and its pulls fill its prefetch too.
        waiting = self.waiting()
        held = min(waiting, self.setup.prefetch * len(self._serving))
        for replica in self.replicas.values():
            if replica.serving or replica.draining:
                mine = min(self.setup.prefetch, held) if replica.serving else 0
                held -= mine
                self._beat(replica, mine, saturated=replica.serving and waiting > 0)

    def _beat(self, replica: Replica, held: int, *, saturated: bool) -> None:
        if self.heartbeats is None:
            return
        span = self.now - replica.beat_at
        rate = replica.settled / span if span > 0 else 0.0
        replica.settled, replica.beat_at = 0, self.now
        self.heartbeats.beat(
            Beat(
                replica=replica.name, subscription=SUBSCRIPTION, host="sim", pid=0,
                slots=self.setup.slots, running=len(replica.runs), waiting=held,
                completed=rate, saturated=saturated, draining=replica.draining,
                at=self.now, until=self.now + LAPSE_AFTER * self.setup.beat_every,
            )
        )  # fmt: skip

    def _record(self) -> None:
        self._timeline.append((self.now, len(self.replicas), self.waiting()))

    def _outcome(self) -> Outcome:
        everything, idle, idle_cost = self._billed
        return Outcome(
            instance_seconds=everything,
            idle_seconds=idle,
            idle_cost=idle_cost,
            waits=sorted(self._waits),
            killed=self._killed,
            unfinished=len(self._arrivals) - len(self._waits),
            peak=self._peak,
            most_probed=max(self._probed, default=0),
            timeline=self._timeline,
        )


def simulate(trace: Trace, scaler: Scaler, setup: Setup | None = None) -> Outcome:
    return Fleet(trace, setup or Setup()).run(scaler)
