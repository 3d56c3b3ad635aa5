"""Per-key sequencing (``worker.ordering``), alone and in a pool with typed fakes (no Pub/Sub)."""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest

from tests.support import wait_for
from workerpool import JobContext, RetryableError
from workerpool import constants as c
from workerpool.publishing import JobMessage, publish
from workerpool.registry import Registry
from workerpool.testing.fakes import FakeAcks, FakeDeadLetters, FakeLeaser, make_delivery
from workerpool.worker.delivery import Delivery
from workerpool.worker.limits import PoolLimits
from workerpool.worker.ordering import Place, Sequencer
from workerpool.worker.pool import Pool
from workerpool.worker.processor import Processor, ProcessorSettings


def _keyed(key: str, number: int, job: str = "t.step") -> Delivery:
    job_id = f"{key}-{number}"
    return make_delivery(b"{}", {"job": job, "job_id": job_id}, message_id=job_id, ordering_key=key)


def test_a_key_starts_one_message_and_the_next_only_once_it_is_acked() -> None:
    sequencer = Sequencer(10)
    a0, a1, a2, a3 = (_keyed("a", i) for i in range(4))
    b0, plain = _keyed("b", 0), make_delivery(b"{}", {"job": "t.step"})
    # When three of key a, one of b and one without a key come, Then a's first, b's and the
    # keyless one start, and the rest of a wait
    assert [sequencer.place(d) for d in (a0, a1, a2, b0, plain)] == [
        Place.START, Place.WAIT, Place.WAIT, Place.START, Place.START,
    ]  # fmt: skip
    # When a's first is acked, Then its second starts; and so on, in order
    assert sequencer.settled(a0) == (a1, [])
    assert sequencer.settled(a1) == (a2, [])
    assert sequencer.settled(a2) == (None, [])
    # And a key with nothing here starts its next message at once
    assert sequencer.place(a3) is Place.START


def test_a_message_given_back_takes_every_later_one_of_its_key() -> None:
    # Given key a with one started and two waiting, and key b with one started and one waiting
    sequencer = Sequencer(10)
    a0, a1, a2, b0, b1 = (*(_keyed("a", i) for i in range(3)), _keyed("b", 0), _keyed("b", 1))
    for delivery in (a0, a1, a2, b0, b1):
        sequencer.place(delivery)
    # When a's first is given back (nacked), Then a's later ones go back with it, in order
    a0.returned = True
    assert sequencer.settled(a0) == (None, [a1, a2])
    # And key b is untouched; key a starts afresh with its redelivery
    assert sequencer.settled(b0) == (b1, [])
    assert sequencer.place(_keyed("a", 0)) is Place.START


def test_going_quiet_releases_every_waiting_message_and_starts_nothing_after() -> None:
    sequencer = Sequencer(10)
    a0, a1, b0, b1 = _keyed("a", 0), _keyed("a", 1), _keyed("b", 0), _keyed("b", 1)
    for delivery in (a0, a1, b0, b1):
        sequencer.place(delivery)
    assert sequencer.release_all() == [a1, b1]
    assert sequencer.settled(a0) == (None, [])


def test_a_key_holds_at_most_its_share_and_what_comes_beyond_goes_back_in_order() -> None:
    # Given a sequencer where one key holds at most 3 messages
    sequencer = Sequencer(3)
    a0, a1, a2, a3, a4, b0 = (*(_keyed("a", i) for i in range(5)), _keyed("b", 0))
    # When 5 of key a come, Then the first starts, two wait and the rest go back at once
    assert [sequencer.place(d) for d in (a0, a1, a2, a3)] == [
        Place.START, Place.WAIT, Place.WAIT, Place.BACK,
    ]  # fmt: skip
    # And while a is here, a later one of it goes back too, even with room (none passes a3)
    assert sequencer.settled(a0) == (a1, [])
    assert sequencer.place(a4) is Place.BACK
    # And another key is not held back by it
    assert sequencer.place(b0) is Place.START
    # And once a's held ones are done, a starts afresh with its redelivery
    assert sequencer.settled(a1) == (a2, [])
    assert sequencer.settled(a2) == (None, [])
    assert sequencer.place(a3) is Place.START


def _unstarted_pool(n: int, prefetch: int, per_key: int) -> Pool:
    """An ordered pool whose slot threads are not started: what it admits stays unstarted."""
    leases = FakeLeaser()
    processor = Processor(
        Registry(), FakeAcks(), leases, FakeDeadLetters(), (), ProcessorSettings()
    )
    return Pool(processor, leases, PoolLimits(n, prefetch), sequencer=Sequencer(per_key))


def test_an_ordered_pool_pulls_no_more_than_one_keys_share_at_once() -> None:
    # Given an ordered pool of 8 slots and a prefetch of 16, where a key holds at most 8
    pool = _unstarted_pool(8, 16, per_key=8)
    # Then a pull asks for 8, not the 24 it has room for: one pull cannot fill the hold with
    # one key's backlog
    assert pool.wait_for_room(timeout=0) == 8


def test_an_ordered_pool_pulls_while_what_it_holds_waits_behind_its_key() -> None:
    # Given an ordered pool of 2 slots and a prefetch of 4: it pulls at once while 2 or fewer
    # messages could start, else only once 3 of its 6 places are free
    pool = _unstarted_pool(2, 4, per_key=6)
    # When it holds 4 of one key: one to start, three waiting behind it
    pool.admit([_keyed("a", i) for i in range(4)])
    # Then it pulls for the 2 places left: the three behind their key cannot start, so they
    # do not count as messages waiting to start (counted, the pool waited while slots idled)
    assert pool.wait_for_room(timeout=0) == 2


class _Ledger:
    """A job that writes (key, number, start, end) and fails where it is told to."""

    def __init__(self, fail_once: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.lock = threading.Lock()
        self.runs: list[tuple[str, float, float]] = []
        self.fail_once = set(fail_once)

    def __call__(self, ctx: JobContext, payload: dict[str, Any]) -> None:
        started = time.monotonic()
        time.sleep(0.002)
        with self.lock:
            self.runs.append((ctx.job_id, started, time.monotonic()))
            if ctx.job_id in self.fail_once:
                self.fail_once.discard(ctx.job_id)
                raise RetryableError("asked to fail once")


def _ordered_pool(ledger: _Ledger, n: int, prefetch: int) -> tuple[Pool, FakeAcks]:
    jobs, acks, leases = Registry(), FakeAcks(), FakeLeaser()
    jobs.job("t.step")(ledger)
    settings = ProcessorSettings(ordered=True)
    processor = Processor(jobs, acks, leases, FakeDeadLetters(), (), settings)
    pool = Pool(processor, leases, PoolLimits(n, prefetch), sequencer=Sequencer(n + prefetch))
    pool.start()
    return pool, acks


def test_a_pool_runs_each_key_in_order_one_at_a_time_and_other_keys_side_by_side() -> None:
    # Given an ordered pool of 4 slots and 3 keys of 4 messages each, admitted at once
    ledger = _Ledger()
    pool, acks = _ordered_pool(ledger, n=4, prefetch=12)
    try:
        pool.admit([_keyed(k, i) for i in range(4) for k in "abc"])
        # Then all 12 run and are acked
        assert wait_for(lambda: len(acks.acked) == 12, timeout=10, interval=0.005)
    finally:
        pool.quiet()
    # And each key ran in order, never two at once
    for key in "abc":
        runs = [r for r in ledger.runs if r[0].startswith(f"{key}-")]
        assert [r[0] for r in runs] == [f"{key}-{i}" for i in range(4)]
        assert all(before[2] <= after[1] for before, after in itertools.pairwise(runs))


def test_a_pool_gives_back_a_failed_message_and_the_later_ones_of_its_key_unrun() -> None:
    # Given an ordered pool whose key a's second message fails once
    ledger = _Ledger(fail_once={"a-1"})
    pool, acks = _ordered_pool(ledger, n=2, prefetch=8)
    try:
        pool.admit([_keyed(k, i) for i in range(4) for k in "ab"])
        # Then key b runs through, and key a's first is acked
        assert wait_for(lambda: len(acks.acked) == 5, timeout=10, interval=0.005)
        assert wait_for(lambda: len(acks.modacked) == 3, timeout=10, interval=0.005)
    finally:
        pool.quiet()
    # And a's failed message and both after it are given back by a lapsing lease (never a
    # nack: the emulator redelivers a nacked one after its key's undelivered ones), none run
    assert sorted(a for a, _ in acks.modacked) == ["ack-a-1", "ack-a-2", "ack-a-3"]
    assert min(seconds for _, seconds in acks.modacked) == c.ORDERED_GIVE_BACK_SECONDS
    assert "ack-a-2" not in acks.acked and "ack-a-3" not in acks.acked
    assert [r[0] for r in ledger.runs if r[0].startswith("a-")] == ["a-0", "a-1"]
    assert pool.held == 0


def test_a_keyed_message_given_back_for_the_holds_bytes_sends_its_keys_later_ones_back_too() -> (
    None
):
    # Given an ordered pool bounded at 600 bytes, running key a's first message until told
    ran, go = [], threading.Event()
    jobs, acks, leases = Registry(), FakeAcks(), FakeLeaser()

    @jobs.job("t.step")
    def step(ctx: JobContext, payload: dict[str, Any]) -> None:
        if ctx.job_id == "a-0":
            go.wait(10)
        ran.append(ctx.job_id)

    processor = Processor(
        jobs, acks, leases, FakeDeadLetters(), (), ProcessorSettings(ordered=True)
    )
    pool = Pool(processor, leases, PoolLimits(4, 8, max_bytes=600), sequencer=Sequencer(6))
    pool.start()
    large = make_delivery(b'{"pad": "' + b"x" * 700 + b'"}', {"job": "t.step", "job_id": "x-0"})
    try:
        # When one pull brings a-0, a large message of another key, and a-1, which no longer
        # fits the hold's bytes and goes back
        pool.admit([_keyed("a", 0), large, _keyed("a", 1)])
        assert wait_for(lambda: ran == ["x-0"], timeout=10, interval=0.005)
        assert [ack_id for ack_id, _ in acks.modacked] == ["ack-a-1"]
        # ... and a-2 comes while a-1 is out (the large one done: there is room again)
        pool.admit([_keyed("a", 2)])
        # Then a-2 goes back at once too: it never runs before a-1
        assert [ack_id for ack_id, _ in acks.modacked] == ["ack-a-1", "ack-a-2"]
        go.set()
        assert wait_for(lambda: pool.held == 0, timeout=10, interval=0.005)
    finally:
        go.set()
        pool.quiet()
    assert ran == ["x-0", "a-0"]
    assert "ack-a-2" not in acks.acked


class _FailingPublisher:
    """Publishes nothing: each future fails, as the client's do for a key it stopped."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str]] = []
        self.resumed: list[tuple[str, str]] = []

    def publish(self, topic: str, data: bytes, ordering_key: str = "", **attributes: str) -> Any:
        self.sent.append((attributes["job_id"], ordering_key))
        future: Future[str] = Future()
        future.set_exception(RuntimeError("publish failed"))
        return future

    def resume_publish(self, topic: str, ordering_key: str) -> None:
        self.resumed.append((topic, ordering_key))


def test_a_failed_publish_resumes_its_key_and_still_raises() -> None:
    # Given a publisher whose publishes fail
    publisher = _FailingPublisher()
    # When a job with a key and one without are published
    for job_id, key in (("a", "k"), ("b", "")):
        with pytest.raises(RuntimeError, match="publish failed"):
            publish(
                publisher, "projects/p/topics/t", JobMessage("t.step", {}, job_id, ordering_key=key)
            )
    # Then each went out with its key, and only the keyed one's key was resumed
    assert publisher.sent == [("a", "k"), ("b", "")]
    assert publisher.resumed == [("projects/p/topics/t", "k")]
