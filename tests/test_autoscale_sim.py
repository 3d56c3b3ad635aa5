"""bench.autoscale: the fleet model on small cases worked out by hand, the oracle, then issue
17's simulator targets on its three traces. Model results, not measurements: nothing here
reads a clock, and the traces are seeded."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import pytest

from bench.autoscale.fleet import Fleet, Outcome, Point, Setup, simulate
from bench.autoscale.oracle import Oracle, oracle
from bench.autoscale.scalers import AlwaysOn, Backlog, KedaLike, Ours
from bench.autoscale.traces import Trace, diurnal, month_end, steady

SETUP = Setup()
TRACES = {"month-end": month_end, "steady": steady, "diurnal": diurnal}


@dataclass
class Script:
    """A scaler that does what it is told, at the rounds it is told to."""

    actions: list[tuple[float, Callable[[Fleet], object]]]
    every: float = 1.0
    name: str = "script"

    def bind(self, fleet: Fleet) -> Callable[[], None]:
        def step() -> None:
            while self.actions and self.actions[0][0] <= fleet.now:
                self.actions.pop(0)[1](fleet)

        return step


def _jobs(*jobs: tuple[float, float], horizon: float = 600.0) -> Trace:
    """A trace of (publish time, duration) pairs."""
    return Trace("t", "", [a for a, _ in jobs], [d for _, d in jobs], horizon, horizon)


def _first(fleet: Fleet) -> str:
    return next(iter(fleet.replicas))


def test_a_replica_serves_a_cold_start_after_it_is_asked_for_and_bills_until_it_leaves() -> None:
    # Given one 2 s job published at 0, one replica asked for at 0 and drained at 20
    script = Script([(0, lambda f: f.start(1)), (20, lambda f: f.drain(_first(f)))])
    out = simulate(_jobs((0.0, 2.0)), script)
    # Then the job waited the cold start, ran, and the replica was billed from 0 to 20
    assert out.waits == [SETUP.cold_start] and out.killed == 0 and out.unfinished == 0
    assert out.instance_seconds == pytest.approx(20.0)
    # and the 8 s it sat idle after the run are inside the grace, so no idle cost
    assert out.idle_seconds == pytest.approx(8.0) and out.idle_cost == 0


def test_a_drained_replica_finishes_its_run_and_is_billed_until_then() -> None:
    # Given a 30 s job running from 10 on a replica asked to drain at 15
    script = Script([(0, lambda f: f.start(1)), (15, lambda f: f.drain(_first(f)))])
    out = simulate(_jobs((0.0, 30.0)), script)
    # Then nothing is lost, and the replica leaves when the run ends, at 40
    assert out.killed == 0 and out.unfinished == 0
    assert out.instance_seconds == pytest.approx(40.0)


def test_a_killed_run_comes_back_after_the_ack_deadline_and_runs_again() -> None:
    # Given two replicas, one job running on one of them from 10, that replica killed at 15
    def kill_the_busy_one(fleet: Fleet) -> None:
        fleet.kill(next(n for n, r in fleet.replicas.items() if r.runs))

    script = Script([(0, lambda f: f.start(2)), (15, kill_the_busy_one)])
    out = simulate(_jobs((0.0, 30.0)), script)
    # Then the run is lost, its message waits out its lease and starts again on the other
    assert out.killed == 1 and out.unfinished == 0
    assert out.waits == [15 + SETUP.ack_deadline]


def test_cloud_monitoring_shows_a_point_only_two_to_three_minutes_after_it_was_taken() -> None:
    # Given 100 jobs published at 1 and nobody serving them
    seen: dict[float, Point | None] = {}
    script = Script(
        [(t, lambda f: seen.update({f.now: f.monitoring()})) for t in (119, 120, 179, 180)]
    )
    simulate(_jobs(*[(1.0, 2.0)] * 100, horizon=200), script)
    # Then nothing is readable before 120 s; the point of 0 (before the publish) until 180;
    # the point of 60 from 180, with their age then
    assert seen[119] is None
    assert seen[120] == seen[179] == Point(0.0, 0, 0.0)
    assert seen[180] == Point(60.0, 100, 59.0)


def test_the_same_trace_gives_the_same_outcome() -> None:
    first, second = (simulate(month_end(), Ours()) for _ in range(2))
    assert first == second


@cache
def _trace(name: str) -> Trace:
    return TRACES[name]()


@cache
def _ours(name: str, backlog: Backlog = "monitoring") -> Outcome:
    return simulate(_trace(name), Ours(backlog=backlog), SETUP)


@cache
def _oracle(name: str) -> Oracle:
    return oracle(_trace(name), SETUP)


def test_the_oracle_is_the_work_and_a_cold_start_for_each_of_the_fewest_replicas_needed() -> None:
    found = _oracle("month-end")
    fewer = simulate(_trace("month-end"), AlwaysOn(found.replicas - 1), SETUP)
    assert found.always_on.p95_wait <= SETUP.sla < fewer.p95_wait
    assert found.instance_seconds == pytest.approx(
        _trace("month-end").work / SETUP.slots + found.replicas * SETUP.cold_start
    )


# Issue 17's simulator targets, on workerpool's autoscaler as it is. A target the model shows
# missed is marked so, with why: it fails the suite the day it is met, to be unmarked then.


@pytest.mark.parametrize("name", list(TRACES))
def test_our_scale_in_kills_no_job(name: str) -> None:
    assert _ours(name).killed == 0 and _ours(name).unfinished == 0


def test_the_keda_like_scale_in_kills_runs_on_the_steady_trace() -> None:
    # The comparison means something: the same model does kill when a scaler stops pods
    assert simulate(_trace("steady"), KedaLike(), SETUP).killed > 0


@pytest.mark.parametrize("name", list(TRACES))
def test_idle_periods_cost_nothing(name: str) -> None:
    # A Cloud Monitoring point counts only what the fleet has not taken since it was taken
    assert _ours(name).idle_cost == 0


@pytest.mark.parametrize("name", ["month-end", "steady"])
def test_idle_periods_cost_nothing_where_monitoring_is_not_read(name: str) -> None:
    # What the xfail above comes down to: without the stale point, an idle fleet is at 0
    assert _ours(name, "none").idle_cost == 0


def test_month_end_p95_wait_is_within_a_cold_start_and_30_s() -> None:
    # The probe at zero sees 300 messages (as many as 30 replicas have slots): the fleet wakes
    # to its max at once instead of growing 1.5x per cold start
    assert _ours("month-end").p95_wait <= SETUP.sla
    assert _ours("month-end").peak == SETUP.max_replicas


@pytest.mark.parametrize("name", list(TRACES))
def test_a_probe_delivers_a_message_once_per_wake_up(name: str) -> None:
    # Not once per round while the replicas it woke start (10 times in a 10 s cold start)
    assert _ours(name).most_probed == 1


def test_month_end_p95_wait_is_within_a_cold_start_and_30_s_if_the_backlog_is_known() -> None:
    # The policy's own part: given the backlog's length at once, it meets the p95 target
    assert _ours("month-end", "current").p95_wait <= SETUP.sla


@pytest.mark.xfail(
    strict=True,
    reason="the 90 s window holding 30 idle replicas after the burst (2,700 instance-s alone, "
    "3.6x the oracle's bound)",
)
def test_month_end_costs_at_most_1_2_times_the_oracle() -> None:
    assert _ours("month-end").instance_seconds <= 1.2 * _oracle("month-end").instance_seconds
