"""The pool's bound, admission and hand-back, with typed fakes (pure logic, no Pub/Sub)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.support import wait_for
from workerpool import JobContext, PermanentError
from workerpool.assembly.launcher import Launcher, Phase
from workerpool.config import Settings
from workerpool.registry import Registry
from workerpool.testing.fakes import FakeAcks, FakeDeadLetters, FakeLeaser, make_delivery
from workerpool.worker.aio import EventLoop
from workerpool.worker.delivery import Delivery
from workerpool.worker.lease import Leaser
from workerpool.worker.limits import DrainReport, PoolLimits
from workerpool.worker.middleware import Around, Ended, Middleware, TimeLimit
from workerpool.worker.ordering import Sequencer
from workerpool.worker.outcome import Deferred, Interrupted, LostLease, Outcome, Succeeded
from workerpool.worker.permits import HELD, PARKED, SlotPermit, Starter
from workerpool.worker.pool import Pool
from workerpool.worker.processor import Ending, Processor, ProcessorSettings
from workerpool.worker.renewal import Renewer
from workerpool.worker.run import Run
from workerpool.worker.timers import Timers
from workerpool.worker.watched import Watched


class _Gate:
    """A job that records how many run at once, and on which threads, and waits until it is
    let go."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.peak = 0
        self.started = 0
        self.threads: set[int] = set()
        self.release = threading.Event()

    def __call__(self, ctx: JobContext, payload: dict[str, Any]) -> None:
        with self.lock:
            self.running += 1
            self.started += 1
            self.threads.add(threading.get_ident())
            self.peak = max(self.peak, self.running)
        self.release.wait(10)
        with self.lock:
            self.running -= 1


def _pool(
    n: int, prefetch: int, middleware: tuple[Middleware, ...] = ()
) -> tuple[Pool, _Gate, FakeAcks, Processor]:
    jobs, gate, acks = Registry(), _Gate(), FakeAcks()
    jobs.job("t.gate")(gate)
    leases = FakeLeaser()
    processor = Processor(jobs, acks, leases, FakeDeadLetters(), middleware, ProcessorSettings())
    pool = Pool(processor, leases, PoolLimits(n, prefetch))
    pool.start()
    return pool, gate, acks, processor


def _deliveries(count: int, start: int = 0) -> list[Delivery]:
    return [
        make_delivery(b"{}", {"job": "t.gate", "job_id": f"j{i}"}, message_id=f"m{i}")
        for i in range(start, start + count)
    ]


def test_never_more_than_n_run_and_the_rest_wait_within_the_bound() -> None:
    # Given a pool of 4 slots and a prefetch of 2
    pool, gate, acks, processor = _pool(4, 2)
    try:
        # When it is asked for room, Then it has N + prefetch, and admits that many
        assert pool.wait_for_room(0) == 6
        pool.admit(_deliveries(6))
        assert wait_for(lambda: gate.running == 4, timeout=10, interval=0.005)
        assert pool.held == 6 and pool.wait_for_room(0) == 0
        # And anything beyond the bound is given back at once, counted as released
        pool.admit(_deliveries(3, start=6))
        assert sorted(a for a, _ in acks.modacked) == ["ack-m6", "ack-m7", "ack-m8"]
        assert processor.stats == {"released": 3}
        # When the jobs are let go, Then all 6 ran, never more than 4 at once
        gate.release.set()
        assert wait_for(lambda: acks.acked and len(acks.acked) == 6, timeout=10, interval=0.005)
        assert gate.peak == 4 and gate.started == 6
        assert pool.wait_idle(time.monotonic() + 5)
        assert processor.stats == {"released": 3, "done": 6}
    finally:
        gate.release.set()
        assert pool.join(time.monotonic() + 5)


def test_a_pool_with_enough_waiting_pulls_only_once_half_its_hold_is_free() -> None:
    # Given a pool of 2 slots and a prefetch of 4 (held at most 6), both slots busy
    pool, gate, _, _ = _pool(2, 4)
    try:
        pool.admit(_deliveries(4))
        assert wait_for(lambda: gate.running == 2, timeout=10, interval=0.005)
        # When 2 wait to start (half the prefetch), Then the 2 free places are pulled for
        assert pool.wait_for_room(0) == 2
        # When 3 wait, Then the 1 free place is not: a pull waits for half the hold (3)
        pool.admit(_deliveries(1, start=4))
        assert pool.wait_for_room(0) == 0
    finally:
        gate.release.set()
        pool.join(time.monotonic() + 5)


def test_a_backlog_runs_on_n_threads_each_taking_the_next_message_as_its_run_ends() -> None:
    # Given a pool of 2 slots and a prefetch of 4 (6 slot threads), both slots busy and 4
    # messages waiting to start
    pool, gate, acks, _ = _pool(2, 4)
    try:
        # Then they wait for a permit in the queue, and 2 threads carry every run
        _a_backlog_runs_on_n_threads(pool, gate, acks, n=2, count=6)
    finally:
        gate.release.set()
        pool.join(time.monotonic() + 5)


def _a_backlog_runs_on_n_threads(
    pool: Pool, gate: _Gate, acks: FakeAcks, *, n: int, count: int
) -> None:
    """A backlog of ``count`` gate jobs with ``n`` slots: those beyond the slots wait for a
    permit in the queue, not each on a thread of its own, and, let go one after another, every
    run is carried by the ``n`` threads that took the first ``n``."""
    acked = len(acks.acked)
    pool.admit(_deliveries(count))
    assert wait_for(lambda: gate.running == n, timeout=10, interval=0.005)
    assert pool._starting == set()
    gate.release.set()
    assert wait_for(lambda: len(acks.acked) == acked + count, timeout=10, interval=0.005)
    assert len(gate.threads) == n


def test_quiet_gives_back_what_has_not_started_and_lets_the_rest_finish() -> None:
    # Given 2 slots busy and 2 messages waiting
    pool, gate, acks, processor = _pool(2, 2)
    try:
        pool.admit(_deliveries(4))
        assert wait_for(lambda: gate.running == 2, timeout=10, interval=0.005)
        # When the pool goes quiet
        released = pool.quiet()
        # Then the 2 waiting are given back at once (deadline 0), and nothing is admitted
        assert released == 2
        assert sorted(acks.modacked) == [("ack-m2", 0.0), ("ack-m3", 0.0)]
        assert pool.wait_for_room(0) == 0
        pool.admit(_deliveries(1, start=9))
        assert ("ack-m9", 0.0) in acks.modacked
        # And the 2 running finish and are acked
        gate.release.set()
        assert pool.wait_idle(time.monotonic() + 5)
        assert sorted(acks.acked) == ["ack-m0", "ack-m1"]
        assert gate.started == 2 and processor.stats == {"released": 3, "done": 2}
    finally:
        gate.release.set()
        assert pool.join(time.monotonic() + 5)


def test_join_does_not_wait_past_its_deadline_for_a_stuck_handler() -> None:
    # Given a slot whose handler ignores everything for 10 s
    pool, gate, _, _ = _pool(1, 0)
    pool.admit(_deliveries(1))
    assert wait_for(lambda: gate.running == 1, timeout=10, interval=0.005)
    # When the pool is joined with a 0.2 s deadline, Then it returns by then, saying so
    started = time.monotonic()
    assert pool.join(started + 0.2) is False
    assert time.monotonic() - started < 1.0
    gate.release.set()


def test_a_launcher_stopped_before_it_started_opened_nothing_and_cannot_start() -> None:
    # Given a launcher that was never started (it opens nothing until start)
    settings = Settings(project="p", subscription="s", idempotency_store="memory://").validate()
    before = {t.name for t in threading.enumerate()}
    launcher = Launcher(settings)
    # When it is stopped, twice, Then each stop is an empty report and no thread was started
    assert launcher.stop(time.monotonic()) == DrainReport(0, 0, 0, 0.0)
    assert launcher.stop(time.monotonic()) == DrainReport(0, 0, 0, 0.0)
    # (a thread of an earlier test may end meanwhile: only new ones would be this one's)
    assert {t.name for t in threading.enumerate()} <= before
    assert launcher.phase is Phase.STOPPED
    # And it cannot be started any more
    with pytest.raises(RuntimeError, match="stopped"):
        launcher.start()


def test_a_handler_raising_a_base_exception_is_a_failure_and_its_slot_carries_on() -> None:
    # Given one slot, and a job that raises CancelledError (a BaseException) once
    jobs, ran = Registry(), []

    @jobs.job("t.odd")
    def odd(ctx: JobContext, payload: dict[str, Any]) -> None:
        ran.append(ctx.job_id)
        if len(ran) == 1:
            raise asyncio.CancelledError

    acks, leases = FakeAcks(), FakeLeaser()
    processor = Processor(jobs, acks, leases, FakeDeadLetters(), (), ProcessorSettings())
    pool = Pool(processor, leases, PoolLimits(1, 1))
    pool.start()
    try:
        # When two messages run on it
        pool.admit([make_delivery(b"{}", {"job": "t.odd", "job_id": f"j{i}"}, message_id=f"m{i}")
                    for i in range(2)])  # fmt: skip
        # Then the first is retried, not lost, and the same slot runs the second
        assert wait_for(
            lambda: processor.stats == {"retried": 1, "done": 1}, timeout=10, interval=0.005
        )
        assert ran == ["j0", "j1"] and acks.acked == ["ack-m1"]
    finally:
        assert pool.join(time.monotonic() + 5)


class _WaitsWithoutPermit(Middleware):
    """Before a run starts, puts its permit down (as a run waiting for a concurrency slot
    does) until ``go`` is set, recording whether it was allowed to."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.put_down: list[bool] = []

    def around(self, run: Run) -> Around:
        if run.job.job_id.startswith("wait"):
            self.put_down.append(run.permit.put_down())
            self.go.wait(10)
            if self.put_down[-1]:
                assert run.permit.pick_up()
        return (yield)


def test_a_run_waiting_without_its_permit_lets_another_run_within_the_prefetch() -> None:
    # Given 1 slot, a prefetch of 1, and runs that wait without their permit before starting
    jobs, gate, acks, leases = Registry(), _Gate(), FakeAcks(), FakeLeaser()
    jobs.job("t.gate")(gate)
    waiting = _WaitsWithoutPermit()
    processor = Processor(jobs, acks, leases, FakeDeadLetters(), [waiting], ProcessorSettings())
    pool = Pool(processor, leases, PoolLimits(1, 1))
    pool.start()

    def message(job_id: str) -> Delivery:
        return make_delivery(b"{}", {"job": "t.gate", "job_id": job_id}, message_id=job_id)

    try:
        # When one waits, Then the slot runs another message meanwhile: one running, two held
        pool.admit([message("wait-1")])
        assert wait_for(lambda: waiting.put_down == [True], timeout=10, interval=0.005)
        assert pool.running == 0
        pool.admit([message("run-1")])
        assert wait_for(lambda: gate.running == 1, timeout=10, interval=0.005)
        assert (pool.running, pool.held, pool.wait_for_room(0)) == (1, 2, 0)
        # And when the waiter may go on, it gets the permit only once the slot is free
        waiting.go.set()
        time.sleep(0.1)
        assert gate.running == 1 and gate.started == 1
        gate.release.set()
        assert wait_for(lambda: len(acks.acked) == 2, timeout=10, interval=0.005)
        assert gate.peak == 1
        # And with the prefetch's one place taken, a second waiter may not wait without it
        waiting.go.clear()
        gate.release.clear()
        pool.admit([message("wait-2")])
        assert wait_for(lambda: len(waiting.put_down) == 2, timeout=10, interval=0.005)
        pool.admit([message("wait-3")])
        assert wait_for(lambda: len(waiting.put_down) == 3, timeout=10, interval=0.005)
        assert waiting.put_down[1:] == [True, False]
    finally:
        waiting.go.set()
        gate.release.set()
        assert pool.join(time.monotonic() + 5)


class _GivesUpWithoutPermit(Middleware):
    """Runs of job ids starting with "quit" put their permit down and end there, deferred
    (as a run does that gives up waiting for a concurrency slot)."""

    def before(self, run: Run) -> Outcome | None:
        if run.job.job_id.startswith("quit"):
            assert run.permit.put_down()
            return Deferred("gave up", 0.0)
        return None


def test_runs_that_end_waiting_without_their_permit_leave_n_threads_taking_messages() -> None:
    # Given 1 slot, a prefetch of 2, and 3 runs that put their permit down and end there
    pool, gate, acks, _ = _pool(1, 2, middleware=(_GivesUpWithoutPermit(),))
    try:
        pool.admit([
            make_delivery(b"{}", {"job": "t.gate", "job_id": f"quit-{i}"}, message_id=f"q{i}")
            for i in range(3)
        ])  # fmt: skip
        assert wait_for(lambda: len(acks.modacked) == 3, timeout=10, interval=0.005)
        # When a backlog comes, Then one thread takes messages, as before
        _a_backlog_runs_on_n_threads(pool, gate, acks, n=1, count=3)
    finally:
        gate.release.set()
        assert pool.join(time.monotonic() + 5)


class _Scripted:
    """A processor whose runs do what their test says, by message id: ``process`` calls
    ``runs[message_id](permit, resume)``, which returns how far the thread carried it."""

    def __init__(self, runs: dict[str, Callable[[Any, Any], Ending]]) -> None:
        self.runs = runs
        self.ahead: set[str] = set()  # message ids made ready ahead (async, see ``pool``)
        self.draining = threading.Event()

    def admitted(self, deliveries: list[Delivery]) -> None:
        pass

    def give_back(self, deliveries: list[Delivery]) -> int:
        return len(deliveries)

    def starts_ahead(self, delivery: Delivery) -> bool:
        return delivery.message_id in self.ahead

    def process(self, delivery: Delivery, permit: Any, left: Any, resume: Any) -> Ending:
        return self.runs[delivery.message_id](permit, resume)


def _on_a_thread(when: threading.Event, call: Callable[[], None]) -> None:
    """``call()`` once ``when`` is set, on a thread of its own (an event loop's, as it were)."""
    threading.Thread(target=lambda: (when.wait(10), call()), daemon=True).start()


def test_a_drain_refusing_a_parked_run_its_permit_leaves_a_thread_to_carry_async_ends() -> None:
    # Given 1 slot and a prefetch of 2: a sync run waiting without its permit, an async run
    # holding the permit, and an async run made ready ahead
    granted, a_ends, b_rest, b_go = (threading.Event() for _ in range(4))
    ended: list[str] = []

    def parked(permit: Any, resume: Any) -> Ending:
        assert permit.put_down()
        granted.wait(10)
        assert not permit.pick_up()  # the drain came first
        return Ending.SETTLED

    def holds_the_permit(permit: Any, resume: Any) -> Ending:
        _on_a_thread(a_ends, lambda: resume(lambda: ended.append("a") or Ending.SETTLED))
        return Ending.CARRIED

    def ready_ahead(permit: Any, resume: Any) -> Ending:
        def rest() -> Ending:
            b_rest.set()
            b_go.wait(10)
            return Ending.SETTLED

        permit.start_when_held(lambda started: resume(rest))
        return Ending.CARRIED

    processor = _Scripted({"s": parked, "a": holds_the_permit, "b": ready_ahead})
    processor.ahead = {"b"}
    leases = FakeLeaser()
    pool = Pool(processor, leases, PoolLimits(1, 2))  # type: ignore[arg-type]
    pool.start()
    try:
        pool.admit([make_delivery(b"{}", {}, message_id="s")])
        assert wait_for(lambda: pool._parked == 1, timeout=10, interval=0.005)
        pool.admit([make_delivery(b"{}", {}, message_id="a")])
        assert wait_for(lambda: pool.running == 1, timeout=10, interval=0.005)
        pool.admit([make_delivery(b"{}", {}, message_id="b")])
        assert wait_for(lambda: len(pool._ready) == 1, timeout=10, interval=0.005)
        granted.set()  # the parked run waits for the permit the async run holds
        assert wait_for(lambda: len(pool._waiters) == 1, timeout=10, interval=0.005)
        # When a drain refuses the ready run (its rest is carried) and the parked one
        pool.stop_starting()
        assert b_rest.wait(10)
        pool.quiet()
        b_go.set()
        time.sleep(0.1)  # both threads come to rest: one waits for a message, one for a turn
        # Then the async run that held the permit is still carried on when it ends
        a_ends.set()
        assert pool.wait_idle(time.monotonic() + 5)
        assert ended == ["a"]
    finally:
        granted.set()
        a_ends.set()
        b_go.set()
        assert pool.join(time.monotonic() + 5)


def test_an_async_end_blocked_on_its_record_holds_up_no_run_that_took_its_permit() -> None:
    # Given 1 slot and a prefetch of 2: an async run holding the permit, whose end blocks
    # (a slow dead-letter record), and an async run made ready ahead, which takes the permit
    f_ends, r_ends, record_go, recording = (threading.Event() for _ in range(4))
    ended: list[str] = []

    def fails(permit: Any, resume: Any) -> Ending:
        def rest() -> Ending:
            recording.set()
            record_go.wait(10)
            ended.append("f")
            return Ending.SETTLED

        _on_a_thread(f_ends, lambda: resume(rest))
        return Ending.CARRIED

    def ready_ahead(permit: Any, resume: Any) -> Ending:
        def start(started: bool) -> None:
            _on_a_thread(r_ends, lambda: resume(lambda: ended.append("r") or Ending.SETTLED))

        permit.start_when_held(start)
        return Ending.CARRIED

    processor = _Scripted({"f": fails, "r": ready_ahead})
    processor.ahead = {"r"}
    pool = Pool(processor, FakeLeaser(), PoolLimits(1, 2))  # type: ignore[arg-type]
    pool.start()
    try:
        pool.admit([make_delivery(b"{}", {}, message_id="f")])
        assert wait_for(lambda: pool.running == 1, timeout=10, interval=0.005)
        pool.admit([make_delivery(b"{}", {}, message_id="r")])
        assert wait_for(lambda: len(pool._ready) == 1, timeout=10, interval=0.005)
        # When the first ends and its end blocks, and the one that took its permit ends
        f_ends.set()
        assert recording.wait(10)
        r_ends.set()
        # Then the second's end is carried on meanwhile: its permit is free again
        assert wait_for(lambda: ended == ["r"] and pool.running == 0, timeout=5, interval=0.005)
    finally:
        record_go.set()
        f_ends.set()
        r_ends.set()
        pool.quiet()
        assert pool.join(time.monotonic() + 5)


def test_a_run_picking_its_permit_up_again_is_not_passed_over_by_the_messages_after_it() -> None:
    # Given 1 slot, a prefetch of 3: a run waiting for its concurrency slot without its
    # permit, and a backlog of three, the first of which runs until let go
    granted, first_go = threading.Event(), threading.Event()
    order: list[str] = []

    def parked(permit: Any, resume: Any) -> Ending:
        assert permit.put_down()
        granted.wait(10)
        assert permit.pick_up()
        order.append("s")
        return Ending.SETTLED

    def backlog(name: str) -> Callable[[Any, Any], Ending]:
        def run(permit: Any, resume: Any) -> Ending:
            order.append(name)
            if name == "x1":
                first_go.wait(10)
            return Ending.SETTLED

        return run

    processor = _Scripted({"s": parked, **{f"x{i}": backlog(f"x{i}") for i in (1, 2, 3)}})
    pool = Pool(processor, FakeLeaser(), PoolLimits(1, 3))  # type: ignore[arg-type]
    pool.start()
    try:
        pool.admit([make_delivery(b"{}", {}, message_id="s")])
        assert wait_for(lambda: pool._parked == 1, timeout=10, interval=0.005)
        pool.admit([make_delivery(b"{}", {}, message_id=f"x{i}") for i in (1, 2, 3)])
        assert wait_for(lambda: order == ["x1"], timeout=10, interval=0.005)
        # When its slot is granted, it waits for the permit the first holds, and that one ends
        granted.set()
        assert wait_for(lambda: len(pool._waiters) == 1, timeout=10, interval=0.005)
        first_go.set()
        # Then it runs next: the thread that freed the permit does not take it for the next
        assert wait_for(lambda: len(order) == 4, timeout=10, interval=0.005)
        assert order == ["x1", "s", "x2", "x3"]
    finally:
        granted.set()
        first_go.set()
        assert pool.join(time.monotonic() + 5)


def test_a_free_permit_reaches_the_first_in_line_though_the_wake_ups_came_out_of_order() -> None:
    # Given 1 slot held by a run, an async run made ready ahead (the oldest ticket), and two
    # parked runs waiting in line for the permit after it
    processor = _Scripted({})
    pool = Pool(processor, FakeLeaser(), PoolLimits(1, 4))  # type: ignore[arg-type]
    running, ahead = SlotPermit(pool), SlotPermit(pool)
    running.state, pool._free = HELD, 0
    assert pool._go_ahead(ahead)
    granted: list[str] = []

    def parked(name: str) -> None:
        permit = SlotPermit(pool)
        with pool._lock:
            permit.state = PARKED
            pool._parked += 1
        if pool.pick_up(permit):
            granted.append(name)

    for count, name in enumerate(("first", "second"), start=1):
        threading.Thread(target=parked, args=(name,), daemon=True).start()
        assert wait_for(lambda n=count: len(pool._waiters) == n, timeout=10, interval=0.005)
    try:
        # When the running one ends, and the ready run takes the permit before the first in
        # line wakes for it (that one waits again, now behind the second to be woken)
        with pool._lock:
            pool._let_go(running)
            pool._ready.append((ahead, lambda started: None))
            assert pool._dispatch() and ahead.state == HELD
        assert wait_for(lambda: len(pool._permits._waiters) == 2, timeout=10, interval=0.005)
        # And the ready run ends
        with pool._lock:
            pool._let_go(ahead)
        # Then the first in line gets the permit
        assert wait_for(lambda: granted == ["first"], timeout=5, interval=0.005)
    finally:
        pool.quiet()


class _SlowDeadLetters(FakeDeadLetters):
    """A dead-letter topic whose publish waits until ``go`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()
        self.publishing = threading.Event()

    def publish(self, delivery: Delivery, failure: Any) -> str:
        self.publishing.set()
        self.go.wait(10)
        return super().publish(delivery, failure)


class _WaitCountingLoop(EventLoop):
    """The event loop, counting the runs a thread waited for (``run``) rather than started."""

    def __init__(self) -> None:
        super().__init__()
        self.waited = 0

    def run(self, handler: Any, ctx: Any, payload: Any) -> None:
        self.waited += 1
        super().run(handler, ctx, payload)


def test_async_runs_hold_no_slot_thread_and_a_blocked_end_holds_up_no_other() -> None:
    # Given a pool of 2 slots and 2 slot threads (no prefetch), and async jobs: one that
    # waits until let go, and one that fails for good, whose failure record is slow to publish
    jobs, go, running = Registry(), threading.Event(), Counter[str]()

    @jobs.job("t.waits")
    async def waits(ctx: Any, payload: dict[str, Any]) -> None:
        running["now"] += 1
        while not go.is_set():
            await asyncio.sleep(0.005)
        running["now"] -= 1

    @jobs.job("t.fails")
    async def fails(ctx: Any, payload: dict[str, Any]) -> None:
        raise PermanentError("bad input")

    acks, leases, records = FakeAcks(), FakeLeaser(), _SlowDeadLetters()
    loop = _WaitCountingLoop()
    processor = Processor(jobs, acks, leases, records, (), ProcessorSettings(), loop=loop)
    pool = Pool(processor, leases, PoolLimits(2, 0), name="carry")
    pool.start()
    try:
        # When two of the waiting kind run
        pool.admit([
            make_delivery(b"{}", {"job": "t.waits", "job_id": f"w{i}"}, message_id=f"w{i}")
            for i in range(2)
        ])  # fmt: skip
        assert wait_for(lambda: running["now"] == 2, timeout=10, interval=0.005)
        # Then both run, and no slot thread waits for either
        assert pool.running == 2 and loop.waited == 0
        # When they end, and a failing one follows whose record waits to be published
        go.set()
        assert wait_for(lambda: len(acks.acked) == 2, timeout=10, interval=0.005)
        pool.admit([make_delivery(b"{}", {"job": "t.fails", "job_id": "f"}, message_id="f")])
        assert records.publishing.wait(10)
        go.clear()
        pool.admit([
            make_delivery(b"{}", {"job": "t.waits", "job_id": f"x{i}"}, message_id=f"x{i}")
            for i in range(1)
        ])  # fmt: skip
        assert wait_for(lambda: running["now"] == 1, timeout=10, interval=0.005)
        go.set()
        # Then the run that ended after it is acked while the record still waits
        assert wait_for(lambda: "ack-x0" in acks.acked, timeout=10, interval=0.005)
        assert not records.records and "ack-f" not in acks.acked
        # And once the record is published, the failed one is acked too
        records.go.set()
        assert wait_for(lambda: "ack-f" in acks.acked, timeout=10, interval=0.005)
        assert pool.wait_idle(time.monotonic() + 5)
        assert processor.stats == {"done": 3, "dead_lettered": 1} and loop.waited == 0
    finally:
        go.set()
        records.go.set()
        pool.quiet()
        pool.join(time.monotonic() + 5)
        loop.close(2.0)


class _AsyncGate:
    """Async jobs that record the order they start in and how many run at once, and wait
    (without blocking the loop) until let go, all (``go``) or by job id (``let_go``); sync
    ones (``t.sync``) that do the same, let go with all."""

    def __init__(self, jobs: Registry) -> None:
        self.lock = threading.Lock()
        self.started: list[str] = []
        self.running = 0
        self.peak = 0
        self.go = threading.Event()
        self.let_go: set[str] = set()
        jobs.job("t.async")(self.run_async)
        jobs.job("t.sync")(self.run_sync)
        jobs.job("t.timed", timeout=2.0)(self.sleep)

    def _begin(self, job_id: str) -> None:
        with self.lock:
            self.started.append(job_id)
            self.running += 1
            self.peak = max(self.peak, self.running)

    def _end(self) -> None:
        with self.lock:
            self.running -= 1

    async def run_async(self, ctx: Any, payload: dict[str, Any]) -> None:
        self._begin(ctx.job_id)
        while not self.go.is_set() and ctx.job_id not in self.let_go:
            await asyncio.sleep(0.005)
        self._end()

    def run_sync(self, ctx: Any, payload: dict[str, Any]) -> None:
        self._begin(ctx.job_id)
        self.go.wait(10)
        self._end()

    async def sleep(self, ctx: Any, payload: dict[str, Any]) -> None:
        self._begin(ctx.job_id)
        await asyncio.sleep(payload["seconds"])
        self._end()


class _Entered(Middleware):
    """Records, for each run, how many handlers ran when the middleware before it ran."""

    def __init__(self, gate: _AsyncGate) -> None:
        self._gate = gate
        self.entered: dict[str, int] = {}

    def before(self, run: Run) -> None:
        self.entered[run.job.job_id] = self._gate.running


def _async_pool(
    n: int, prefetch: int, *middleware: Middleware
) -> tuple[Pool, Processor, FakeAcks, EventLoop]:
    jobs = Registry()
    gate = _AsyncGate(jobs)
    acks, leases, loop = FakeAcks(), FakeLeaser(), EventLoop()
    processor = Processor(
        jobs, acks, leases, FakeDeadLetters(), [_Entered(gate), *middleware], ProcessorSettings(),
        loop=loop,
    )  # fmt: skip
    pool = Pool(processor, leases, PoolLimits(n, prefetch), name="ahead")
    pool.start()
    return pool, processor, acks, loop


def _gate_of(processor: Processor) -> tuple[_AsyncGate, _Entered]:
    entered = processor._middleware[0]
    assert isinstance(entered, _Entered)
    return entered._gate, entered


def _message(job: str, job_id: str, **payload: Any) -> Delivery:
    data = json.dumps(payload).encode()
    return make_delivery(data, {"job": job, "job_id": job_id}, message_id=job_id)


def _close(pool: Pool, loop: EventLoop) -> None:
    pool.quiet()
    pool.join(time.monotonic() + 5)
    loop.close(2.0)


def test_async_runs_made_ready_while_every_permit_is_taken_start_as_one_ends() -> None:
    # Given 2 slots, a prefetch of 2, and 2 async jobs running
    pool, processor, acks, loop = _async_pool(2, 2)
    gate, entered = _gate_of(processor)
    try:
        pool.admit([_message("t.async", f"a{i}") for i in range(2)])
        assert wait_for(lambda: gate.running == 2, timeout=10, interval=0.005)
        # When 2 more come
        pool.admit([_message("t.async", f"b{i}") for i in range(2)])
        # Then both go through the middleware before their handler while every permit is
        # taken, and neither starts
        assert wait_for(lambda: len(entered.entered) == 4, timeout=10, interval=0.005)
        assert (entered.entered["b0"], entered.entered["b1"]) == (2, 2)
        time.sleep(0.05)
        assert (gate.running, pool.running, pool.held) == (2, 2, 4)
        # And once the running ones end, they start, never more than 2 at once
        gate.go.set()
        assert wait_for(lambda: len(acks.acked) == 4, timeout=10, interval=0.005)
        assert gate.peak == 2 and sorted(gate.started[2:]) == ["b0", "b1"]
        assert processor.stats == {"done": 4}
        assert pool.wait_idle(time.monotonic() + 5) and pool.running == 0
    finally:
        gate.go.set()
        _close(pool, loop)


def test_a_sync_message_that_waited_first_gets_the_permit_before_async_runs_made_ready() -> None:
    # Given 1 slot, a prefetch of 2, an async job running, then a sync job waiting for the
    # permit on its slot thread, then an async one made ready ahead
    pool, processor, acks, loop = _async_pool(1, 2)
    gate, entered = _gate_of(processor)
    try:
        pool.admit([_message("t.async", "first")])
        assert wait_for(lambda: gate.running == 1, timeout=10, interval=0.005)
        pool.admit([_message("t.sync", "sync")])
        assert wait_for(lambda: len(pool._starting) == 1, timeout=10, interval=0.005)
        pool.admit([_message("t.async", "ready")])
        assert wait_for(lambda: "ready" in entered.entered, timeout=10, interval=0.005)
        assert "sync" not in entered.entered
        # When the running one ends
        gate.go.set()
        # Then they run in the order they came
        assert wait_for(lambda: len(acks.acked) == 3, timeout=10, interval=0.005)
        assert gate.started == ["first", "sync", "ready"] and gate.peak == 1
    finally:
        gate.go.set()
        _close(pool, loop)


def test_a_drain_releases_async_runs_made_ready_without_starting_them() -> None:
    # Given 1 slot, a prefetch of 1, an async job running and another made ready ahead
    pool, processor, acks, loop = _async_pool(1, 1)
    gate, entered = _gate_of(processor)
    try:
        pool.admit([_message("t.async", "running")])
        assert wait_for(lambda: gate.running == 1, timeout=10, interval=0.005)
        pool.admit([_message("t.async", "ready")])
        assert wait_for(lambda: "ready" in entered.entered, timeout=10, interval=0.005)
        # When the pool drains
        pool.quiet()
        # Then the ready one is released at once, never started; the running one finishes
        assert wait_for(lambda: processor.stats == {"released": 1}, timeout=10, interval=0.005)
        assert acks.modacked == [("ack-ready", 0)]
        gate.go.set()
        assert pool.wait_idle(time.monotonic() + 5)
        assert processor.stats == {"released": 1, "done": 1}
        assert gate.started == ["running"]
    finally:
        gate.go.set()
        _close(pool, loop)


def test_an_async_run_made_ready_ahead_counts_its_timeout_from_its_start(
    timers: Timers,
) -> None:
    # Given 1 slot and jobs with a timeout of 2 s: one that runs for 2.5 s, and one made ready
    # ahead meanwhile, which runs for 0.5 s once it starts (3 s after its middleware ran)
    pool, processor, acks, loop = _async_pool(1, 1, TimeLimit(timers))
    gate, entered = _gate_of(processor)
    try:
        pool.admit([_message("t.async", "first")])
        assert wait_for(lambda: gate.running == 1, timeout=10, interval=0.005)
        pool.admit([_message("t.timed", "second", seconds=0.5)])
        assert wait_for(lambda: "second" in entered.entered, timeout=10, interval=0.005)
        time.sleep(2.5)
        gate.go.set()
        # When both have run, Then neither ran past its timeout
        assert wait_for(lambda: len(acks.acked) == 2, timeout=10, interval=0.01)
        assert processor.stats == {"done": 2} and gate.started == ["first", "second"]
    finally:
        gate.go.set()
        _close(pool, loop)


class _ParksForASlot(Middleware):
    """As a run of a job with a fleet-wide slot does: asks for its slot holding its permit
    until ``asked``, then waits without it until ``granted``, then picks one up again."""

    def __init__(self) -> None:
        self.asked = threading.Event()
        self.granted = threading.Event()
        self.put_down: list[bool] = []

    def before(self, run: Run) -> None:
        if run.job.job_id.startswith("wait"):
            self.asked.wait(10)
            self.put_down.append(run.permit.put_down())
            self.granted.wait(10)
            if self.put_down[-1]:
                assert run.permit.pick_up()


def test_a_run_waiting_without_its_permit_keeps_its_place_beside_runs_made_ready_ahead() -> None:
    # Given 2 slots, a prefetch of 3: an async job running, and a sync one asking for its
    # fleet-wide slot
    parks = _ParksForASlot()
    pool, processor, acks, loop = _async_pool(2, 3, parks)
    gate, entered = _gate_of(processor)
    try:
        pool.admit([_message("t.async", "a0")])
        assert wait_for(lambda: gate.running == 1, timeout=10, interval=0.005)
        pool.admit([_message("t.sync", "wait-p")])
        assert wait_for(lambda: "wait-p" in entered.entered, timeout=10, interval=0.005)
        # When 2 async runs are made ready ahead, and then it waits for its slot without its
        # permit
        pool.admit([_message("t.async", "a1"), _message("t.async", "a2")])
        assert wait_for(lambda: len(entered.entered) == 4, timeout=10, interval=0.005)
        parks.asked.set()
        # Then it may (runs made ready ahead hold no thread, and take no place of the
        # prefetch's), and one of them runs meanwhile
        assert wait_for(lambda: parks.put_down == [True], timeout=10, interval=0.005)
        assert wait_for(lambda: gate.running == 2, timeout=10, interval=0.005)
        # When its slot is granted and it waits for a permit, and another async run comes
        parks.granted.set()
        assert wait_for(lambda: len(pool._waiters) == 1, timeout=10, interval=0.005)
        pool.admit([_message("t.async", "a3")])
        assert wait_for(lambda: "a3" in entered.entered, timeout=10, interval=0.005)
        # Then, as the two running end, the permits go to the run made ready before it
        # waited, and to it, not to the run that came after it
        gate.let_go.update({"a0", "a1"})
        # (which of the two begins its handler first is up to the threads)
        assert wait_for(lambda: len(gate.started) == 4, timeout=10, interval=0.005)
        assert gate.started[:2] == ["a0", "a1"]
        assert sorted(gate.started[2:]) == ["a2", "wait-p"], gate.started
        gate.go.set()
        assert wait_for(lambda: len(acks.acked) == 5, timeout=10, interval=0.005)
        assert gate.started[-1] == "a3"
        assert gate.peak == 2 and processor.stats == {"done": 5}
    finally:
        gate.go.set()
        parks.asked.set()
        parks.granted.set()
        _close(pool, loop)


class _Runs(Middleware):
    """Keeps every run, to hand some back as a lost claim would."""

    def __init__(self) -> None:
        self.runs: dict[str, Run] = {}

    def before(self, run: Run) -> None:
        self.runs[run.job.job_id] = run


def test_a_long_line_of_ready_runs_handed_back_meanwhile_ends_without_nesting() -> None:
    # Given 1 slot, a prefetch of 400, an async job running and 400 made ready ahead
    runs = _Runs()
    pool, processor, _, loop = _async_pool(1, 400, runs)
    gate, _ = _gate_of(processor)
    try:
        pool.admit([_message("t.async", "running")])
        assert wait_for(lambda: gate.running == 1, timeout=10, interval=0.005)
        pool.admit([_message("t.async", f"r{i}") for i in range(400)])
        assert wait_for(lambda: len(runs.runs) == 401, timeout=30, interval=0.01)
        # When every ready one is handed back (their claims were lost), then the running one ends
        for i in range(400):
            assert runs.runs[f"r{i}"].hand_back(Interrupted())
        gate.go.set()
        # Then each, granted the permit in turn, ends unstarted, and the pool is idle
        assert pool.wait_idle(time.monotonic() + 30), (pool.held, pool.running)
        assert gate.started == ["running"] and pool.running == 0
        assert processor.stats == {"done": 1, "drained": 400}
    finally:
        gate.go.set()
        _close(pool, loop)


def test_a_start_that_raises_does_not_stop_the_starts_queued_after_it() -> None:
    # Given two runs granted a permit at once, the first of whose start raises
    started: list[bool] = []

    def broken(granted: bool) -> None:
        raise RuntimeError("a bug")

    # When both are launched on one thread
    Starter("pool").launch([broken, started.append])
    # Then the second still starts
    assert started == [True]


def test_a_watched_condition_wakes_a_waiter_only_at_the_hold_it_looks_at() -> None:
    lock = threading.Lock()
    watched = Watched(lock)
    with lock:
        watched.notify_all()  # nobody waits: nothing to wake, nothing kept for later
        watched.held(0)
    woken: list[bool] = []

    def waiter() -> None:
        with lock:
            woken.append(watched.wait(60, look_at=3))

    thread = threading.Thread(target=waiter)
    thread.start()
    assert wait_for(lambda: watched.waiting == 1, timeout=10, interval=0.001)
    with lock:
        # A hold above what the waiter looks at wakes nobody (notified, it would have left
        # the condition's waiters at once, though it cannot run before the lock is let go)
        watched.held(4)
        assert len(watched._cond._waiters) == 1  # type: ignore[attr-defined]
        # At it, the waiter is woken
        watched.held(3)
        assert len(watched._cond._waiters) == 0  # type: ignore[attr-defined]
    thread.join()
    assert woken == [True] and watched.waiting == 0
    # And a change other than the hold's wakes a waiter whatever it looks at
    thread = threading.Thread(target=waiter)
    thread.start()
    assert wait_for(lambda: watched.waiting == 1, timeout=10, interval=0.001)
    with lock:
        watched.notify_all()
    thread.join()
    assert woken == [True, True]


class _EachLetGo:
    """A job that waits until its own job id is let go."""

    def __init__(self) -> None:
        self.running: set[str] = set()
        self._go: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def _event(self, job_id: str) -> threading.Event:
        with self._lock:
            return self._go.setdefault(job_id, threading.Event())

    def __call__(self, ctx: JobContext, payload: dict[str, Any]) -> None:
        with self._lock:
            self.running.add(ctx.job_id)
        self._event(ctx.job_id).wait(30)
        with self._lock:
            self.running.discard(ctx.job_id)

    def let_go(self, job_id: str) -> None:
        self._event(job_id).set()


@pytest.mark.parametrize("bound", ["hold", "no prefetch", "bytes"])
def test_a_waiting_puller_is_woken_once_runs_ending_leave_it_room_to_pull(bound: str) -> None:
    # Given a pool, its puller waiting: of 2 slots and a prefetch of 4, full, 2 running and 4
    # waiting to start (it pulls once only 2 wait); of 4 slots and no prefetch, 4 running (it
    # pulls for each that ends); or of 2 and 4, 1 running whose message holds more bytes than
    # the pool may (it pulls once that is let go)
    limits, admitted, ended, room = {
        "hold": (PoolLimits(2, 4), 6, ("j0", "j1"), 2),
        "no prefetch": (PoolLimits(4, 0), 4, ("j0",), 1),
        "bytes": (PoolLimits(2, 4, max_bytes=1), 1, ("j0",), 6),
    }[bound]
    jobs, acks, leases = Registry(), FakeAcks(), FakeLeaser()
    each = _EachLetGo()
    jobs.job("t.gate")(each)
    processor = Processor(jobs, acks, leases, FakeDeadLetters(), (), ProcessorSettings())
    pool = Pool(processor, leases, limits)
    pool.start()
    pulled: list[int] = []
    try:
        pool.admit(_deliveries(admitted))
        running = {f"j{i}" for i in range(min(admitted, limits.max_outstanding))}
        assert wait_for(lambda: each.running == running, timeout=10, interval=0.005)
        puller = threading.Thread(target=lambda: pulled.append(pool.wait_for_room(60)))
        puller.start()
        assert wait_for(lambda: pool._cond.waiting == 1, timeout=10, interval=0.001)
        # When runs end, Then the puller is woken and pulls (a wake-up missed: not for 60 s)
        for job_id in ended:
            each.let_go(job_id)
        puller.join(30)
        assert pulled == [room]
    finally:
        for i in range(6):
            each.let_go(f"j{i}")
        pool.join(time.monotonic() + 5)


@dataclass
class _SlowNacks(FakeAcks):
    """A nack is queued only once ``release`` is set (a hand-back publishing a copy first)."""

    release: threading.Event = field(default_factory=threading.Event)

    def modack(self, ack_ids: list[str], seconds: float) -> None:
        self.release.wait(10)
        super().modack(ack_ids, seconds)


class _RunsSeen(Middleware):
    def __init__(self) -> None:
        self.runs: list[Run] = []

    def before(self, run: Run) -> None:
        self.runs.append(run)


def test_a_run_handed_back_by_another_thread_stays_held_until_its_nack_is_queued() -> None:
    # Given a running job that ends once told to stop, on a pool with a real leaser
    jobs, seen, acks = Registry(), _RunsSeen(), _SlowNacks()
    jobs.job("t.stops")(lambda ctx, payload: ctx.cancelled.wait(10))
    leaser = Leaser(acks, granted=600)
    processor = Processor(jobs, acks, leaser, FakeDeadLetters(), (seen,), ProcessorSettings())
    pool = Pool(processor, leaser, PoolLimits(1, 1))
    pool.start()
    delivery = make_delivery(b"{}", {"job": "t.stops", "job_id": "j"}, message_id="m")
    try:
        pool.admit([delivery])
        assert wait_for(lambda: seen.runs, timeout=5)
        # When another thread hands it back (a lost claim), and its run ends before the
        # nack is queued
        handing = threading.Thread(target=seen.runs[0].hand_back, args=(LostLease(after=1.0),))
        handing.start()
        assert wait_for(lambda: pool.running == 0, timeout=5)
        # Then it is still held, leased and in the pool's hold (a drain waits for it before
        # it flushes the acks), until the nack is queued, and not after
        assert leaser.holding() == [delivery] and pool.held == 1 and acks.modacked == []
        acks.release.set()
        handing.join(5)
        assert acks.modacked == [("ack-m", 1)] and leaser.holding() == [] and pool.held == 0
    finally:
        acks.release.set()
        assert pool.join(time.monotonic() + 5)


class _SlowRenewer(Renewer):
    """Every delivery is its last: a hand-back publishes a copy first, once ``release`` is
    set."""

    def __init__(self) -> None:
        super().__init__(None, "projects/p/topics/t", "projects/p/subscriptions/s", 5)
        self.release = threading.Event()

    def last(self, delivery_attempt: int) -> bool:
        return True

    def renew(self, copies: Sequence[tuple[Delivery, float]]) -> list[bool]:
        self.release.wait(10)
        return [True] * len(copies)


def _ordered_pool_of_two(
    jobs: Registry, middleware: Sequence[Middleware], acks: FakeAcks, renewer: Renewer
) -> Pool:
    """An ordered pool of one slot, started, with two messages of one key admitted: m1
    starts, m2 waits behind it (both of job "t.stops")."""
    leaser = Leaser(acks, granted=600)
    processor = Processor(
        jobs, acks, leaser, FakeDeadLetters(), middleware, ProcessorSettings(), renewer=renewer
    )
    pool = Pool(processor, leaser, PoolLimits(1, 1), sequencer=Sequencer(per_key=4))
    pool.start()
    pool.admit([
        make_delivery(b"{}", {"job": "t.stops", "job_id": f"k-{i}"}, message_id=f"m{i}",
                      ordering_key="k")
        for i in (1, 2)
    ])  # fmt: skip
    return pool


def test_a_keyed_run_handed_back_lets_no_later_message_of_its_key_start_meanwhile() -> None:
    # Given an ordered pool running the first of two messages of one key (the second waits
    # behind it), the job ending once told to stop, and a hand-back that publishes a copy
    jobs, seen, acks, renewer = Registry(), _RunsSeen(), FakeAcks(), _SlowRenewer()
    started: list[str] = []

    @jobs.job("t.stops")
    def stops(ctx: JobContext, payload: dict[str, Any]) -> None:
        started.append(ctx.job_id)
        ctx.cancelled.wait(10)

    pool = _ordered_pool_of_two(jobs, (seen,), acks, renewer)
    try:
        assert wait_for(lambda: started, timeout=5)
        # When another thread hands the first back (a lost claim), and its run ends while
        # the copy is being published
        handing = threading.Thread(target=seen.runs[0].hand_back, args=(LostLease(after=1.0),))
        handing.start()
        assert wait_for(lambda: pool.running == 0, timeout=5)
        renewer.release.set()
        handing.join(5)
        # Then the second never started: it went back behind the first (each copied, then
        # acked; the second once the first's copy is out, on the thread that handed it back)
        assert wait_for(lambda: sorted(acks.acked) == ["ack-m1", "ack-m2"], timeout=5)
        assert started == ["k-1"]
    finally:
        renewer.release.set()
        assert pool.join(time.monotonic() + 5)


class _HeldUpCopies(Renewer):
    """Every delivery is its last. The first renewal is held up until ``release`` is set
    before it publishes (its thread descheduled, as the GIL may leave it); each renewal
    records the messages it published, in order."""

    def __init__(self) -> None:
        super().__init__(None, "projects/p/topics/t", "projects/p/subscriptions/s", 5)
        self.release = threading.Event()
        self.entered = threading.Event()
        self._first = threading.Lock()
        self.published: list[str] = []

    def last(self, delivery_attempt: int) -> bool:
        return True

    def renew(self, copies: Sequence[tuple[Delivery, float]]) -> list[bool]:
        if self._first.acquire(blocking=False):  # never released: only the first waits
            self.entered.set()
            self.release.wait(10)
        self.published += [delivery.message_id for delivery, _ in copies]
        return [True] * len(copies)


def _hand_back_held_up_while(
    pool: Pool, seen: _RunsSeen, acks: FakeAcks, renewer: _HeldUpCopies, ends: Callable[[], bool]
) -> None:
    """Hand m1's run back on another thread (a lost claim), held up before it publishes m1's
    copy, while ``ends`` ends the run (True once it has); then check that m2's copy went out
    only after m1's (none while held up: m2 would go back on the thread that ended the run),
    that both were acked (each copied in its place) and left the pool's hold, and that none
    ran again."""
    handing = threading.Thread(target=seen.runs[0].hand_back, args=(LostLease(after=1.0),))
    handing.start()
    assert renewer.entered.wait(5)
    assert ends()
    assert not wait_for(lambda: renewer.published, timeout=0.5)
    assert pool.held == 2  # both still held meanwhile
    renewer.release.set()
    handing.join(5)
    assert wait_for(lambda: renewer.published == ["m1", "m2"], timeout=5), renewer.published
    assert wait_for(lambda: sorted(acks.acked) == ["ack-m1", "ack-m2"], timeout=5)
    assert wait_for(lambda: pool.held == 0, timeout=5)
    assert len(seen.runs) == 1


def test_a_keyed_run_handed_back_has_its_copy_published_before_its_keys_later_messages() -> None:
    # Given an ordered pool running the first of two messages of one key, both on their last
    # delivery (a hand-back publishes a copy of each in its place), the job ending once told
    # to stop
    jobs, seen, acks, renewer = Registry(), _RunsSeen(), FakeAcks(), _HeldUpCopies()
    jobs.job("t.stops")(lambda ctx, payload: ctx.cancelled.wait(10))
    pool = _ordered_pool_of_two(jobs, (seen,), acks, renewer)
    try:
        assert wait_for(lambda: seen.runs, timeout=5)
        # When another thread hands the first back (a lost claim) and is held up before it
        # publishes the copy, while the run, told to stop, ends: Then the first's copy is
        # published first, then the second's
        _hand_back_held_up_while(
            pool, seen, acks, renewer, lambda: wait_for(lambda: pool.running == 0, timeout=5)
        )
    finally:
        renewer.release.set()
        assert pool.join(time.monotonic() + 5)


def test_a_drain_gives_back_a_key_waiting_for_a_permit_in_order() -> None:
    # Given an ordered pool of one slot running an async job of key x, a slot thread waiting
    # for the permit with k1, and k2 waiting behind k1, all on their last delivery
    jobs, acks, renewer = Registry(), FakeAcks(), _HeldUpCopies()
    renewer.release.set()
    go = threading.Event()

    @jobs.job("t.waits")
    async def waits(ctx: Any, payload: dict[str, Any]) -> None:
        while not go.is_set():
            await asyncio.sleep(0.005)

    jobs.job("t.quick")(lambda ctx, payload: None)
    leaser = Leaser(acks, granted=600)
    processor = Processor(
        jobs, acks, leaser, FakeDeadLetters(), (), ProcessorSettings(), renewer=renewer
    )
    pool = Pool(processor, leaser, PoolLimits(1, 2), sequencer=Sequencer(per_key=4))
    pool.start()
    try:
        pool.admit([
            make_delivery(b"{}", {"job": job, "job_id": message_id}, message_id=message_id,
                          ordering_key=message_id[0])
            for job, message_id in (("t.waits", "x1"), ("t.quick", "k1"), ("t.quick", "k2"))
        ])  # fmt: skip
        assert wait_for(lambda: pool.running == 1 and len(pool._starting) == 1, timeout=5)
        # When the pool goes quiet (a drain)
        pool.quiet()
        # Then k's two are given back at once, neither run, each copied in its place: k1's
        # copy first
        assert renewer.published == ["k1", "k2"]
        assert sorted(acks.acked) == ["ack-k1", "ack-k2"]
        assert wait_for(lambda: pool.held == 1, timeout=5)
    finally:
        go.set()
        assert pool.join(time.monotonic() + 5)


class _HeldUpRecords(Middleware):
    """Has each successful run's completion recorded only when ``record_all`` is called, on
    the caller's thread, as the idempotency store's middleware records it off the slot
    thread."""

    def __init__(self) -> None:
        self.waiting: list[Callable[[Outcome], None]] = []

    def after(self, run: Run, ended: Ended) -> Ended:
        if isinstance(ended, Succeeded):

            def record(then: Callable[[Outcome], None], *, awaited: bool = False) -> None:
                self.waiting.append(then)

            run.completion = record
        return ended

    def record_all(self) -> None:
        for then in self.waiting:
            then(Succeeded())


def test_a_keyed_run_handed_back_while_its_success_is_recorded_has_its_copy_published_first() -> (
    None
):
    # Given an ordered pool of two messages of one key, both on their last delivery, whose
    # first has run and succeeded, its completion not yet recorded
    jobs, seen, acks, renewer = Registry(), _RunsSeen(), FakeAcks(), _HeldUpCopies()
    recording = _HeldUpRecords()
    jobs.job("t.stops")(lambda ctx, payload: None)
    pool = _ordered_pool_of_two(jobs, (seen, recording), acks, renewer)

    def recorded() -> bool:  # on a thread of its own, as the completions thread records
        recorder = threading.Thread(target=recording.record_all)
        recorder.start()
        recorder.join(5)
        return not recorder.is_alive()

    try:
        assert wait_for(lambda: recording.waiting, timeout=5)
        # When another thread hands it back (a lost claim) and is held up before it publishes
        # the copy, while the record is written (its message then leaves the pool, on the
        # recording thread): Then the first's copy is published first, then the second's
        _hand_back_held_up_while(pool, seen, acks, renewer, recorded)
    finally:
        renewer.release.set()
        assert pool.join(time.monotonic() + 5)


def test_a_keyed_async_run_handed_back_has_its_copy_published_before_its_keys_later_messages() -> (
    None
):
    # Given an ordered pool running the first of two messages of one key, both on their last
    # delivery, the job an async one that ends once told to stop
    jobs, seen, acks, renewer = Registry(), _RunsSeen(), FakeAcks(), _HeldUpCopies()

    @jobs.job("t.stops")
    async def stops(ctx: Any, payload: dict[str, Any]) -> None:
        while not ctx.cancelled.is_set():
            await asyncio.sleep(0.005)

    pool = _ordered_pool_of_two(jobs, (seen,), acks, renewer)
    try:
        assert wait_for(lambda: seen.runs and pool.running == 1, timeout=5)
        # When another thread hands it back (a lost claim) and is held up before it publishes
        # the copy, while the task, told to stop, ends and a slot thread carries its end:
        # Then the first's copy is published first, then the second's
        _hand_back_held_up_while(
            pool, seen, acks, renewer, lambda: wait_for(lambda: pool.running == 0, timeout=5)
        )
    finally:
        renewer.release.set()
        assert pool.join(time.monotonic() + 5)
