"""Concerns that wrap a job run, each one class with do-nothing hooks (Dramatiq's shape).

``run`` gets the ``Run`` and the next step, and returns the outcome of the rest of the chain
(or its own, to short-circuit it, as the idempotency check does for a job already completed).
``admitted`` hears what the pool took in, before any of it starts, so a middleware can prepare
a pull's messages in one call (the idempotency store claims their job ids).
``settled`` hears, once, how every message left the pool, with its outcome label, run or not.
``interrupted`` is called when a run is handed back while its handler still runs (the drain
deadline, a lost claim), so a middleware can give back what it holds. ``options`` names the
``@job`` options a middleware reads: ``@job`` refuses any option no middleware declares.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar

from workerpool.ratelimit.limiters import RateLimiters
from workerpool.worker.delivery import Delivery
from workerpool.worker.outcome import Interrupted, Outcome
from workerpool.worker.run import Run, Settled
from workerpool.worker.timers import Timers

Next = Callable[[Run], Outcome]


class Middleware:
    options: ClassVar[frozenset[str]] = frozenset()

    def start(self) -> None:
        """The worker starts: start any thread here, never in ``__init__``."""

    def admitted(self, deliveries: Sequence[Delivery]) -> None:
        """Messages the pool admitted (on the puller's thread); each is settled later."""

    def run(self, run: Run, call_next: Next) -> Outcome:
        return call_next(run)

    def settled(self, event: Settled) -> None:
        """A message left the pool (acked, nacked or recorded). Must be quick, must not raise."""

    def interrupted(self, run: Run) -> None:
        """``run`` was handed back while it still ran; its message is being nacked."""

    @property
    def healthy(self) -> bool:
        """False while this middleware cannot do its work (``/healthz`` answers 503)."""
        return True

    def close(self, timeout: float) -> None:
        """The worker is stopping: release what is held within ``timeout`` seconds."""


def chain(middleware: Sequence[Middleware], innermost: Next) -> Next:
    """Compose so that ``middleware[0]`` runs outermost."""
    call = innermost
    for mw in reversed(middleware):
        call = _bind(mw, call)
    return call


def _bind(mw: Middleware, call_next: Next) -> Next:
    return lambda run: mw.run(run, call_next)


def declared_options() -> frozenset[str]:
    """Every ``@job`` option some middleware class (imported so far) says it reads."""
    found: set[str] = set()
    pending = [Middleware]
    while pending:
        cls = pending.pop()
        found |= cls.options
        pending.extend(cls.__subclasses__())
    return frozenset(found)


class TimeLimit(Middleware):
    """Sets ``ctx.timed_out`` then ``ctx.cancelled`` when the job passes its ``timeout``.

    Python cannot stop a thread from outside, so the limit is cooperative; if a handler ignores
    it, its lease stops being extended soon after and the message is redelivered.
    """

    def __init__(self, timers: Timers) -> None:
        self._timers = timers

    def run(self, run: Run, call_next: Next) -> Outcome:
        ctx = run.ctx

        def expire() -> None:
            ctx.timed_out.set()  # first: a handler woken by cancelled already knows why
            ctx.cancelled.set()

        timer = self._timers.call_after(run.job.spec.timeout, expire)
        try:
            return call_next(run)
        finally:
            timer.cancel()


class RateLimit(Middleware):
    """One token per run from the limiter a job declares with ``@job(..., rate_limit=NAME)``."""

    options = frozenset({"rate_limit"})

    def __init__(self, limiters: RateLimiters) -> None:
        self._limiters = limiters

    def run(self, run: Run, call_next: Next) -> Outcome:
        name = run.job.spec.options.get("rate_limit")
        if name and self._limiters.acquire(name, 1, run.ctx.draining) is None:
            return Interrupted()  # draining: give the message back now, it never started
        return call_next(run)
