"""Keeping idempotency claims alive: a run whose claim cannot be renewed stops before the
claim can lapse, whatever the store does (pure logic: in-memory store behind a fault wrapper,
in-process fakes for Pub/Sub)."""

from __future__ import annotations

import gc
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest
from google.api_core import exceptions as gexc

from tests.fakes import FakeClock
from tests.faults.store import FaultyStore
from tests.support import wait_for
from workerpool import AsyncJobContext, JobContext, RetryableError
from workerpool.idempotency import Claimed, Done, HeldElsewhere, MemoryStore, StoreUnavailable
from workerpool.idempotency.completions import Completions
from workerpool.idempotency.middleware import Idempotency
from workerpool.registry import Registry
from workerpool.testing.fakes import FakeAcks, FakeDeadLetters, FakeLeaser, make_delivery
from workerpool.worker.backoff import Backoff
from workerpool.worker.keeper import LeaseKeeper
from workerpool.worker.limits import PoolLimits
from workerpool.worker.middleware import Ended, Middleware, TimeLimit
from workerpool.worker.outcome import Outcome
from workerpool.worker.pool import Pool
from workerpool.worker.processor import Ending, Processor, ProcessorSettings
from workerpool.worker.run import Run
from workerpool.worker.timers import Timers
from workerpool.worker.together import together

TTL = 0.6  # margin ttl/6 = 0.1 s, renewals every 0.2 s
OWNER = "w1"

# Every class of error a store call can fail with, as the backends raise them.
STORE_ERRORS = [
    StoreUnavailable("down"),
    gexc.Aborted("contention"),
    gexc.Cancelled("cancelled"),
    gexc.Unauthenticated("token expired"),
    gexc.PermissionDenied("no"),
    ValueError("Cannot invoke RPC on closed channel!"),
    sqlite3.DatabaseError("database disk image is malformed"),
    RuntimeError("a bug in a backend"),
]


class _Worker:
    """A processor with the idempotency middleware on ``store``, and a job that runs until
    cancelled (or ``seconds``), noting when its cancel came."""

    def __init__(self, store: FaultyStore, timers: Timers, *, seconds: float = 10.0) -> None:
        self.store = store
        self.jobs = Registry()
        self.cancelled_at: list[float] = []
        self.started_at: list[float] = []

        @self.jobs.job("t.long")
        def long(ctx: JobContext, payload: dict[str, Any]) -> None:
            self.started_at.append(time.monotonic())
            if ctx.cancelled.wait(seconds):
                self.cancelled_at.append(time.monotonic())

        self.held_at_cancel: list[object] = []
        self.healthy_at_cancel: list[bool] = []

        @self.jobs.job("t.checks")
        def checks(ctx: JobContext, payload: dict[str, Any]) -> None:
            self.started_at.append(time.monotonic())
            if ctx.cancelled.wait(seconds):
                self.cancelled_at.append(time.monotonic())
                # What another worker would get if it tried to start this job id now
                self.held_at_cancel.append(store.inner.claim(ctx.job_id, "w2", "m-2", TTL))
                self.healthy_at_cancel.append(self.idempotency.healthy)
                raise RetryableError("cancelled")

        self.acks = FakeAcks()
        self.idempotency = Idempotency(store, OWNER, timers, ttl=TTL)
        self.processor = Processor(
            self.jobs,
            self.acks,
            FakeLeaser(),
            FakeDeadLetters(),
            [self.idempotency],
            ProcessorSettings(Backoff(1.0, 10.0)),
        )
        self.idempotency.start()

    def process(
        self, job_id: str = "j1", message_id: str = "m-1", job: str = "t.long"
    ) -> threading.Thread:
        delivery = make_delivery(b"{}", {"job": job, "job_id": job_id}, message_id=message_id)
        thread = threading.Thread(target=self.processor.process, args=(delivery,))
        thread.start()
        return thread

    def close(self) -> None:
        self.idempotency.close(timeout=5)


def test_a_run_whose_claim_cannot_be_renewed_stops_before_the_claim_can_lapse(
    timers: Timers,
) -> None:
    # One worker per kind of store error, side by side (each case waits out its claim)
    with ThreadPoolExecutor(len(STORE_ERRORS)) as pool:
        outcomes = list(pool.map(lambda e: _unrenewable(e, timers), STORE_ERRORS))
    failed = [
        f"{type(e).__name__}: {o!r}" for e, o in zip(STORE_ERRORS, outcomes, strict=True) if o
    ]
    assert not failed, failed


def _unrenewable(error: BaseException, timers: Timers) -> AssertionError | None:
    """The case of one store error; the assertion it failed, if any."""
    try:
        _check_unrenewable(error, timers)
    except AssertionError as exc:
        return exc
    return None


def _check_unrenewable(error: BaseException, timers: Timers) -> None:
    # Given a job running under a claim of 0.6 s, and a store whose every renewal fails
    store = FaultyStore(MemoryStore()).fail("renew", error)
    worker = _Worker(store, timers)
    try:
        run = worker.process(job="t.checks")
        # When the renewals keep failing
        run.join(timeout=10)
        # Then the run was cancelled before its claim could lapse, with time to stop, while
        # nobody else could start the job id yet
        [started], [cancelled] = worker.started_at, worker.cancelled_at
        assert TTL / 2 < cancelled - started < TTL, cancelled - started
        [held] = worker.held_at_cancel
        assert isinstance(held, HeldElsewhere) and held.owner == OWNER
        # and its message was handed back to come back once the claim has lapsed
        assert worker.processor.stats == {"deferred": 1}
        [(ack_id, delay)] = worker.acks.modacked
        assert ack_id == "ack-m-1" and 0.9 <= delay <= 1.0 + TTL
        assert not worker.acks.acked
        # and once the claim has lapsed (or the failed run released it) another worker can
        time.sleep(TTL)
        assert store.inner.claim("j1", "w2", "m-2", TTL) == Claimed()
        # and the worker said it was unhealthy meanwhile
        assert worker.healthy_at_cancel == [False]
    finally:
        worker.close()


@pytest.mark.parametrize(
    "claim_left", [TTL / 3, TTL * 0.9, 100.0], ids=["renewal-missed", "renewed", "long"]
)
def test_a_message_back_while_another_worker_holds_its_claim_waits_no_later_than_its_lapse(
    timers: Timers, claim_left: float
) -> None:
    # Given a job id claimed for this very message by another worker of the same claim TTL,
    # for ``claim_left`` s more by the store's clock: less than half its TTL (it missed a
    # renewal: it was killed), or more (it still renews it)
    store = FaultyStore(MemoryStore(clock=FakeClock()))
    store.inner.claim("j1", "w2", "m-1", claim_left)
    worker = _Worker(store, timers)
    try:
        # When the message comes back on its 5th delivery (the backoff: 5-10 s)
        attributes = {"job": "t.long", "job_id": "j1"}
        worker.processor.process(make_delivery(b"{}", attributes, message_id="m-1", attempt=5))
        # Then it is given back, not run, to come again a second after the claim of a holder
        # that missed a renewal would lapse (sooner than its backoff), else after its backoff
        assert worker.processor.stats == {"deferred": 1} and not worker.started_at
        [(ack_id, delay)] = worker.acks.modacked
        assert ack_id == "ack-m-1"
        if claim_left < TTL / 2:
            assert delay == pytest.approx(claim_left + 1.0, abs=1e-3)
        else:
            assert 5.0 <= delay <= 10.0
    finally:
        worker.close()


def test_a_claim_found_held_at_admission_is_asked_again_when_its_message_starts(
    timers: Timers,
) -> None:
    # Given a message admitted while another worker held its job id's claim for it
    store = FaultyStore(MemoryStore())
    store.inner.claim("j1", "w2", "m-1", 100.0)
    worker = _Worker(store, timers, seconds=0.01)
    try:
        delivery = make_delivery(b"{}", {"job": "t.long", "job_id": "j1"}, message_id="m-1")
        worker.processor.admitted([delivery])
        # When that worker lets the claim go (its run failed) before the message starts
        store.inner.release("j1", "w2", "m-1", failed=True)
        worker.processor.process(delivery)
        # Then the message claims the job id afresh and runs, not deferred on what admission
        # found
        assert len(worker.started_at) == 1
        assert "deferred" not in worker.processor.stats
    finally:
        worker.close()


def test_a_stalled_store_cannot_hold_a_run_past_its_claim(timers: Timers) -> None:
    # Given a store whose renewals hang for 30 s
    store = FaultyStore(MemoryStore()).stall("renew", 30)
    worker = _Worker(store, timers)
    try:
        # When a job runs under a 0.6 s claim
        run = worker.process()
        run.join(timeout=10)
        # Then it was still cancelled and handed back in time: the watch does not wait for the
        # renewal call that hangs
        [started], [cancelled] = worker.started_at, worker.cancelled_at
        assert cancelled - started < TTL
        assert worker.processor.stats == {"deferred": 1}
    finally:
        store.heal()
        worker.close()


def test_renewals_that_fail_for_a_while_then_recover_keep_the_run(timers: Timers) -> None:
    # Given a job of 1.5 s under a 0.6 s claim, and renewals that fail half the time
    store = FaultyStore(MemoryStore(), seed=7).fail(
        "renew", StoreUnavailable("blip"), probability=0.5
    )
    worker = _Worker(store, timers, seconds=1.5)
    try:
        # When it runs, with the first failure healed after 0.3 s
        run = worker.process()
        time.sleep(0.3)
        store.heal()
        run.join(timeout=10)
        # Then it ran to its end, renewed, and was recorded as done
        assert worker.cancelled_at == []
        # (acked once its completion is recorded, by the recording thread)
        assert wait_for(lambda: worker.processor.stats == {"done": 1}, timeout=5, interval=0.01)
        assert store.calls["renew"] >= 5
        assert worker.idempotency.healthy
    finally:
        worker.close()


def test_the_keeper_survives_an_unexpected_exception_and_carries_on(
    timers: Timers, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a job of 1.5 s under a 0.6 s claim, and a bug that breaks one renewal round
    store = FaultyStore(MemoryStore())
    worker = _Worker(store, timers, seconds=1.5)
    rounds = {"n": 0}
    real = worker.idempotency.keeper._renew_all

    def buggy() -> None:
        rounds["n"] += 1
        if rounds["n"] == 1:
            raise KeyError("a bug in a renewal round")
        real()

    monkeypatch.setattr(worker.idempotency.keeper, "_renew_all", buggy)
    try:
        # When it runs
        run = worker.process()
        run.join(timeout=10)
        # Then the keeper logged the bug, kept renewing, and the job finished uncancelled
        assert rounds["n"] >= 3
        assert worker.cancelled_at == []
        # (acked once its completion is recorded, by the recording thread)
        assert wait_for(lambda: worker.processor.stats == {"done": 1}, timeout=5, interval=0.01)
        assert worker.idempotency.healthy
    finally:
        worker.close()


def test_claims_of_interrupted_runs_are_released_in_one_call_off_the_drain_path(
    timers: Timers,
) -> None:
    # Given 5 runs holding claims, and a store whose releases hang for 30 s
    store = FaultyStore(MemoryStore())
    worker = _Worker(store, timers)
    try:
        runs = [worker.process(f"j{i}", f"m-{i}") for i in range(5)]
        assert wait_for(lambda: len(worker.started_at) == 5, timeout=10, interval=0.005)
        store.stall("release", 30)
        # When the drain deadline interrupts them
        started = time.monotonic()
        assert worker.processor.interrupt_running() == 5
        interrupted_in = time.monotonic() - started
        for run in runs:
            run.join(timeout=10)
        # Then the hand-back did not wait for the store, and the releases went as one call
        assert interrupted_in < 0.2
        assert worker.processor.stats == {"drained": 5}
        assert wait_for(lambda: store.calls["release"] == 1, timeout=10, interval=0.005)
    finally:
        store.heal()
        worker.close()


def test_a_late_renewal_reply_never_releases_a_newer_claim_of_the_same_message(
    timers: Timers,
) -> None:
    # Given a run whose renewal hangs in the store
    store = FaultyStore(MemoryStore())
    worker = _Worker(store, timers)
    failing, second_running, checked = threading.Event(), threading.Event(), threading.Event()

    @worker.jobs.job("t.twice")
    def twice(ctx: JobContext, payload: dict[str, Any]) -> None:
        if not failing.is_set():
            failing.set()
            ctx.cancelled.wait(0.5)
            raise RetryableError("first run fails")
        second_running.set()
        checked.wait(10)  # runs, holding its claim, until the test has looked

    try:
        store.stall("renew", 30)
        first = worker.process(job="t.twice")
        # a renewal is in flight, stalled
        assert wait_for(lambda: store.calls["renew"] >= 1, timeout=10, interval=0.005)
        first.join(timeout=10)  # the first run failed and released its claim
        # When the same message is claimed again here, and then the stalled reply comes back
        second = worker.process(job="t.twice")
        assert second_running.wait(10)
        store.heal()
        time.sleep(TTL)  # keeper rounds after the reply
        # Then the newer claim is still held: nobody else could start the job id
        held = store.inner.claim("j1", "w2", "m-2", TTL)
        assert isinstance(held, HeldElsewhere) and held.owner == OWNER
        checked.set()
        second.join(timeout=10)
    finally:
        checked.set()
        store.heal()
        worker.close()


def test_a_run_handed_back_while_its_claim_is_made_never_starts(timers: Timers) -> None:
    # Given a claim call that hangs in the store
    store = FaultyStore(MemoryStore())
    worker = _Worker(store, timers)
    store.stall("claim", 30)
    try:
        run = worker.process()
        assert wait_for(lambda: store.calls["claim"] == 1, timeout=10, interval=0.005)
        # When the drain deadline hands the run back, and then the claim comes through
        assert worker.processor.interrupt_running() == 1
        store.heal()
        run.join(timeout=10)
        # Then its handler never started, and the claim was let go at once
        assert worker.started_at == []
        assert worker.processor.stats == {"drained": 1}
        assert store.inner.claim("j1", "w2", "m-2", TTL) == Claimed()
    finally:
        store.heal()
        worker.close()


class _HoldsItsAfter(Middleware):
    """A middleware inside the idempotency one whose ``after`` waits to be let through: a
    run whose handler has returned, still on its way out of the chain."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.let_through = threading.Event()

    def after(self, run: Run, ended: Ended) -> Ended:
        self.reached.set()
        self.let_through.wait(10)
        return ended


@pytest.mark.parametrize("handler", ["succeeds", "fails"])
def test_a_run_handed_back_after_its_handler_returned_leaves_its_claim_to_its_own_end(
    timers: Timers, handler: str
) -> None:
    # Given a run whose handler has returned, on its way out through a middleware inside the
    # idempotency one
    store = FaultyStore(MemoryStore())
    worker = _Worker(store, timers)
    holding = _HoldsItsAfter()
    worker.processor = Processor(
        worker.jobs, worker.acks, FakeLeaser(), FakeDeadLetters(), [worker.idempotency, holding],
        ProcessorSettings(Backoff(1.0, 10.0)),
    )  # fmt: skip

    @worker.jobs.job("t.quick")
    def quick(ctx: JobContext, payload: dict[str, Any]) -> None:
        if handler == "fails":
            raise RetryableError("it failed")

    try:
        run = worker.process(job="t.quick")
        assert holding.reached.wait(10)
        # When the drain deadline hands its message back then
        assert worker.processor.interrupt_running() == 1
        time.sleep(TTL)  # keeper rounds: a release queued by the hand-back would be made
        # Then no other worker can start the job meanwhile: its claim is still held
        assert isinstance(store.inner.claim("j1", "w2", "m-2", TTL), HeldElsewhere)
        holding.let_through.set()
        run.join(timeout=10)
        assert worker.processor.stats == {"drained": 1}
        # And its own end decides: a success is recorded done (then the claim goes), a
        # failure lets the job go
        answers: list[object] = []

        def decided() -> bool:
            answers.append(store.inner.claim("j1", "w2", "m-3", TTL))
            return not isinstance(answers[-1], HeldElsewhere)

        assert wait_for(decided, timeout=10, interval=0.01)
        assert isinstance(answers[-1], Done if handler == "succeeds" else Claimed), answers
    finally:
        holding.let_through.set()
        worker.close()


def test_an_async_run_handed_back_while_its_end_waits_for_a_thread_keeps_its_claim(
    timers: Timers,
) -> None:
    # Given an async job that succeeded, the rest of its run waiting for a thread to carry it
    store = FaultyStore(MemoryStore())
    worker = _Worker(store, timers)

    @worker.jobs.job("t.async")
    async def quick(ctx: AsyncJobContext, payload: dict[str, Any]) -> None:
        pass

    rest: list[Callable[[], Ending]] = []
    try:
        delivery = make_delivery(b"{}", {"job": "t.async", "job_id": "j1"}, message_id="m-1")
        assert worker.processor.process(delivery, resume=rest.append) is Ending.CARRIED
        assert wait_for(lambda: rest, timeout=10)
        # When the drain deadline hands its message back then
        assert worker.processor.interrupt_running() == 1
        time.sleep(TTL)  # keeper rounds: a release queued by the hand-back would be made
        # Then no other worker can start the job meanwhile
        assert isinstance(store.inner.claim("j1", "w2", "m-2", TTL), HeldElsewhere)
        # And once a thread carries the rest, the job is recorded done
        rest[0]()
        assert wait_for(
            lambda: isinstance(store.inner.claim("j1", "w2", "m-3", TTL), Done), timeout=10
        )
        assert worker.processor.stats == {"drained": 1}
    finally:
        worker.close()


class _StopsInItsAfter(Middleware):
    """A middleware outside the idempotency one whose ``after`` raises what is no
    ``Exception`` (``sys.exit()`` in a hook, say)."""

    def after(self, run: Run, ended: Ended) -> Ended:
        raise SystemExit("a hook called sys.exit()")


def test_an_outer_after_that_raises_a_base_exception_still_records_the_job_and_frees_its_id(
    timers: Timers,
) -> None:
    # Given a job that succeeds, under a middleware outside the idempotency one whose after
    # raises SystemExit
    store = FaultyStore(MemoryStore())
    worker = _Worker(store, timers)
    worker.processor = Processor(
        worker.jobs, worker.acks, FakeLeaser(), FakeDeadLetters(),
        [_StopsInItsAfter(), worker.idempotency], ProcessorSettings(Backoff(1.0, 10.0)),
    )  # fmt: skip
    runs: list[str] = []
    worker.jobs.job("t.quick")(lambda ctx, payload: runs.append(ctx.job_id))
    try:
        # When its run ends
        delivery = make_delivery(b"{}", {"job": "t.quick", "job_id": "j1"}, message_id="m-1")
        worker.processor.process(delivery)
        # Then the run is a failure, retried (nacked) once the success inside is recorded,
        # not an escape from the slot
        assert wait_for(lambda: worker.processor.stats == {"retried": 1}, timeout=10)
        assert len(worker.acks.modacked) == 1 and worker.acks.acked == []
        # And the job id is not held for good: the success inside is recorded done, and the
        # message's next delivery here does not run the job again
        assert isinstance(store.inner.claim("j1", "w2", "m-1", TTL), Done)
        again = make_delivery(b"{}", {"job": "t.quick", "job_id": "j1"}, message_id="m-1")
        worker.processor.process(again)
        assert wait_for(lambda: worker.processor.stats["retried"] == 2, timeout=10)
        assert runs == ["j1"]
    finally:
        worker.close()


def test_a_lease_that_ends_while_its_renewal_is_in_flight_is_not_taken_over(
    timers: Timers, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a keeper whose renewal round is in flight when its one run completes (the store
    # then says the claim is no longer a live claim of ours)
    in_flight, answer = threading.Event(), threading.Event()

    def renew(keys: Any) -> list[bool]:
        in_flight.set()
        answer.wait(5)
        return [False] * len(keys)

    keeper: LeaseKeeper[str] = LeaseKeeper(
        "claim", timers, 0.6, renew=renew, release=lambda keys: None, close_store=lambda: None
    )
    run = SimpleNamespace(ctx=SimpleNamespace(cancelled=threading.Event()),
                          job=SimpleNamespace(job_id="j1"), leases=[], lapsed="")  # fmt: skip
    keeper.start()
    try:
        held = keeper.hold(run, "j1", time.monotonic())  # type: ignore[arg-type]
        assert in_flight.wait(5)
        # When the run ends (its claim completed) before the renewal's answer comes back
        keeper.let_go(held)
        answer.set()
    finally:
        keeper.close(timeout=5)  # joins the keeper's thread: the round has ended
    # Then nothing is cancelled and nobody is told the claim was taken over
    assert not run.ctx.cancelled.is_set()
    assert "taken over" not in caplog.text


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _LeaseRun:
    """What the keeper reads of a run: its job id, and where it is handed back."""

    def __init__(self, job_id: str) -> None:
        self.job = SimpleNamespace(job_id=job_id)
        self.handed_back: list[object] = []
        self.leases: list[object] = []
        self.lapsed = ""

    def hand_back(self, outcome: object) -> None:
        self.handed_back.append(outcome)


def _due(timers: Timers, now: float) -> None:
    """Fire, on this thread, the timers of an unstarted ``Timers`` due by ``now``."""
    for when, _, timer in sorted(timers._heap, key=lambda entry: entry[:2]):
        if when <= now and not timer.cancelled:
            timer.cancelled = True
            timer.callback()


def _keeper(clock: _Clock, renew: Any = None) -> tuple[LeaseKeeper[str], Timers]:
    timers = Timers(clock=clock)  # not started: its due timers are fired by _due
    keeper: LeaseKeeper[str] = LeaseKeeper(
        "claim", timers, 60.0, renew=renew or (lambda keys: [True] * len(keys)),
        release=lambda keys: None, close_store=lambda: None, clock=clock,
    )  # fmt: skip
    return keeper, timers


def test_leases_taken_together_share_one_watch_that_ends_with_the_last_and_keeps_no_run() -> None:
    # Given three leases taken by one claim call, one of them by a run
    clock = _Clock()
    keeper, timers = _keeper(clock)
    run = _LeaseRun("b")
    gone = weakref.ref(run)
    held = keeper.hold_many(["a", "b", "c"], clock.now)
    assert keeper.adopt(held[1], run)  # type: ignore[arg-type]
    # Then one timer watches them all
    assert len(timers) == 1
    # When two of them end, it still watches the third; when the third ends, it is cancelled
    keeper.let_go(held[0])
    keeper.let_go(held[1])
    assert len(timers) == 1
    keeper.let_go(held[2])
    assert len(timers) == 0
    # And the cancelled timer, still in the heap until a sweep, keeps no run alive
    del held, run
    assert gone() is None and timers._heap


def test_a_run_that_holds_its_lease_is_freed_without_the_garbage_collector_once_let_go() -> None:
    # Given a run holding its lease, as a run whose completion is being recorded does
    clock = _Clock()
    keeper, _ = _keeper(clock)
    run = _LeaseRun("a")
    held = keeper.hold(run, "a", clock.now)  # type: ignore[arg-type]
    run.completion = held  # type: ignore[attr-defined]
    gone = weakref.ref(run)
    gc.disable()
    try:
        # When the lease is let go and nothing else holds either
        keeper.let_go_many([held])
        del run, held
        # Then the run is gone at once, by reference counting alone
        assert gone() is None
    finally:
        gc.enable()


def test_a_shared_watch_hands_back_only_the_runs_still_under_it_when_they_may_lapse() -> None:
    # Given three leases of one claim call: one waiting, one adopted by a run, one whose run ended
    clock = _Clock()
    keeper, timers = _keeper(clock)
    waiting, running, ended = keeper.hold_many(["a", "b", "c"], clock.now)
    runs = {key: _LeaseRun(key) for key in "bc"}
    assert keeper.adopt(running, runs["b"])  # type: ignore[arg-type]
    assert keeper.adopt(ended, runs["c"])  # type: ignore[arg-type]
    keeper.let_go(ended)
    # When none was renewed and the watch comes due, a margin before they could lapse
    clock.now = 60.0 - 10.0
    _due(timers, clock.now)
    # Then the running one is handed back, once, the ended one not; the waiting one is dropped
    assert wait_for(lambda: runs["b"].handed_back, timeout=5)
    assert len(runs["b"].handed_back) == 1 and runs["c"].handed_back == []
    assert not keeper.adopt(waiting, _LeaseRun("a"))  # type: ignore[arg-type]
    assert not keeper.healthy


def test_a_renewal_round_moves_what_it_renewed_to_a_watch_of_its_own() -> None:
    # Given two leases of one claim call, both adopted by runs, one of them taken over
    clock = _Clock()
    keeper, timers = _keeper(clock, renew=lambda keys: [key == "a" for key in keys])
    held = keeper.hold_many(["a", "b"], clock.now)
    runs = {key: _LeaseRun(key) for key in "ab"}
    for lease in held:
        runs[lease.key].ctx = SimpleNamespace(cancelled=threading.Event())  # type: ignore[attr-defined]
        assert keeper.adopt(lease, runs[lease.key])  # type: ignore[arg-type]
    # When a renewal round 20 s later renews the first, and says the second is not ours
    clock.now = 20.0
    keeper._renew_all()
    # Then the renewed one has a watch of its own, due a margin before its new expiry; the
    # other's run is cancelled, and its lease stays under the first watch until the run ends
    assert sorted(when for when, _, timer in timers._heap if not timer.cancelled) == [50.0, 70.0]
    assert runs["b"].ctx.cancelled.is_set()  # type: ignore[attr-defined]
    # And when the first watch comes due, only the run still under it is handed back
    clock.now = 50.0
    _due(timers, clock.now)
    assert wait_for(lambda: runs["b"].handed_back, timeout=5)
    assert runs["a"].handed_back == []
    # But at the new watch's time, unrenewed since, the renewed one is
    clock.now = 70.0
    _due(timers, clock.now)
    assert wait_for(lambda: runs["a"].handed_back, timeout=5)


# --- claims taken as a pull is admitted, completions recorded off the slots ------------------


class _PoolWorker:
    """A pool of ``n`` slots (prefetch 1) with the idempotency middleware on ``store``; its
    job "t.wait" runs until ``go`` is set, "t.quick" returns at once."""

    def __init__(self, store: FaultyStore, timers: Timers, n: int, *, ttl: float = TTL) -> None:
        self.jobs = Registry()
        self.go = threading.Event()
        self.runs: list[str] = []

        @self.jobs.job("t.wait")
        def wait(ctx: JobContext, payload: dict[str, Any]) -> None:
            self.runs.append(ctx.job_id)
            self.go.wait(10)

        self.jobs.job("t.quick")(lambda ctx, payload: self.runs.append(ctx.job_id))
        self.acks, leases = FakeAcks(), FakeLeaser()
        self.idempotency = Idempotency(store, OWNER, timers, ttl=ttl)
        self.processor = Processor(
            self.jobs, self.acks, leases, FakeDeadLetters(), [self.idempotency],
            ProcessorSettings(Backoff(1.0, 10.0)),
        )  # fmt: skip
        self.pool = Pool(self.processor, leases, PoolLimits(n, prefetch=1))
        self.idempotency.start()
        self.pool.start()

    def admit(self, job: str, count: int) -> None:
        self.pool.admit(
            [make_delivery(b"{}", {"job": job, "job_id": f"j{i}"}, message_id=f"m{i}")
             for i in range(count)]
        )  # fmt: skip

    def close(self) -> None:
        self.go.set()
        self.pool.join(time.monotonic() + 5)
        self.idempotency.close(timeout=5)


def test_a_pulls_job_ids_are_claimed_at_once_and_acked_only_once_their_completion_is_recorded(
    timers: Timers,
) -> None:
    # Given a pool of 2 slots whose store stalls every completion
    store = FaultyStore(MemoryStore())
    store.stall("complete", 30)
    worker = _PoolWorker(store, timers, 2)
    try:
        # When a pull of 3 no-op jobs is admitted
        worker.admit("t.quick", 3)
        # Then their job ids were claimed in one call, and no run claimed again
        assert wait_for(lambda: len(worker.runs) == 3, timeout=10, interval=0.005)
        assert store.calls["claim"] == 1
        # And the slots went on while the first completion was stalled, but nothing was
        # acked, and every message is still held (none more can be pulled)
        assert worker.acks.acked == []
        assert worker.pool.held == 3 and worker.pool.wait_for_room(0) == 0
        assert worker.pool.running == 0
        # When the store answers again
        store.heal()
        # Then each is acked once its completion is recorded, in batches, not one call each
        assert wait_for(lambda: len(worker.acks.acked) == 3, timeout=10, interval=0.005)
        assert store.calls["complete"] in (1, 2)
        assert all(isinstance(store.inner.claim(f"j{i}", "w2", "m", TTL), Done) for i in range(3))
        assert wait_for(lambda: worker.pool.held == 0, timeout=5, interval=0.005)
        assert worker.processor.stats == {"done": 3}
    finally:
        store.heal()
        worker.close()


def test_a_run_past_its_timeout_that_succeeds_waits_out_a_store_outage_and_is_acked(
    timers: Timers,
) -> None:
    # Given a job whose handler goes on past its timeout and then succeeds, and a store that
    # cannot record completions for now
    jobs, ended = Registry(), threading.Event()

    @jobs.job("t.late", timeout=0.05)
    def late(ctx: JobContext, payload: dict[str, Any]) -> None:
        ctx.timed_out.wait(10)  # its work ignores the cancel that comes with the timeout
        ended.set()

    store = FaultyStore(MemoryStore())
    store.fail("complete", StoreUnavailable("down"))
    acks, leases = FakeAcks(), FakeLeaser()
    idempotency = Idempotency(store, OWNER, timers, ttl=5.0)
    processor = Processor(
        jobs, acks, leases, FakeDeadLetters(), [TimeLimit(timers), idempotency],
        ProcessorSettings(Backoff(1.0, 10.0)),
    )  # fmt: skip
    idempotency.start()
    try:
        # When it runs, and the store answers again after refusing its completion once
        processor.process(make_delivery(b"{}", {"job": "t.late", "job_id": "j"}, message_id="m"))
        assert ended.is_set()
        assert wait_for(lambda: store.calls["complete"] >= 1, timeout=10, interval=0.005)
        store.heal()
        # Then its success is recorded and its message acked: it does not run again
        assert wait_for(lambda: acks.acked == ["ack-m"], timeout=10, interval=0.005)
        assert acks.modacked == []
        assert isinstance(store.inner.claim("j", "w2", "m2", TTL), Done)
        assert processor.stats == {"done": 1}
    finally:
        store.heal()
        idempotency.close(timeout=5)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_bug_letting_recorded_claims_go_still_settles_and_frees_their_job_ids(
    timers: Timers, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a pool whose lease keeper fails to let recorded claims go (a bug)
    store = FaultyStore(MemoryStore())
    worker = _PoolWorker(store, timers, 2)

    def broken(held: object) -> None:
        raise RuntimeError("a let-go bug")

    monkeypatch.setattr(worker.idempotency.keeper, "let_go_many", broken)
    try:
        # When jobs run and their completions are recorded
        worker.admit("t.quick", 3)
        # Then every message is still acked, the recording thread carries on, and the job
        # ids are busy here no more (a copy would find them done, not running here)
        assert wait_for(lambda: len(worker.acks.acked) == 3, timeout=10, interval=0.005)
        assert worker.processor.stats == {"done": 3}
        assert wait_for(lambda: not worker.idempotency._active, timeout=5, interval=0.005)
    finally:
        worker.close()


def _one_running_one_waiting(timers: Timers) -> tuple[FaultyStore, _PoolWorker]:
    store = FaultyStore(MemoryStore())
    worker = _PoolWorker(store, timers, 1)
    worker.admit("t.wait", 2)
    assert wait_for(lambda: worker.runs == ["j0"], timeout=10, interval=0.005)
    return store, worker


def test_a_claim_taken_at_admission_is_kept_while_its_message_waits_and_released_if_it_never_runs(
    timers: Timers,
) -> None:
    # Given a pool of 1 slot, its one job running, and a second admitted with it that waits
    store, worker = _one_running_one_waiting(timers)
    try:
        # When the waiting message's claim is older than its TTL
        time.sleep(TTL * 2)
        # Then it is still held by this worker (renewed), taken in the one admission call
        assert isinstance(store.inner.claim("j1", "w2", "m", TTL), HeldElsewhere)
        assert store.calls["claim"] == 1 and store.calls["renew"] >= 2
        # When the pool drains before it starts
        assert worker.pool.quiet() == 1
        # Then its claim is released at once: another worker may take the job id now
        assert wait_for(
            lambda: store.inner.claim("j1", "w2", "m", TTL) == Claimed(), timeout=5, interval=0.01
        )
        assert worker.runs == ["j0"]
    finally:
        worker.close()


def test_a_claim_taken_at_admission_that_cannot_be_renewed_is_dropped_and_its_run_claims_anew(
    timers: Timers,
) -> None:
    # Given a pool of 1 slot, its one job running, and a second admitted with it that waits
    store, worker = _one_running_one_waiting(timers)
    try:
        # When renewals fail for longer than the claims' TTL (the running one is handed back)
        store.fail("renew", StoreUnavailable("down"))
        assert wait_for(lambda: worker.acks.modacked, timeout=5, interval=0.01)
        store.heal()
        # (the handed-back run's handler ends, as sync handlers are not stopped: the slot frees)
        worker.go.set()
        # Then the waiting message, once it starts, claims its job id again and runs once
        assert wait_for(lambda: worker.runs == ["j0", "j1"], timeout=10, interval=0.01)
        assert wait_for(lambda: worker.acks.acked == ["ack-m1"], timeout=10, interval=0.01)
        assert store.calls["claim"] == 2
    finally:
        store.heal()
        worker.close()


class _BlockingRun(_LeaseRun):
    """A run whose hand-back blocks until ``release`` (a copy published on its message's last
    delivery waits for Pub/Sub), or raises."""

    def __init__(self, job_id: str, release: threading.Event, *, raises: bool = False) -> None:
        super().__init__(job_id)
        self.release, self.raises = release, raises

    def hand_back(self, outcome: object) -> None:
        super().hand_back(outcome)
        if self.raises:
            raise RuntimeError("a hand-back bug")
        self.release.wait(10)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("raises", [False, True], ids=["blocks", "raises"])
def test_every_run_under_a_watch_that_comes_due_is_handed_back_whatever_the_others_do(
    raises: bool,
) -> None:
    # Given two runs whose leases one renewal round renewed, so one watch watches both, and
    # hand-backs that block (or raise)
    clock = _Clock()
    keeper, timers = _keeper(clock)
    release = threading.Event()
    runs = [_BlockingRun(key, release, raises=raises) for key in "ab"]
    for run in runs:
        keeper.hold(run, run.job.job_id, clock.now)  # type: ignore[arg-type]
    clock.now = 20.0
    keeper._renew_all()
    try:
        # When no round renews them again and the watch comes due
        clock.now = 70.0
        _due(timers, clock.now)
        # Then both are handed back at once: neither waits for the other's hand-back
        assert wait_for(lambda: all(run.handed_back for run in runs), timeout=2)
    finally:
        release.set()
        # (A hand-back's thread ends before this test does: what it raised is this test's.)
        assert wait_for(
            lambda: not any(t.name == "workerpool-claim-lost" for t in threading.enumerate()),
            timeout=5,
        )


def test_leases_held_together_must_have_distinct_keys() -> None:
    keeper, timers = _keeper(_Clock())
    with pytest.raises(ValueError, match="given twice"):
        keeper.hold_many(["a", "a"], 0.0)
    assert len(timers) == 0 and keeper.let_go_many([]) is None


def test_a_recorded_batch_lets_its_leases_go_once_before_each_message_is_settled() -> None:
    # Given completions whose leases are let go by one call, and a `then` that raises
    events: list[str] = []

    def let_go(held: list[str]) -> None:
        events.append(f"let go {','.join(held)}")

    def then(job_id: str) -> Callable[[Outcome], None]:
        def settle(outcome: Outcome) -> None:
            events.append(f"{job_id} {type(outcome).__name__}")
            if job_id == "a":
                raise RuntimeError("a settlement bug")

        return settle

    completions: Completions[str] = Completions(
        MemoryStore(), OWNER, patience=5, let_go=let_go, lapsed=lambda held: False
    )
    for job_id in "ab":
        completions.add(job_id, f"m-{job_id}", lambda: False, f"lease-{job_id}", then(job_id))
    # When the thread records them (both queued before it starts: one batch)
    completions.start()
    assert wait_for(lambda: len(events) == 3, timeout=10)
    completions.close(5)
    # Then the leases were let go in one call, before either message heard, and the bug in
    # the first settlement did not keep the second from its answer
    assert events == ["let go lease-a,lease-b", "a Succeeded", "b Succeeded"]


def test_the_messages_of_a_recorded_batch_leave_together_after_every_settlement() -> None:
    # Given settlements that each leave through a call that is cheaper made together
    events: list[str] = []

    def leave_many(job_ids: list[str]) -> None:
        events.append(f"left {','.join(job_ids)}")

    def then(job_id: str) -> Callable[[Outcome], None]:
        def settle(outcome: Outcome) -> None:
            events.append(f"{job_id} settled")
            together(leave_many, job_id)

        return settle

    completions: Completions[str] = Completions(
        MemoryStore(), OWNER, patience=5, let_go=lambda held: None, lapsed=lambda held: False
    )
    for job_id in "abc":
        completions.add(job_id, f"m-{job_id}", lambda: False, job_id, then(job_id))
    # When the thread records them as one batch
    completions.start()
    assert wait_for(lambda: len(events) == 4, timeout=10)
    completions.close(5)
    # Then they left in one call, in order, once all three were settled
    assert events == ["a settled", "b settled", "c settled", "left a,b,c"]


class _CountingStore(MemoryStore):
    """Counts the writes of completions (one per batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[int] = []

    def complete_many(self, completions: Any, owner: str) -> None:
        self.batches.append(len(completions))
        super().complete_many(completions, owner)


def _lingering(store: MemoryStore, *, enough: int, linger: float) -> Completions[str]:
    completions: Completions[str] = Completions(
        store, OWNER, patience=5, let_go=lambda held: None, lapsed=lambda held: False,
        enough=enough, linger=linger,
    )  # fmt: skip
    completions.start()
    return completions


def test_completions_that_trickle_in_share_one_write() -> None:
    # Given a recorder whose first completion of a batch waits half a second for 20
    store = _CountingStore()
    answered: list[str] = []
    completions = _lingering(store, enough=20, linger=0.5)
    try:
        # When ten completions come one by one, 10 ms apart (jobs that end one after another)
        for i in range(10):
            completions.add(f"j{i}", f"m{i}", lambda: False, f"j{i}",
                            lambda outcome, i=i: answered.append(f"j{i}"))  # fmt: skip
            time.sleep(0.01)
        # Then all ten are recorded in one write, and each is answered once
        assert wait_for(lambda: len(answered) == 10, timeout=10)
        assert store.batches == [10]
        assert sorted(answered) == sorted(f"j{i}" for i in range(10))
    finally:
        completions.close(5)


@pytest.mark.parametrize("first_lingers", [False, True], ids=["alone", "after_one_that_lingers"])
def test_a_completion_something_waits_for_is_recorded_without_lingering(
    first_lingers: bool,
) -> None:
    # Given a recorder that would let a batch's first completion wait a minute for others,
    # and maybe one such completion lingering already
    store = _CountingStore()
    completions = _lingering(store, enough=20, linger=60.0)
    answered = threading.Event()
    try:
        if first_lingers:
            completions.add("early", "m-early", lambda: False, "early", lambda outcome: None)
            assert wait_for(lambda: completions._queue.empty(), timeout=10)  # lingering now
        # When a completion comes that something waits for (an exactly-once ack, the next
        # message of its ordering key)
        completions.add("j", "m", lambda: False, "j", lambda outcome: answered.set(), awaited=True)
        # Then it is recorded and answered without that wait, with any that lingered
        assert answered.wait(10)
        assert store.batches == [2 if first_lingers else 1]
    finally:
        completions.close(5)


@pytest.mark.parametrize("enough", [1, 3], ids=["a_pool_that_spares_none", "a_full_batch"])
def test_enough_completions_are_written_without_waiting_out_the_linger(enough: int) -> None:
    # Given a recorder whose batch's first completion would wait a minute for ``enough``
    store = _CountingStore()
    completions = _lingering(store, enough=enough, linger=60.0)
    answered: list[str] = []
    try:
        # When that many come, the first alone, then the rest while it lingers
        for i in range(enough):
            completions.add(f"j{i}", f"m{i}", lambda: False, f"j{i}",
                            lambda outcome, i=i: answered.append(f"j{i}"))  # fmt: skip
            if i == 0:
                assert wait_for(lambda: completions._queue.empty(), timeout=10)
        # Then they are written without that wait
        assert wait_for(lambda: len(answered) == enough, timeout=10)
        assert sum(store.batches) == enough
    finally:
        completions.close(5)


def test_closing_ends_a_batch_that_lingers_and_records_it() -> None:
    # Given a recorder whose batch's first completion lingers for a minute
    outcomes: list[Outcome] = []
    store = _CountingStore()
    completions = _lingering(store, enough=20, linger=60.0)
    completions.add("j", "m", lambda: False, "j", outcomes.append)
    assert wait_for(lambda: completions._queue.empty(), timeout=10)  # taken: lingering now
    # When the worker stops
    completions.close(5)
    # Then the drain did not wait out the linger: the completion is recorded and answered
    assert [type(outcome).__name__ for outcome in outcomes] == ["Succeeded"]
    assert store.batches == [1]


def test_every_completion_added_while_the_recorder_closes_is_answered_once() -> None:
    # Given threads adding completions as fast as they can
    answered: list[str] = []
    completions: Completions[str] = Completions(
        MemoryStore(), OWNER, patience=5, let_go=lambda held: None, lapsed=lambda held: False
    )
    completions.start()
    go = threading.Event()

    def add_many(thread: int) -> None:
        go.wait()
        for i in range(300):
            job_id = f"{thread}-{i}"
            completions.add(job_id, f"m-{job_id}", lambda: False, job_id,
                            lambda outcome, job_id=job_id: answered.append(job_id))  # fmt: skip

    adders = [threading.Thread(target=add_many, args=(t,)) for t in range(6)]
    for adder in adders:
        adder.start()
    # When the recorder closes while they add
    go.set()
    time.sleep(0.001)
    completions.close(5)
    for adder in adders:
        adder.join(10)
    # Then every completion was answered, once: recorded, or refused as the worker stops
    assert wait_for(lambda: len(answered) == 6 * 300, timeout=5)
    assert len(set(answered)) == len(answered)


def test_a_bug_letting_a_failed_runs_claim_go_still_frees_its_job_id(
    timers: Timers, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a worker whose lease keeper fails to let a failed run's claim go (a bug)
    worker = _Worker(FaultyStore(MemoryStore()), timers)

    def broken(held: object) -> None:
        raise RuntimeError("a let-go bug")

    monkeypatch.setattr(worker.idempotency.keeper, "let_go", broken)
    try:
        # When a run of the job id fails (handed back, it raises)
        worker.process(job="t.checks")
        assert wait_for(lambda: worker.started_at, timeout=10, interval=0.005)
        worker.processor.interrupt_running()
        assert wait_for(lambda: worker.cancelled_at, timeout=10, interval=0.005)
        # Then the job id is busy here no more: a later delivery of it may start
        assert wait_for(lambda: not worker.idempotency._active, timeout=5, interval=0.005)
    finally:
        worker.close()
