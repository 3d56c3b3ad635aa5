"""Heartbeats: each replica's record in the shared store, read by the autoscaler; and the
worker that writes them (what it runs and holds, draining, gone on a clean exit)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import FIRESTORE_PROJECT
from tests.fakes import make_beat
from tests.support import store_handles, wait_for
from workerpool.heartbeats import Beat, HeartbeatStore, MemoryHeartbeats, SqliteHeartbeats
from workerpool.heartbeats.store import FORGET_AFTER
from workerpool.registry import Registry
from workerpool.testing.pubsub import PubSubResources

SUB = "projects/p/subscriptions/jobs"
StoreFactory = Callable[[], HeartbeatStore]


@pytest.fixture(params=["memory", "sqlite", "firestore"])
def make_store(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[StoreFactory]:
    def firestore(collection: str) -> HeartbeatStore:
        from workerpool.heartbeats.firestore import FirestoreHeartbeats

        return FirestoreHeartbeats(FIRESTORE_PROJECT, collection)

    with store_handles(
        request.param, request, monkeypatch,
        memory=MemoryHeartbeats,
        sqlite=lambda: SqliteHeartbeats(tmp_path / "fleet.db"),
        firestore=firestore,
    ) as make:  # fmt: skip
        yield make


def test_the_latest_beat_of_each_live_replica_of_a_subscription(make_store: StoreFactory) -> None:
    # Given two replicas' handles on one store, and a replica of another subscription
    a, b = make_store(), make_store()
    a.beat(make_beat("a", at=100.0, running=1))
    b.beat(make_beat("b", at=100.0, running=2))
    a.beat(make_beat("a", at=102.0, running=3, saturated=True))
    b.beat(make_beat("other", at=102.0, subscription="projects/p/subscriptions/else"))
    # When the autoscaler reads the subscription's beats
    seen = make_store().live(SUB, 103.0)
    # Then each replica's latest beat is there, whole, and only those of the subscription
    assert seen == [
        make_beat("a", at=102.0, running=3, saturated=True),
        make_beat("b", at=100.0, running=2),
    ]


def test_a_beat_lapses_when_not_renewed_and_is_gone_at_once_on_a_clean_exit(
    make_store: StoreFactory,
) -> None:
    store = make_store()
    store.beat(make_beat("died", at=100.0))  # until 106
    store.beat(make_beat("stopped", at=100.0))
    store.beat(make_beat("alive", at=104.0))  # until 110
    store.gone("stopped")
    assert [b.replica for b in store.live(SUB, 105.0)] == ["alive", "died"]
    assert [b.replica for b in store.live(SUB, 107.0)] == ["alive"]
    assert store.live(SUB, 111.0) == []


def test_a_beat_lapsed_long_ago_is_forgotten_by_the_reader(make_store: StoreFactory) -> None:
    store = make_store()
    store.beat(make_beat("died", at=100.0))
    store.beat(make_beat("alive", at=100.0 + FORGET_AFTER))
    # When the autoscaler reads an hour after the first replica died
    store.live(SUB, 110.0 + FORGET_AFTER)
    # Then its beat was deleted, not merely left out: read as of a time when both were
    # live, only the other one is there
    assert [b.replica for b in store.live(SUB, 0.0)] == ["alive"]


# --- the worker's side -----------------------------------------------------------------


def test_a_worker_beats_what_it_runs_and_holds_draining_and_is_gone_on_exit(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given a worker with 2 slots, a prefetch of 1, and beats every 0.2 s into an SQLite store
    store_url = f"sqlite:///{tmp_path / 'fleet.db'}"
    reader = SqliteHeartbeats(tmp_path / "fleet.db")
    release = threading.Event()
    jobs = Registry()

    @jobs.job("t.hold")
    def hold(ctx: object, payload: dict[str, object]) -> None:
        release.wait(30)

    def beats() -> list[Beat]:
        return reader.live(pubsub_resources.subscription_path, time.time())

    with pubsub_resources.worker(
        jobs, max_outstanding=2, prefetch=1, heartbeat_interval=0.2, idempotency_store=store_url,
    ) as worker:  # fmt: skip
        assert wait_for(lambda: len(beats()) == 1, timeout=10)
        [idle] = beats()
        # When 5 jobs that wait are published
        for i in range(5):
            pubsub_resources.publish("t.hold", {}, job_id=f"j{i}")
        # Then its beat says 2 running, 1 held and waiting, the pull saturated
        assert wait_for(lambda: (beats()[0].running, beats()[0].waiting) == (2, 1), timeout=10)
        [busy] = beats()
        # ... and once it drains, its beat says so at once
        worker.quiet()
        assert wait_for(lambda: beats()[0].draining, timeout=1.0)
        release.set()
    # ... and once it has stopped, its beat is gone
    assert beats() == []
    reader.close()
    assert (idle.replica, idle.slots, idle.running, idle.waiting) == (worker.worker_id, 2, 0, 0)
    assert idle.until - idle.at == pytest.approx(0.6)
    assert busy.saturated and not busy.draining
