"""The event loop that runs a pool's ``async def`` handlers.

A slot thread carries every run, sync or async, through the part of the middleware before
the handler, so the pool's one bound counts both kinds and the claim, rate-limit, tracing and
timeout code is one code. There an async handler's coroutine becomes a task on this loop, in
the context the middleware ran in (so the run's span is current inside the coroutine), and
the slot thread goes back to the pool: no thread waits while the task runs. ``finished``
hears the task's end on the loop's thread; the pool then has a slot thread carry the rest of
the run (the middleware after the handler, the settlement), since that may block, and
blocking store and gRPC calls never run on the loop. Setting ``ctx.cancelled`` cancels the
task (after ``ctx.cancel_grace``, where a cancel set one). A watchdog names the job whose
handler holds the loop (``time.sleep`` in an ``async def``), since that stalls every other
async run. The loop's thread starts with the
first async run, so a worker without async jobs has none. The pools of one process share one
loop (``EventLoop.shared``), so an async client a job module keeps for the process (an
``httpx.AsyncClient``) is bound to the loop every async job runs on.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from workerpool import constants as c
from workerpool.context import RunContext
from workerpool.flag import call_soon

log = logging.getLogger(__name__)

AsyncHandler = Callable[[RunContext, Any], Coroutine[Any, Any, Any]]
# Hears how a run's task ended: None if it returned, else what it raised.
Finished = Callable[[BaseException | None], None]


class EventLoop:
    _shared: EventLoop | None = None
    _users = 0
    _sharing = threading.Lock()

    @classmethod
    def shared(cls) -> EventLoop:
        """The process's loop, for one more user (a pool); ``release`` when done with it. The
        last user's release closes it; the next user after that gets a new one."""
        with cls._sharing:
            if cls._shared is None:
                cls._shared = cls()
            cls._users += 1
            return cls._shared

    def release(self, timeout: float) -> None:
        """One user of the shared loop is done; the last one closes it (within ``timeout``).
        A loop that is not the shared one is simply closed."""
        cls = type(self)
        with cls._sharing:
            if cls._shared is self:
                cls._users -= 1
                if cls._users > 0:
                    return
                cls._shared = None
        self.close(timeout)

    def __init__(self, *, blocked_after: float = c.LOOP_BLOCKED_AFTER_SECONDS) -> None:
        self._blocked_after = blocked_after
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._beat = time.monotonic()
        self._stop_watching = threading.Event()
        self._inbox: collections.deque[_Submission] = collections.deque()
        self._wake_pending = False
        self._stopped = False  # the loop ran its last callback
        self._ident: int | None = None  # the loop's thread

    def start(
        self,
        handler: AsyncHandler,
        ctx: RunContext,
        payload: Any,
        context: contextvars.Context,
        finished: Finished,
    ) -> None:
        """Start ``handler(ctx, payload)`` as a task in ``context``; ``finished`` hears what it
        raised (None: it returned; ``CancelledError`` once it was cancelled), on the loop's
        thread, or on this one if the loop is closed."""
        submitted = _Submission(handler, ctx, payload, context, finished)
        try:
            loop = self._started()
        except RuntimeError as exc:
            finished(exc)
            return
        if threading.get_ident() == self._ident:
            self._begin(loop, submitted)  # a task's end started it: in the same iteration
            return
        self._inbox.append(submitted)
        if self._stopped:  # after the loop's last look at the inbox: nobody else will
            self._refuse_inbox()
        # One wake-up of the loop for all the runs submitted before it drains the inbox: a
        # cross-thread wake-up is most of what an async run costs beyond a sync one.
        elif not self._wake_pending:
            self._wake_pending = True
            call_soon(loop, self._drain)

    def run(self, handler: AsyncHandler, ctx: RunContext, payload: Any) -> None:
        """``start``, and wait on this thread for the end; raises what the handler raised."""
        waiter = _Waiter()
        self.start(handler, ctx, payload, contextvars.copy_context(), waiter.finished)
        waiter.wait()

    def _drain(self) -> None:
        self._wake_pending = False  # first: a run submitted from here on wakes the loop again
        loop = self._loop
        assert loop is not None
        while self._inbox:
            self._begin(loop, self._inbox.popleft())

    def _begin(self, loop: asyncio.AbstractEventLoop, submitted: _Submission) -> None:
        ctx = submitted.ctx
        if ctx.cancelled.is_set():  # told to stop before its task began: it never begins
            submitted.finished(asyncio.CancelledError())
            return
        try:
            coroutine = submitted.context.run(submitted.handler, ctx, submitted.payload)
            task = loop.create_task(
                coroutine, name=f"{ctx.job} {ctx.job_id}", context=submitted.context
            )
        except BaseException as exc:  # the call itself raised, or returned no coroutine
            submitted.finished(exc)
            return

        def cancel() -> None:
            # Read when the flag is set: a cancel by job id gives the handler a grace first.
            if ctx.cancel_grace > 0:
                loop.call_later(ctx.cancel_grace, task.cancel)
            else:
                task.cancel()

        # After ``cancel`` is defined: a flag set already calls back at once.
        forget = ctx.cancelled.when_set(lambda: call_soon(loop, cancel))

        def done(task: asyncio.Task[Any]) -> None:
            # In the loop's context, not the task's: ``finished`` may hand the task's context
            # to another thread, which could not enter it while this callback is in it.
            forget()
            submitted.finished(asyncio.CancelledError() if task.cancelled() else task.exception())

        task.add_done_callback(done)

    def _started(self) -> asyncio.AbstractEventLoop:
        loop = self._loop
        if loop is not None and not self._closed:
            return loop
        with self._lock:
            if self._closed:
                raise RuntimeError("the event loop for async jobs is closed")
            if self._loop is None:
                loop = asyncio.new_event_loop()
                self._thread = threading.Thread(
                    target=self._serve, args=(loop,), name="workerpool-loop", daemon=True
                )
                self._thread.start()
                threading.Thread(
                    target=self._watch, args=(loop,), name="workerpool-loop-watch", daemon=True
                ).start()
                self._loop = loop
            return self._loop

    def _serve(self, loop: asyncio.AbstractEventLoop) -> None:
        self._ident = threading.get_ident()
        asyncio.set_event_loop(loop)
        loop.run_forever()
        loop.close()  # from here, a heartbeat is refused
        self._stopped = True  # before the last look: a run submitted after it refuses itself
        self._refuse_inbox()

    def _refuse_inbox(self) -> None:
        while True:
            try:
                submitted = self._inbox.popleft()
            except IndexError:
                return
            submitted.finished(RuntimeError("the event loop for async jobs is closed"))

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Every quarter of ``blocked_after``, ask the loop for a heartbeat; when none came for
        ``blocked_after``, whatever task is running now is the one holding the loop."""
        reported: asyncio.Task[Any] | None = None
        while not self._stop_watching.wait(self._blocked_after / 4):
            if not call_soon(loop, self._heartbeat):
                return
            stalled = time.monotonic() - self._beat
            if stalled < self._blocked_after:
                reported = None
                continue
            task = asyncio.current_task(loop)
            if task is None or task is reported:
                continue
            reported = task
            log.warning(
                "async job %s has held the event loop for %.1f s: every other async run waits. "
                "It makes a blocking call; await instead (asyncio.to_thread for blocking "
                "libraries), or write the job as a plain def",
                task.get_name(),
                stalled,
            )

    def _heartbeat(self) -> None:
        self._beat = time.monotonic()

    def close(self, timeout: float) -> None:
        """Cancel what still runs on the loop and stop it, waiting up to ``timeout``."""
        with self._lock:
            self._closed = True
            loop, thread = self._loop, self._thread
        self._stop_watching.set()
        if loop is None or thread is None:
            return
        if call_soon(loop, lambda: loop.create_task(_stop(loop, timeout))):
            thread.join(timeout)


@dataclass(frozen=True, slots=True)
class _Submission:
    handler: AsyncHandler
    ctx: RunContext
    payload: Any
    context: contextvars.Context
    finished: Finished


class _Waiter:
    """How a thread waits for a run's end: a lock held until then (lighter than a Future,
    which is a Condition and its lock)."""

    __slots__ = ("_done", "_error")

    def __init__(self) -> None:
        self._error: BaseException | None = None
        self._done = threading.Lock()
        self._done.acquire()

    def finished(self, error: BaseException | None) -> None:
        self._error = error
        self._done.release()

    def wait(self) -> None:
        self._done.acquire()
        if self._error is not None:
            raise self._error


async def _stop(loop: asyncio.AbstractEventLoop, timeout: float) -> None:
    tasks = [task for task in asyncio.all_tasks(loop) if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    if tasks:
        # A handler that catches CancelledError and goes on is left behind, as a sync handler
        # that ignores ctx.cancelled keeps its thread: its message was handed back already.
        await asyncio.wait(tasks, timeout=timeout)
    loop.stop()
