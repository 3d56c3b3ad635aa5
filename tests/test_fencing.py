"""Fencing a run whose process was paused past its lease: the deadline check at settlement,
on an injected clock (pure logic: in-memory stores, in-process fakes for Pub/Sub)."""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator, Mapping
from types import SimpleNamespace
from typing import Any

import pytest

from tests.support import wait_for
from workerpool import JobContext
from workerpool.context import Flag
from workerpool.idempotency import Claimed, Done, HeldElsewhere, MemoryStore
from workerpool.idempotency.completions import Completions
from workerpool.idempotency.middleware import Idempotency
from workerpool.registry import Registry
from workerpool.slots import Limits, MemorySlots
from workerpool.slots.middleware import Concurrency, SlotLeases
from workerpool.testing.fakes import FakeAcks, FakeDeadLetters, FakeLeaser, make_delivery
from workerpool.worker.keeper import LeaseKeeper
from workerpool.worker.outcome import LostLease, Outcome
from workerpool.worker.processor import Processor
from workerpool.worker.run import Run
from workerpool.worker.timers import Timers

TTL = 60.0
OWNER = "w1"
KEY = "k"


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run() -> Any:
    """What the keeper reads and writes of a run: ``Run``'s lease fields, and its check."""
    run = SimpleNamespace(job=SimpleNamespace(job_id="j"), leases=[], lapsed="")
    run.lost_lease = lambda now: Run.lost_lease(run, now)  # type: ignore[arg-type]
    return run


def _keeper(what: str, clock: _Clock, renew: Any = None) -> LeaseKeeper[str]:
    timers = Timers(clock=clock)  # never started: no watch comes due by itself
    return LeaseKeeper(
        what, timers, TTL, renew=renew or (lambda keys: [True] * len(keys)),
        release=lambda keys: None, close_store=lambda: None, clock=clock,
    )  # fmt: skip


def test_a_lease_lapses_at_its_last_renewal_request_plus_the_ttl_on_the_monotonic_clock() -> None:
    # Given a claim granted to a request sent at 0, held by a run
    clock = _Clock()
    keeper = _keeper("claim", clock)
    run = _run()
    keeper.hold(run, "j", sent=0.0)
    # Then it holds until just before its deadline, and has lapsed at it
    assert run.lost_lease(TTL - 0.001) == ""
    assert run.lost_lease(TTL) == "claim"
    # When a renewal round sent at 30 renews it
    clock.now = 30.0
    keeper._renew_all()
    # Then its deadline is 30 + TTL, counted from before the renewal was sent
    assert run.lost_lease(TTL) == ""
    assert run.lost_lease(30.0 + TTL - 0.001) == ""
    assert run.lost_lease(30.0 + TTL) == "claim"


def test_a_lease_the_store_gave_to_another_has_lapsed_whatever_the_clock_says() -> None:
    # Given a slot whose renewal the store refuses (someone else holds it now), early on
    clock = _Clock()
    keeper = _keeper("slot", clock, renew=lambda keys: [False] * len(keys))
    run = _run()
    run.ctx = SimpleNamespace(cancelled=Flag())
    keeper.hold(run, "k", sent=0.0)
    clock.now = 1.0
    keeper._renew_all()
    # Then the run has lost it, long before its deadline, and was told to stop
    assert run.lost_lease(1.0) == "slot"
    assert run.ctx.cancelled.is_set()


def test_a_lease_let_go_in_time_no_longer_counts_one_let_go_after_its_deadline_does() -> None:
    # Given a run holding two slots, granted at 0
    clock = _Clock()
    keeper = _keeper("slot", clock)
    run = _run()
    early, late = keeper.hold_many(["a", "b"], 0.0, run)
    # When it gives the first back in time, and the second only after its deadline (paused)
    clock.now = TTL - 1
    keeper.let_go(early)
    assert run.lost_lease(TTL + 100) == "slot"  # the second is still held, and lapsed
    clock.now = TTL + 1
    keeper.let_go(late)
    # Then the run holds no lease any more, and says it lost one
    assert run.leases == [] and run.lost_lease(TTL + 100) == "slot"
    # And a run that let its lease go in time has lost none, however late it is asked
    other = _run()
    keeper.let_go(keeper.hold(other, "c", sent=clock.now))
    assert other.lost_lease(clock.now + 10 * TTL) == ""


def test_a_completion_whose_claim_lapsed_before_its_batch_is_not_recorded() -> None:
    # Given two completions queued, the claim of one of them lapsed (its process was paused)
    store = MemoryStore()
    for job_id in ("kept", "lapsed"):
        assert isinstance(store.claim(job_id, OWNER, f"m-{job_id}", TTL), Claimed)
    answers: dict[str, Outcome] = {}
    completions: Completions[str] = Completions(
        store, OWNER, patience=5, let_go=lambda held: None, lapsed=lambda held: held == "lapsed"
    )
    for job_id in ("kept", "lapsed"):
        answer = functools.partial(answers.__setitem__, job_id)
        completions.add(job_id, f"m-{job_id}", lambda: False, job_id, answer)
    # When the recorder sends its batch
    completions.start()
    try:
        assert wait_for(lambda: len(answers) == 2, timeout=10)
    finally:
        completions.close(5)
    # Then only the one still held is recorded; the other is answered as a lost claim
    assert isinstance(answers["lapsed"], LostLease) and not isinstance(answers["kept"], LostLease)
    assert isinstance(store.claim("kept", "w2", "m", TTL), Done)
    assert isinstance(store.claim("lapsed", "w2", "m", TTL), HeldElsewhere)


class _PausedWorker:
    """A processor with the idempotency and concurrency middleware (a key of one slot) whose
    clock the job moves on: the job "pauses" its process (a GC pause, a frozen VM) for
    ``pause`` seconds, with no wait."""

    def __init__(
        self, timers: Timers, pause: float, claim_ttl: float = TTL, slot_ttl: float = 10 * TTL
    ) -> None:
        self.store = MemoryStore()
        self.slots = MemorySlots()
        self.jump = 0.0
        self.tokens: list[tuple[int | None, Mapping[str, int]]] = []
        jobs = Registry()

        @jobs.job("t.paused", concurrency=KEY)
        def paused(ctx: JobContext, payload: dict[str, Any]) -> None:
            self.tokens.append((ctx.fencing_token, ctx.slot_tokens))
            self.jump += pause

        self.acks = FakeAcks()
        self.idempotency = Idempotency(self.store, OWNER, timers, ttl=claim_ttl)
        leases = SlotLeases(self.slots, OWNER, Limits({KEY: 1}), timers, ttl=slot_ttl)
        self.concurrency = Concurrency(leases)
        self.processor = Processor(
            jobs, self.acks, FakeLeaser(), FakeDeadLetters(), [self.idempotency, self.concurrency],
            clock=lambda: time.monotonic() + self.jump,
        )  # fmt: skip
        self.idempotency.start()
        self.concurrency.start()

    def run(self) -> None:
        delivery = make_delivery(b"{}", {"job": "t.paused", "job_id": "j1"}, message_id="m-1")
        self.processor.process(delivery)  # (its completion, if any, is recorded off this thread)
        assert wait_for(lambda: delivery.settled, timeout=10)

    def close(self) -> None:
        self.idempotency.close(timeout=5)
        self.concurrency.close(timeout=5)


@pytest.fixture
def worker(request: pytest.FixtureRequest, timers: Timers) -> Iterator[_PausedWorker]:
    made = _PausedWorker(timers, *request.param)
    try:
        yield made
    finally:
        made.close()


@pytest.mark.parametrize("worker", [(TTL + 1,)], indirect=True)
def test_a_run_paused_past_its_claim_is_not_acked_nor_recorded_and_its_message_goes_back(
    worker: _PausedWorker,
) -> None:
    # Given a job whose process pauses past its claim's TTL while it runs
    # When it returns
    worker.run()
    # Then its message is not acked but given back as a lost claim's, to come back soon
    assert worker.acks.acked == []
    assert worker.acks.modacked == [("ack-m-1", 1.0)]
    assert worker.processor.stats == {"deferred": 1}
    # And the job id is not recorded as done: the next claim is granted, with a larger token
    [(token, _)] = worker.tokens
    again = worker.store.claim("j1", "w2", "m-1", TTL)
    assert isinstance(again, Claimed) and token is not None and again.token > token


@pytest.mark.parametrize("worker", [(TTL - 1,)], indirect=True)
def test_a_run_that_returns_before_its_claim_lapses_is_acked_and_recorded(
    worker: _PausedWorker,
) -> None:
    # Given a job whose process pauses for less than its claim's TTL
    # When it returns
    worker.run()
    # Then it is acked as done and recorded, its token the claim's
    assert worker.acks.acked == ["ack-m-1"] and worker.processor.stats == {"done": 1}
    assert isinstance(worker.store.claim("j1", "w2", "m-2", TTL), Done)
    assert worker.tokens == [(1, {KEY: 1})]


@pytest.mark.parametrize("worker", [(TTL + 1, 10 * TTL, TTL)], indirect=True)
def test_a_run_paused_past_its_slot_alone_is_not_acked_and_gives_its_claim_and_slot_back(
    worker: _PausedWorker,
) -> None:
    # Given a job whose process pauses past its slot's TTL, but not its claim's
    # When it returns
    worker.run()
    # Then its message is not acked but given back, and neither claim nor slot is held
    assert worker.acks.acked == [] and worker.processor.stats == {"deferred": 1}
    assert isinstance(worker.store.claim("j1", "w2", "m-1", TTL), Claimed)
    assert wait_for(lambda: not worker.slots.table(KEY).holders, timeout=5)
