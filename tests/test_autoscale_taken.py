"""What the fleet has taken off the subscription since a moment, from its beats."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from workerpool.autoscale.taken import Taken
from workerpool.heartbeats import Beat

SUB = "projects/p/subscriptions/jobs"
NOW = 1000.0


def _beat(replica: str, **fields: Any) -> Beat:
    beat = Beat(
        replica=replica, subscription=SUB, host="h", pid=0, slots=4, running=0, waiting=0,
        completed=0.0, saturated=False, draining=False, at=NOW, until=NOW + 6,
    )  # fmt: skip
    return replace(beat, **fields)


def test_taken_counts_what_replicas_settle_and_hold_since_a_moment() -> None:
    taken = Taken()
    taken.update(NOW, [_beat("a", running=3, at=NOW)])
    taken.update(NOW + 1, [_beat("a", running=3, at=NOW)])  # the same beat: nothing new
    # 4 a second for the 2 s since its last beat: 8 settled; 6 held now, 3 then
    taken.update(NOW + 2, [_beat("a", running=5, waiting=1, completed=4.0, at=NOW + 2)])
    assert taken.since(NOW) == 8 + 6 - 3
    assert taken.held_at(NOW + 1) == 3
    assert taken.held_at(NOW - 1) is None and taken.since(NOW - 1) is None  # before it began
    # A replica whose beat is gone (its drain ended) settled the 5 it ran; the one it held
    # and had not started went back to the subscription
    taken.update(NOW + 3, [])
    assert taken.since(NOW + 2) == 5 - 6
