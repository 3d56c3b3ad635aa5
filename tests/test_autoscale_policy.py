"""The autoscaling policy, rule by rule (pure: no fleet, no clock)."""

from __future__ import annotations

import pytest

from workerpool.autoscale.policy import Decision, Policy, Signals, decide

POLICY = Policy(target_utilisation=0.8, scale_down_delay=90, min_replicas=0, max_replicas=30)


def _at(now: float, current: int, **seen: float | int | None) -> Signals:
    return Signals(now=now, current=current, slots_per_replica=10, **seen)  # type: ignore[arg-type]


def test_a_burst_scales_up_at_once_to_its_demand_at_the_target_utilisation() -> None:
    # 100 waiting + 4 running = 104 slots; 8 usable slots per replica at 80 % -> 13
    decision = decide(_at(0, 1, backlog=100, in_flight=4), POLICY)
    assert decision.desired == 13 and "104 slots" in decision.reason


def test_a_single_waiting_message_wakes_a_fleet_at_zero() -> None:
    assert decide(_at(0, 0, backlog=1), POLICY).desired == 1
    # and a backlog figure that lags (0) while the oldest message has waited counts as one
    assert decide(_at(0, 0, backlog=0, oldest_age=3.0), POLICY).desired == 1
    assert decide(_at(0, 0, backlog=0, oldest_age=0.0), POLICY).desired == 0


def test_a_steady_arrival_rate_keeps_its_busy_slots_by_littles_law() -> None:
    # 20 jobs/s, each slot completes 0.5 jobs/s: 40 busy slots -> 40 / 8 = 5 replicas
    assert decide(_at(0, 1, backlog=0, arrival_rate=20.0, service_rate=0.5), POLICY).desired == 5


def test_scale_down_waits_for_the_stabilisation_window() -> None:
    # Given a fleet of 13 after a burst, and no more demand
    history = decide(_at(0, 1, backlog=100, in_flight=4), POLICY).history
    quiet: Decision | None = None
    for now in (30, 60, 89):
        quiet = decide(_at(now, 13, backlog=0), POLICY, history)
        history = quiet.history
        # Then it holds its count while the burst's recommendation is inside the window
        assert quiet.desired == 13 and "holding 13" in quiet.reason
    # And scales to zero once 90 s of lower recommendations have passed
    after = decide(_at(91, 13, backlog=0), POLICY, history)
    assert after.desired == 0 and after.reason == "no work waiting or running"


def test_min_and_max_bound_the_count() -> None:
    bounded = Policy(min_replicas=2, max_replicas=5)
    assert decide(_at(0, 3, backlog=1000), bounded).desired == 5
    assert decide(_at(0, 0, backlog=0), bounded).desired == 2


def test_never_fewer_replicas_than_the_running_jobs_need() -> None:
    # Given no stabilisation window and nothing waiting, a fleet of 6 running 25 jobs
    eager = Policy(scale_down_delay=0)
    # Then it shrinks to what the 25 need at 80 % of 10 slots (4), not below
    assert decide(_at(0, 6, backlog=0, in_flight=25), eager).desired == 4
    # and a max lowered to 2 meanwhile waits for them: 25 jobs fill at least 3 replicas
    lowered = Policy(max_replicas=2, scale_down_delay=0)
    assert decide(_at(0, 6, backlog=0, in_flight=25), lowered).desired == 3
    assert decide(_at(0, 6, backlog=0, in_flight=15), lowered).desired == 2  # fits: the max


def test_missing_signals_keep_the_current_count_but_not_below_the_running_jobs() -> None:
    decision = decide(_at(0, 2, in_flight=35), POLICY)
    assert decision.desired == 4 and decision.reason.startswith("signals missing")
    assert decide(_at(0, 3), POLICY).desired == 3


@pytest.mark.parametrize(
    "bad",
    [
        lambda: Policy(target_utilisation=0),
        lambda: Policy(min_replicas=3, max_replicas=2),
        lambda: Policy(scale_down_delay=-1),
        lambda: Signals(now=0, current=0, slots_per_replica=0),
    ],
)
def test_impossible_settings_are_refused(bad: object) -> None:
    with pytest.raises(ValueError):
        bad()  # type: ignore[operator]
