"""The lease one autoscaler of a subscription holds: every backend, through one fixture."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import FIRESTORE_PROJECT
from tests.fakes import FakeClock
from tests.support import store_handles
from workerpool.autoscale.leader import Leader
from workerpool.leadership import (
    LeadershipStore,
    Lease,
    MemoryLeadership,
    Noted,
    SqliteLeadership,
)
from workerpool.leadership.decisions import appended, read
from workerpool.stores import StoreUnavailable

SUB = "projects/p/subscriptions/jobs"
StoreFactory = Callable[[], LeadershipStore]


@pytest.fixture(params=["memory", "sqlite", "firestore"])
def make_store(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[StoreFactory]:
    def firestore(collection: str) -> LeadershipStore:
        from workerpool.leadership.firestore import FirestoreLeadership

        # The session's emulator may be a cold JVM on a loaded machine: its first writes took
        # over the default 5 s here, which says nothing about leases.
        return FirestoreLeadership(
            FIRESTORE_PROJECT, collection, f"{collection}-decisions", timeout=30.0
        )

    with store_handles(
        request.param, request, monkeypatch,
        memory=MemoryLeadership,
        sqlite=lambda: SqliteLeadership(tmp_path / "fleet.db"),
        firestore=firestore,
    ) as make:  # fmt: skip
        yield make


def test_one_holder_renews_others_wait_for_its_ttl_and_a_new_term_has_the_next_token(
    make_store: StoreFactory,
) -> None:
    # Given two autoscalers' handles on one store
    a, b = make_store(), make_store()
    # When A claims first: it holds term 1; B gets A's lease back; A's renewal keeps term 1
    assert a.claim(SUB, "A", 100.0, 10.0) == Lease("A", 1, 110.0)
    assert b.claim(SUB, "B", 105.0, 10.0) == Lease("A", 1, 110.0)
    assert a.claim(SUB, "A", 108.0, 10.0) == Lease("A", 1, 118.0)
    # ... another subscription's lease is its own
    assert b.claim("other", "B", 108.0, 10.0) == Lease("B", 1, 118.0)
    # Then once A stops renewing, B takes over after the TTL with the next token, and A,
    # back from a pause, gets B's lease: it no longer leads
    assert b.claim(SUB, "B", 117.9, 10.0).holder == "A"
    assert b.claim(SUB, "B", 118.0, 10.0) == Lease("B", 2, 128.0)
    assert a.claim(SUB, "A", 119.0, 10.0) == Lease("B", 2, 128.0)
    # ... a release by someone else changes nothing; B's own frees it at once for term 3
    a.release(SUB, "A")
    assert a.claim(SUB, "A", 120.0, 10.0).holder == "B"
    b.release(SUB, "B")
    assert a.claim(SUB, "A", 120.0, 10.0) == Lease("A", 3, 130.0)


class DownLeadership(MemoryLeadership):
    def claim(self, name: str, holder: str, now: float, ttl: float) -> Lease:
        raise StoreUnavailable("store down")


def test_a_standby_says_once_who_leads_takes_over_within_the_ttl_and_an_outage_acts_never(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="workerpool.autoscale.leader")
    store, clock = MemoryLeadership(), FakeClock(1000.0)
    first = Leader(store, SUB, ttl=5.0, clock=clock)
    second = Leader(store, SUB, ttl=5.0, clock=clock)
    # When the first leads and renews, the second stands by (said once)
    assert first.active() and not second.active()
    clock.advance(4)
    assert first.active() and not second.active()
    # ... the first stops renewing: within its TTL the second takes over, with term 2
    clock.advance(5.1)
    assert second.active() and not first.active()
    lines = [r.getMessage() for r in caplog.records]
    assert sum("standing by: autoscaler" in line for line in lines) == 2, lines
    assert lines[-2].endswith(f"leads {SUB} (token 2)"), lines
    assert lines[-1].startswith(f"standing by: autoscaler {second.holder} leads {SUB} (token 2")
    # ... a store that cannot say: not acting
    assert not Leader(DownLeadership(), SUB, clock=clock).active()
    # ... a clean stop releases the lease: the other leads at its next round
    second.close()
    assert first.active()


def test_the_last_decisions_are_kept_per_subscription_newest_first(
    make_store: StoreFactory,
) -> None:
    # Given the leader's handle and the dashboard's on one store
    leader, dashboard = make_store(), make_store()
    first = Noted(100.0, 0, 1, "replicas 0, running 0, waiting 3", "3 waiting", "started 1")
    second = Noted(160.0, 1, 0, "replicas 1, running 0, waiting 0", "idle", "stopped 1")
    # When the leader notes two decisions on its subscription and one on another
    leader.note(SUB, first)
    leader.note(SUB, second)
    leader.note("other", first)
    # Then the other handle reads them back, newest first, each subscription its own
    assert dashboard.decisions(SUB) == [second, first]
    assert dashboard.decisions("other") == [first]
    assert dashboard.decisions("none yet") == []


def test_the_decisions_kept_are_bounded_to_the_last_ones() -> None:
    text = None
    for at in range(5):
        text = appended(text, Noted(float(at), 0, 1, "", "", ""), keep=3)
    assert [n.at for n in read(text)] == [4.0, 3.0, 2.0]
