"""``status`` reads the backlog from Cloud Monitoring where it can (no Google service is
reachable here, so Monitoring's REST answers are canned; the emulator case is in
tests/test_dlq_emulator.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tests.fakes import FakeClock
from tests.support import book, split_key_in_use
from workerpool.ops.monitoring import MONITORING_URL, Backlog, BacklogReader
from workerpool.ops.status import backlog_lines, slot_lines
from workerpool.slots import MemorySlots, SqliteSlots
from workerpool.slots.allocation import ShareAsk, lease_shares
from workerpool.slots.keys import Limits
from workerpool.slots.sharding import Sharding, shard_of

SUBSCRIPTION = "projects/ads-prod/subscriptions/exports-sub"


class _Response:
    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body

    def raise_for_status(self) -> None:
        pass

    def json(self) -> dict[str, Any]:
        return self.body


class _Monitoring:
    """Answers timeSeries.list like Cloud Monitoring, newest point first."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values
        self.queries: list[tuple[str, dict[str, str]]] = []

    def get(self, url: str, params: dict[str, str], timeout: float) -> _Response:
        self.queries.append((url, params))
        metric = params["filter"].split("subscription/")[1].split('"')[0]
        value = self.values.get(metric)
        if value is None:
            return _Response({})
        points = [{"value": {"int64Value": str(value)}}, {"value": {"int64Value": "1"}}]
        return _Response({"timeSeries": [{"points": points}]})


def test_backlog_and_oldest_age_come_from_the_newest_points() -> None:
    monitoring = _Monitoring({"num_undelivered_messages": 1234, "oldest_unacked_message_age": 95})
    lines = backlog_lines(SUBSCRIPTION, env={}, session=monitoring)
    assert lines == [("backlog", "1234 messages"), ("oldest unacked age", "95s")]
    url, params = monitoring.queries[0]
    assert url == MONITORING_URL.format(project="ads-prod")
    assert 'resource.labels.subscription_id = "exports-sub"' in params["filter"]
    assert params["interval.startTime"] < params["interval.endTime"]


def test_the_backlog_reader_keeps_when_the_newest_point_was_taken() -> None:
    # The autoscaler discounts a point by what was done since it was taken: its time is kept
    class Timed(_Monitoring):
        def get(self, url: str, params: dict[str, str], timeout: float) -> _Response:
            body = super().get(url, params, timeout).body
            for point in body["timeSeries"][0]["points"]:
                point["interval"] = {"endTime": "2024-05-31T23:58:00.123456789Z"}
            return _Response(body)

    monitoring = Timed({"num_undelivered_messages": 2140, "oldest_unacked_message_age": 95})
    backlog = BacklogReader(SUBSCRIPTION, session=monitoring, env={}).read()
    assert backlog == Backlog(2140, 95, at=1717199880.123456)
    untimed = _Monitoring({"num_undelivered_messages": 2140})
    assert BacklogReader(SUBSCRIPTION, session=untimed, env={}).read() == Backlog(2140, None)


def test_missing_series_and_failures_are_said_not_raised() -> None:
    quiet = backlog_lines(SUBSCRIPTION, env={}, session=_Monitoring({}))
    assert quiet == [
        ("backlog", "no data in the last 10 minutes"),
        ("oldest unacked age", "no data in the last 10 minutes"),
    ]

    class Refusing:
        def get(self, *args: Any, **kwargs: Any) -> Any:
            raise PermissionError("403 monitoring.timeSeries.list denied")

    [(_, why)] = backlog_lines(SUBSCRIPTION, env={}, session=Refusing())
    assert why == "Cloud Monitoring unavailable: 403 monitoring.timeSeries.list denied"
    [(_, why)] = backlog_lines(SUBSCRIPTION, env={"PUBSUB_EMULATOR_HOST": "127.0.0.1:1"})
    assert why.startswith("unavailable on the emulator")


def test_status_shows_each_keys_limit_holders_waiters_and_deferred_jobs(tmp_path: Path) -> None:
    # Given a fleet's slot store: a full key with a waiter and a deferred job, two tenant keys
    clock = FakeClock(time.time())
    store = SqliteSlots(tmp_path / "fleet.db", clock=clock)
    store.acquire("partner:zeta", "w2/e", 1, 60)
    clock.advance(3)
    store.release_many([("partner:zeta", "w2/e")], held_for=3.0)
    for holder in ("w1/a", "w2/b"):
        store.acquire("exports", holder, 2, 60)
    store.acquire("exports", "w3/c", 2, 60, wait=True)
    book(store, "exports", "job-9", 2)
    store.acquire("partner:acme", "w1/d", 1, 60)
    # When status reads it for the declared limits
    lines = dict(slot_lines(store, {"exports": 2, "partner:*": 1, "imports": 4}))
    store.close()
    # Then every key in use is shown with what holds and waits for it
    assert lines["concurrency exports"].startswith("limit 2, 2 held: w1/a (token 1, ")
    assert "w2/b (token 2, " in lines["concurrency exports"]
    assert lines["concurrency exports"].endswith("; 1 replicas waiting, 1 jobs deferred")
    assert lines["concurrency partner:acme"].startswith("limit 1, 1 held: w1/d (token 1, ")
    assert lines["concurrency partner:zeta"] == (
        "limit 1, 0 held; 0 replicas waiting, 0 jobs deferred, mean hold 3.0s"
    )
    assert lines["concurrency imports"] == "limit 4, 0 held; 0 replicas waiting, 0 jobs deferred"


def test_status_shows_each_replicas_share_of_a_bulk_key() -> None:
    # Given a key of 20 leased in bulk, shared by two replicas
    store = MemorySlots()
    lease_shares(store, [ShareAsk("api", "w1", 20, 0, 16)], 60)
    lease_shares(store, [ShareAsk("api", "w2", 20, 0, 3)], 60)
    # When status reads it
    line = dict(slot_lines(store, {"api": 20}))["concurrency api"]
    # Then it shows the slots in shares and each replica's
    assert line.endswith("; 19 in shares: w1 16 (wants 16, token 1), w2 3 (wants 3, token 2)")


def test_status_shows_a_split_key_once_with_each_shards_part_and_shares_by_replica() -> None:
    # Given a key of 20 in 2 shards: w1 and w2 write shard 0 (wanting 3 and 9), w4 shard 1
    store = MemorySlots()
    assert [shard_of(r, 2) for r in ("w1", "w2", "w4")] == [0, 0, 1]
    split_key_in_use(store, "api", {"w1": 3, "w2": 9, "w4": 4})
    # When status reads it
    lines = slot_lines(store, {"api": 20}, {"api": 2})
    # Then the key shows once, its shards under it: each one's part and its replicas' shares
    assert lines == [
        ("concurrency api", "limit 20, 0 held; 0 replicas waiting, 0 jobs deferred; in 2 shards"),
        ("  shard #0", "part 14; 12 in shares: w1 3 (wants 3, token 5), w2 9 (wants 9, token 6)"),
        ("  shard #1", "part 6; 4 in shares: w4 4 (wants 4, token 4)"),
    ]


def test_a_split_tenant_keys_shard_records_are_not_keys_of_their_own() -> None:
    # Given "tenant:*" = "20/bulk/2" with tenant:a in use (its records tenant:a, tenant:a#0,
    # tenant:a#1) and an unsplit "job:*" whose key job:b#1 is a key (no job:b record)
    store = MemorySlots()
    split_key_in_use(store, "tenant:a", {"w1": 3, "w4": 4})
    lease_shares(store, [ShareAsk("job:b#1", "w1", 5, 0, 2)], 60)
    # When status reads them
    names = [name for name, _ in slot_lines(store, {"tenant:*": 20, "job:*": 5}, {"tenant:*": 2})]
    # Then tenant:a shows once, its shards under it
    assert names == ["concurrency job:b#1", "concurrency tenant:a", "  shard #0", "  shard #1"]


def test_a_lowered_shard_shows_what_it_counts_for_while_its_shares_shrink() -> None:
    # Given a key of 20 in 2 shards: w1 holds 12 in shard 0 (part 15), w4 2 in shard 1
    store = MemorySlots()
    split_key_in_use(store, "api", {"w1": 12, "w4": 2})
    # When w4's runs want 18 and it rebalances: shard 0's part is lowered below its shares
    limits = Limits({"api": 20}, {"api"}, {"api": 2})
    w4 = Sharding(store, "w4", limits, period=0.0)
    w4.lease([ShareAsk("api", "w4", 20, 2, 18)], 60)
    w4.keep_balanced({"api": (2, 18)})
    shards = slot_lines(store, {"api": 20}, {"api": 2})[1:]
    # Then shard 0 shows its new part and the 12 it counts for until w1's share shrinks
    assert shards == [
        ("  shard #0", "part 10 (counts for 12); 12 in shares: w1 12 (wants 12, token 6)"),
        ("  shard #1", "part 8; 5 in shares: w4 5 (wants 18, token 5)"),
    ]
