"""What the fleet has taken off the subscription since a moment, from its beats."""

from __future__ import annotations

from tests.fakes import make_beat
from workerpool.autoscale.taken import Taken

SUB = "projects/p/subscriptions/jobs"
NOW = 1000.0


def test_taken_counts_what_replicas_settle_and_hold_since_a_moment() -> None:
    taken = Taken()
    taken.update(NOW, [make_beat("a", running=3, at=NOW)])
    taken.update(NOW + 1, [make_beat("a", running=3, at=NOW)])  # the same beat: nothing new
    # 4 a second for the 2 s since its last beat: 8 settled; 6 held now, 3 then
    taken.update(NOW + 2, [make_beat("a", running=5, waiting=1, completed=4.0, at=NOW + 2)])
    assert taken.since(NOW) == 8 + 6 - 3
    assert taken.held_at(NOW + 1) == 3
    assert taken.held_at(NOW - 1) is None and taken.since(NOW - 1) is None  # before it began
    # A replica whose beat is gone (its drain ended) settled the 5 it ran; the one it held
    # and had not started went back to the subscription
    taken.update(NOW + 3, [])
    assert taken.since(NOW + 2) == 5 - 6
