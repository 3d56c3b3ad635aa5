"""``async def`` handlers through the processor, with in-process fakes (the behaviour on the
emulator is in test_async_emulator.py)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.support import wait_for
from workerpool import AsyncJobContext, Defer, PermanentError, RetryableError
from workerpool import constants as c
from workerpool.context import Flag
from workerpool.ratelimit import LocalLimiters, RateSpec
from workerpool.registry import Registry
from workerpool.telemetry import Telemetry
from workerpool.testing.fakes import FakeAcks, FakeDeadLetters, FakeLeaser, make_delivery
from workerpool.worker.aio import EventLoop
from workerpool.worker.backoff import Backoff
from workerpool.worker.middleware import Middleware, TimeLimit
from workerpool.worker.processor import Ending, Processor, ProcessorSettings
from workerpool.worker.timers import Timers

BACKOFF = Backoff(minimum=1.0, maximum=60.0)


@pytest.fixture
def loop() -> Iterator[EventLoop]:
    loop = EventLoop(blocked_after=0.2)
    yield loop
    loop.close(2.0)


def build(
    jobs: Registry, loop: EventLoop, middleware: list[Middleware] | None = None, **kw: Any
) -> tuple[Processor, FakeAcks, FakeDeadLetters]:
    acks, dead_letters = FakeAcks(), FakeDeadLetters()
    processor = Processor(
        jobs, acks, FakeLeaser(), dead_letters, middleware or [], ProcessorSettings(BACKOFF),
        loop=loop, **kw,
    )  # fmt: skip
    return processor, acks, dead_letters


def test_an_async_handler_runs_on_the_loop_and_its_message_is_acked_after(loop: EventLoop) -> None:
    # Given an async job that awaits before it records where it ran
    jobs, ran = Registry(), []

    @jobs.job("t.async")
    async def handle(ctx: AsyncJobContext, payload: dict[str, Any]) -> None:
        await asyncio.sleep(0.01)
        ran.append((payload["n"], threading.current_thread().name, type(ctx).__name__))

    processor, acks, _ = build(jobs, loop)
    # When its message is processed
    processor.process(make_delivery(b'{"n": 1}', {"job": "t.async"}))
    # Then its body ran to the end on the loop's thread, with an async context, and then acked
    assert ran == [(1, "workerpool-loop", "AsyncJobContext")]
    assert acks.acked == ["ack-m-1"] and processor.stats == {"done": 1}


@pytest.mark.parametrize(
    ("raised", "stats", "error_type"),
    [
        (RetryableError("upstream 503"), {"retried": 1}, None),
        (ValueError("a bug"), {"retried": 1}, None),
        (PermanentError("bad request"), {"dead_lettered": 1}, c.ERR_PERMANENT),
        (Defer("not yet", delay=5), {"deferred": 1}, None),
    ],
)
def test_what_an_async_handler_raises_is_decided_by_the_same_table(
    loop: EventLoop, raised: Exception, stats: dict[str, int], error_type: str | None
) -> None:
    # Given an async job that raises after an await
    jobs = Registry()

    @jobs.job("t.raises")
    async def handle(ctx: AsyncJobContext, payload: dict[str, Any]) -> None:
        await asyncio.sleep(0)
        raise raised

    processor, _, dead_letters = build(jobs, loop)
    # When it runs, Then its message takes the path a sync job's would
    processor.process(make_delivery(b"{}", {"job": "t.raises"}))
    assert processor.stats == stats
    assert [r.error_type for _, r in dead_letters.records] == ([error_type] if error_type else [])


def test_an_async_job_past_its_timeout_gets_cancelled_error_and_is_retried(
    loop: EventLoop, timers: Timers
) -> None:
    # Given an async job with a 0.2 s timeout that would sleep for 30 s
    jobs, seen = Registry(), []

    @jobs.job("t.slow", timeout=0.2, max_attempts=3)
    async def slow(ctx: AsyncJobContext, payload: dict[str, Any]) -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen.append(ctx.timed_out.is_set())
            raise

    processor, acks, _ = build(jobs, loop, [TimeLimit(timers)])
    # When it runs
    processor.process(make_delivery(b"{}", {"job": "t.slow"}))
    # Then CancelledError reached the handler at its timeout, and the message is retried
    assert seen == [True]
    assert processor.stats == {"retried": 1} and acks.acked == []
    [(_, delay)] = acks.modacked
    assert delay > 0  # a retry with backoff, not an immediate redelivery


def test_ctx_sleep_and_awaiting_draining_return_early(loop: EventLoop) -> None:
    # Given an async job that awaits ctx.draining, then sleeps until it is cancelled
    jobs, seen = Registry(), []
    entered = threading.Event()

    @jobs.job("t.waits")
    async def waits(ctx: AsyncJobContext, payload: dict[str, Any]) -> None:
        entered.set()
        seen.append(await ctx.draining)
        seen.append(await ctx.sleep(0.01))  # not cancelled: slept it out
        try:
            seen.append(await ctx.sleep(30))
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    processor, acks, _ = build(jobs, loop)
    worker = threading.Thread(
        target=processor.process, args=(make_delivery(b"{}", {"job": "t.waits"}),)
    )
    worker.start()
    assert entered.wait(5)
    # When the pool drains, then passes its deadline
    processor.draining.set()
    wait_for(lambda: len(seen) == 2, 5)
    handed_back = processor.interrupt_running()
    worker.join(5)
    # Then each wait ended when it should (the last one early: False, or the task's
    # CancelledError if its cancel landed first), and its message was given back
    assert seen[:2] == [True, True] and seen[2] in (False, "cancelled") and handed_back == 1
    assert processor.stats == {"drained": 1} and acks.acked == []


def test_a_flag_wakes_coroutines_on_other_loops_and_forgets_those_that_stopped_waiting() -> None:
    # Given a flag, and waiters on two event loops, one of which gives up first
    flag = Flag()

    async def wait(timeout: float) -> bool:
        return await flag.until(timeout)

    assert asyncio.run(wait(0.01)) is False
    woken: list[bool] = []
    waiter = threading.Thread(target=lambda: woken.append(asyncio.run(wait(10))))
    waiter.start()
    wait_for(lambda: flag._callbacks, 5)  # the waiter is registered
    # When it is set from another thread
    flag.set()
    waiter.join(5)
    # Then the waiting coroutine woke, and nothing stays registered
    assert woken == [True] and flag._callbacks is None
    assert asyncio.run(wait(0)) is True


def test_the_runs_span_is_current_inside_the_coroutine(loop: EventLoop) -> None:
    # Given traces recorded in memory, and an async job that starts a span of its own
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    telemetry = Telemetry(tracer_provider=provider)
    jobs = Registry()

    @jobs.job("t.traced")
    async def traced(ctx: AsyncJobContext, payload: dict[str, Any]) -> None:
        with provider.get_tracer("handler").start_as_current_span("call upstream"):
            await asyncio.sleep(0)

    processor, _, _ = build(jobs, loop, telemetry.middleware("projects/p/subscriptions/s"))
    # When it runs
    processor.process(make_delivery(b"{}", {"job": "t.traced"}))
    # Then the handler's span is a child of the run's span
    by_name = {span.name: span for span in spans.get_finished_spans()}
    child, parent = by_name["call upstream"], by_name["t.traced"]
    assert child.parent is not None and parent.context is not None
    assert child.parent.span_id == parent.context.span_id
    assert trace.get_current_span() is trace.INVALID_SPAN  # nothing leaked to this thread


def test_an_async_run_goes_on_with_no_thread_and_a_thread_carries_its_end(
    loop: EventLoop, timers: Timers
) -> None:
    # Given an async job that waits to be let go, traced and with a time limit
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    jobs, go = Registry(), threading.Event()

    @jobs.job("t.carried")
    async def carried(ctx: AsyncJobContext, payload: dict[str, Any]) -> None:
        while not go.is_set():
            await asyncio.sleep(0.005)
        with provider.get_tracer("handler").start_as_current_span("call upstream"):
            pass

    middleware = [*Telemetry(tracer_provider=provider).middleware("s"), TimeLimit(timers)]
    processor, acks, _ = build(jobs, loop, middleware)
    rest: list[Callable[[], Ending]] = []
    # When its message is processed by a caller that can resume it
    ending = processor.process(make_delivery(b"{}", {"job": "t.carried"}), resume=rest.append)
    # Then the call returns while the handler still runs, with nothing settled
    assert ending is Ending.CARRIED and not go.is_set()
    assert rest == [] and acks.acked == [] and processor.stats == {}
    # And once the task ends, the rest of the run is handed over once, not yet carried out
    go.set()
    wait_for(lambda: rest, timeout=5)
    assert len(rest) == 1 and acks.acked == []
    # When another thread carries it
    carried_by: list[Ending] = []
    other = threading.Thread(target=lambda: carried_by.append(rest[0]()))
    other.start()
    other.join(5)
    # Then the message is acked there, and the span the middleware made current before the
    # handler (in the run's own context) was the handler's parent and has ended
    assert carried_by == [Ending.SETTLED] and acks.acked == ["ack-m-1"]
    assert processor.stats == {"done": 1}
    by_name = {span.name: span for span in spans.get_finished_spans()}
    child, parent = by_name["call upstream"], by_name["t.carried"]
    assert child.parent is not None and parent.context is not None
    assert child.parent.span_id == parent.context.span_id
    assert trace.get_current_span() is trace.INVALID_SPAN  # nothing leaked to this thread


def test_a_handler_that_blocks_the_loop_is_named_in_a_warning(
    loop: EventLoop, caplog: pytest.LogCaptureFixture
) -> None:
    # Given an async job that calls time.sleep (blocking the loop for 0.8 s)
    jobs = Registry()

    @jobs.job("t.blocks")
    async def blocks(ctx: AsyncJobContext, payload: dict[str, Any]) -> None:
        time.sleep(0.8)

    processor, _, _ = build(jobs, loop)
    # When it runs
    with caplog.at_level(logging.WARNING, logger="workerpool.worker.aio"):
        processor.process(make_delivery(b"{}", {"job": "t.blocks"}, message_id="m-9"))
    # Then one warning names the job and its job id; the job itself still completed
    [warning] = [r.getMessage() for r in caplog.records if r.name == "workerpool.worker.aio"]
    assert warning.startswith("async job t.blocks m-9 has held the event loop for")
    assert processor.stats == {"done": 1}


def test_async_rate_limited_runs_wait_without_blocking_the_loop(loop: EventLoop) -> None:
    # Given a limit of one call per 2 s, and an async job that makes two calls
    limiters = LocalLimiters({"api": RateSpec(0.5, 1)})
    jobs, events = Registry(), []
    waiting = threading.Event()

    @jobs.job("t.calls")
    async def calls(ctx: AsyncJobContext, payload: dict[str, Any]) -> None:
        await ctx.acquire("api")
        waiting.set()
        waited = await ctx.acquire("api")
        events.append(("second call", waited))

    @jobs.job("t.quick")
    async def quick(ctx: AsyncJobContext, payload: dict[str, Any]) -> None:
        events.append(("quick job", 0.0))

    processor, _, _ = build(jobs, loop, limiters=limiters)
    limited = threading.Thread(
        target=processor.process, args=(make_delivery(b"{}", {"job": "t.calls"}),)
    )
    limited.start()
    # When another async job runs on the same loop while the first waits for its token
    assert waiting.wait(5)
    processor.process(make_delivery(b"{}", {"job": "t.quick"}, message_id="m-2"))
    limited.join(10)
    # Then it ran to the end meanwhile, and the second call still waited for its token
    [(first, _), (second, waited)] = events
    assert (first, second) == ("quick job", "second call")
    assert waited > 1.0
    assert processor.stats == {"done": 2}


def test_an_async_rate_limit_wait_gives_up_when_the_pool_drains(loop: EventLoop) -> None:
    # Given a limit of one call per 100 s whose burst is spent
    limiters = LocalLimiters({"slow": RateSpec(0.01, 1)})
    assert limiters.acquire("slow", 1, Flag()) == 0.0
    jobs = Registry()

    @jobs.job("t.calls")
    async def calls(ctx: AsyncJobContext, payload: dict[str, Any]) -> None:
        await ctx.acquire("slow")

    processor, acks, _ = build(jobs, loop, limiters=limiters)
    threading.Timer(0.2, processor.draining.set).start()
    # When a run waits for a token and the pool drains, Then it is deferred at once
    processor.process(make_delivery(b"{}", {"job": "t.calls"}))
    assert processor.stats == {"deferred": 1}
    assert acks.modacked == [("ack-m-1", 0)]


def test_a_closed_loop_refuses_runs_instead_of_leaving_them_waiting(loop: EventLoop) -> None:
    # Given a loop that ran a job, then closed
    jobs = Registry()

    @jobs.job("t.async")
    async def handle(ctx: AsyncJobContext, payload: dict[str, Any]) -> None:
        pass

    processor, _, _ = build(jobs, loop)
    processor.process(make_delivery(b"{}", {"job": "t.async"}))
    loop.close(2.0)
    # When another message for it arrives, Then it is retried, not stuck
    processor.process(make_delivery(b"{}", {"job": "t.async"}, message_id="m-2"))
    assert processor.stats == {"done": 1, "retried": 1}


def _context() -> AsyncJobContext:
    return AsyncJobContext("t.tick", "tick", "tick", 1, None, Flag())


def test_a_run_whose_cancel_came_before_the_loop_began_it_never_begins_and_ends(
    loop: EventLoop,
) -> None:
    # Given a run told to stop (handed back at the drain deadline, say) after it was
    # submitted, before the loop began its task
    ctx = _context()
    ctx.cancelled.set()

    began: list[str] = []

    async def long(ctx: AsyncJobContext, payload: Any) -> None:
        began.append(ctx.job_id)
        await asyncio.sleep(30)

    # When the loop runs it, Then it ends cancelled at once, its handler never begun
    ended: list[BaseException | None] = []

    def run() -> None:
        try:
            loop.run(long, ctx, None)
            ended.append(None)
        except BaseException as exc:
            ended.append(exc)

    waiting = threading.Thread(target=run, daemon=True)
    waiting.start()
    waiting.join(5)
    assert len(ended) == 1 and isinstance(ended[0], asyncio.CancelledError), ended
    assert began == []


def test_the_pools_of_a_process_share_one_loop_until_the_last_lets_go() -> None:
    # Given two pools taking the process's loop
    first, second = EventLoop.shared(), EventLoop.shared()
    assert first is second

    loops: list[asyncio.AbstractEventLoop] = []

    async def where() -> None:
        loops.append(asyncio.get_running_loop())

    first.run(lambda ctx, payload: where(), _context(), None)
    # When one lets go, Then the other still runs on the same loop
    first.release(1.0)
    second.run(lambda ctx, payload: where(), _context(), None)
    assert len(loops) == 2 and loops[0] is loops[1]
    # And when the last lets go, it is closed, and the next pool gets a new one
    second.release(1.0)
    with pytest.raises(RuntimeError, match="closed"):
        second.run(lambda ctx, payload: where(), _context(), None)
    third = EventLoop.shared()
    try:
        assert third is not first
    finally:
        third.release(1.0)
