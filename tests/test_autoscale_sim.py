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
from bench.autoscale.report import Runs, targets
from bench.autoscale.scalers import AlwaysOn, KedaLike, Ours
from bench.autoscale.traces import Trace, diurnal, month_end, steady
from workerpool.autoscale.policy import Policy

SETUP = Setup()
TRACES = {"month-end": month_end, "steady": steady, "diurnal": diurnal}
# A day of jobs takes seconds to simulate for each policy: its cases run in the full suite,
# not the unit tier.
TRACE_NAMES = [pytest.param(n, marks=pytest.mark.slow) if n == "diurnal" else n for n in TRACES]


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


DEFAULT = Policy()  # the policy's default: a 90 s window
NO_WINDOW = Policy(scale_down_delay=0)


def _ours(name: str, policy: Policy = DEFAULT, monitoring: bool = True) -> Outcome:
    return _run(name, policy, monitoring)  # one cache entry however the arguments are given


@cache
def _run(name: str, policy: Policy, monitoring: bool) -> Outcome:
    return simulate(_trace(name), Ours(policy, monitoring), SETUP)


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


# The simulator's targets, on workerpool's autoscaler, at the default window and at none.
# The one the model shows missed is marked so, with why: it fails the suite the day it is met.

BOTH = pytest.mark.parametrize("policy", [DEFAULT, NO_WINDOW], ids=["90s", "0s"])


@BOTH
@pytest.mark.parametrize("name", TRACE_NAMES)
def test_our_scale_in_kills_no_job(name: str, policy: Policy) -> None:
    assert _ours(name, policy).killed == 0 and _ours(name, policy).unfinished == 0


def test_the_keda_like_scale_in_kills_runs_on_the_steady_trace() -> None:
    # The comparison means something: the same model does kill when a scaler stops pods
    assert simulate(_trace("steady"), KedaLike(), SETUP).killed > 0


@BOTH
@pytest.mark.parametrize("monitoring", [True, False], ids=["monitoring", "no-monitoring"])
@pytest.mark.parametrize("name", TRACE_NAMES)
def test_idle_periods_cost_nothing(name: str, monitoring: bool, policy: Policy) -> None:
    # A Cloud Monitoring point counts only what the fleet has not taken since it was taken
    assert _ours(name, policy, monitoring).idle_cost == 0


@BOTH
def test_month_end_p95_wait_is_within_a_cold_start_and_30_s(policy: Policy) -> None:
    # The probe at zero sees 300 messages (as many as 30 replicas have slots): the fleet wakes
    # to its max at once instead of growing 1.5x per cold start
    assert _ours("month-end", policy).p95_wait <= SETUP.sla
    assert _ours("month-end", policy).peak == SETUP.max_replicas


@pytest.mark.parametrize("name", TRACE_NAMES)
def test_a_probe_delivers_a_message_once_per_wake_up(name: str) -> None:
    # Not once per round while the replicas it woke start (10 times in a 10 s cold start)
    assert _ours(name).most_probed == 1


def _wake_to_max() -> float:
    """Waking to the max for a burst whose length no signal gives (a probe sees 300 of the
    3,000) pays 30 cold starts; with the work, the least such a fleet can bill."""
    return SETUP.max_replicas * SETUP.cold_start + _trace("month-end").work / SETUP.slots


def test_waking_to_the_max_alone_costs_more_than_1_2_times_the_oracle() -> None:
    assert _wake_to_max() > 1.2 * _oracle("month-end").instance_seconds


def test_no_policy_that_holds_the_90_s_window_meets_1_2_times_the_oracle() -> None:
    # The backlog waits from the burst until its last message is taken, so the replicas that
    # serve meanwhile stay saturated and every round recommends at least them (the in-flight
    # floor): their count only grows, and reaches the oracle's k (at its busiest a schedule
    # that meets the SLA serves at least k). The last such round is at most one round before
    # the backlog empties; the window holds those replicas 90 s after it, and the runs they
    # hold end within the longest job. So, with a cold start each and the work, any policy
    # honouring the window bills at least:
    trace, found = _trace("month-end"), _oracle("month-end")
    held = DEFAULT.scale_down_delay - Ours().every - max(trace.durations)  # 78.1 s
    bound = trace.work / SETUP.slots + found.replicas * (SETUP.cold_start + held)
    assert bound / found.instance_seconds == pytest.approx(2.47, abs=0.005)  # 1,836 instance-s
    # The model's runs bill more, at the 14 replicas and at the 30 ours wakes to
    fewest = _ours("month-end", Policy(max_replicas=found.replicas))
    assert bound < fewest.instance_seconds < _ours("month-end").instance_seconds


@pytest.mark.parametrize(
    ("replicas", "p95_met", "cost_met"),
    [(18, False, True), (19, True, True), (23, True, True), (24, True, False)],
)
def test_with_no_window_only_waking_to_19_to_23_replicas_meets_both_month_end_targets(
    replicas: int, p95_met: bool, cost_met: bool
) -> None:
    # The fleet capped at N wakes to N at once. 19-23 is about 3,000 jobs x 2 s over 30 s of
    # 10 slots each (20): the burst's length (a probe sees 300) and its jobs' duration (no
    # replica has run) are what choosing it needs at wake-up, and no signal gives them then
    out = _ours("month-end", Policy(scale_down_delay=0, max_replicas=replicas))
    assert (out.p95_wait <= SETUP.sla) is p95_met
    assert (out.instance_seconds <= 1.2 * _oracle("month-end").instance_seconds) is cost_met
    assert out.killed == 0 and out.idle_cost == 0


def test_a_10_s_window_misses_1_2_times_the_oracle_at_the_fewest_replicas_meeting_the_p95() -> None:
    # 19 replicas held 10 s more than with no window: 994 instance-s, 1.34x (more replicas
    # only cost more)
    out = _ours("month-end", Policy(scale_down_delay=10, max_replicas=19))
    assert out.p95_wait <= SETUP.sla
    assert out.instance_seconds > 1.2 * _oracle("month-end").instance_seconds


@BOTH
@pytest.mark.xfail(
    strict=True,
    reason="the burst's length (3,000) and its jobs' duration are unknown at wake-up, so the "
    "fleet wakes to its max: 30 cold starts and the work alone exceed 1.2x the bound (BENCHMARKS "
    "Autoscaling in simulation: 4.87x with the 90 s window, 1.31x with none)",
)
def test_month_end_costs_at_most_1_2_times_the_oracle(policy: Policy) -> None:
    assert (
        _ours("month-end", policy).instance_seconds <= 1.2 * _oracle("month-end").instance_seconds
    )


def test_the_month_end_cost_is_reported_at_each_window() -> None:
    # What BENCHMARKS.md shows beside the target: 4.87x with the default 90 s window (30 idle
    # replicas held for 90 s after the burst), 1.31x with none (little more than waking to
    # the max costs)
    ours = [Ours(DEFAULT), Ours(NO_WINDOW)]
    outcomes = {s.name: _ours("month-end", s.policy) for s in ours}
    month = Runs(_trace("month-end"), _oracle("month-end"), outcomes)
    [row] = [line for line in targets([month], list(outcomes), SETUP) if "1.2 x" in line]
    assert row == (
        "| month-end: instance-seconds <= 1.2 x oracle | 4.87 x | **no** | 1.31 x | **no** |"
    )
    assert _ours("month-end", NO_WINDOW).instance_seconds < 1.1 * _wake_to_max()
