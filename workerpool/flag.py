"""``Flag``: a cheap ``threading.Event`` a coroutine can await too, and ``call_soon``.

On the ground floor (it imports nothing of workerpool): a run's context holds flags, and the
rate limiters wait on one, so both import it from here rather than one from the other.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Generator

_WAITING = threading.Lock()  # guards the lazy creation of every Flag's event


class Flag:
    """``threading.Event``'s ``set``/``is_set``/``wait``, made cheap to create: the event and
    its lock exist only once someone waits. Two of these per run made creating a run's context
    the largest cost of a no-op job (an Event is a Condition and two locks).

    A flag can be awaited too (``await ctx.draining``), and ``until`` waits for it with a
    timeout, from a coroutine on any event loop, without blocking it."""

    __slots__ = ("_callbacks", "_event", "_set")

    def __init__(self) -> None:
        self._set = False
        self._event: threading.Event | None = None
        self._callbacks: dict[object, Callable[[], object]] | None = None

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        # Written before the event and the callbacks are read: a waiter that arrives after
        # these reads finds the flag set (see wait and when_set).
        self._set = True
        event = self._event
        if event is not None:
            event.set()
        if self._callbacks is not None:
            with _WAITING:
                callbacks, self._callbacks = self._callbacks, None
            for callback in (callbacks or {}).values():
                callback()

    def when_set(self, callback: Callable[[], object]) -> Callable[[], None]:
        """Call ``callback`` once when the flag is set (now, if it is), from the thread that
        sets it; return a function that forgets it, for a waiter that stops waiting first."""
        key = object()
        with _WAITING:
            if not self._set:
                if self._callbacks is None:
                    self._callbacks = {}
                self._callbacks[key] = callback
                return lambda: self._forget(key)
        callback()
        return _nothing

    def _forget(self, key: object) -> None:
        with _WAITING:
            if self._callbacks is not None:
                self._callbacks.pop(key, None)

    async def until(self, timeout: float | None = None) -> bool:
        """``wait`` for a coroutine: True once set, False after ``timeout`` seconds."""
        if self._set:
            return True
        loop = asyncio.get_running_loop()
        woken: asyncio.Future[None] = loop.create_future()
        forget = self.when_set(lambda: call_soon(loop, lambda: _wake(woken)))
        try:
            await asyncio.wait_for(woken, timeout)
        except TimeoutError:
            return False
        finally:
            forget()
        return True

    def __await__(self) -> Generator[object, None, bool]:
        return self.until().__await__()

    def wait(self, timeout: float | None = None) -> bool:
        event = self._event
        if event is None:
            with _WAITING:
                if self._event is None:
                    self._event = threading.Event()
                    if self._set:
                        self._event.set()
                event = self._event
        return event.wait(timeout)


def _nothing() -> None:
    pass


def call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], object]) -> bool:
    """Schedule ``callback`` on ``loop`` from any thread; False once the loop has closed
    (nobody waits on it any more)."""
    try:
        loop.call_soon_threadsafe(callback)
    except RuntimeError:
        return False
    return True


def _wake(woken: asyncio.Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)
