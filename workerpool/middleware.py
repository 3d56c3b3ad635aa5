"""Concerns that wrap a job run: each gets the job, its context and the next step.

``run`` returns the outcome of the rest of the chain (or its own, to short-circuit it, as the
idempotency check does for a job already completed). ``interrupted`` is called when the drain
deadline passes while the job still runs, so a middleware can give back what it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from workerpool.context import JobContext
from workerpool.deadlines import Deadlines
from workerpool.envelope import Job
from workerpool.outcome import Interrupted, Outcome
from workerpool.ratelimit.limiters import RateLimiters

Next = Callable[[Job, JobContext], Outcome]


class Middleware:
    def run(self, job: Job, ctx: JobContext, call_next: Next) -> Outcome:
        return call_next(job, ctx)

    def interrupted(self, job: Job, ctx: JobContext) -> None:
        """The drain deadline passed while ``job`` ran; its message is being nacked."""

    def close(self) -> None:
        """The worker is stopping."""


def chain(middleware: Sequence[Middleware], innermost: Next) -> Next:
    """Compose so that ``middleware[0]`` runs outermost."""
    call = innermost
    for mw in reversed(middleware):
        call = _bind(mw, call)
    return call


def _bind(mw: Middleware, call_next: Next) -> Next:
    return lambda job, ctx: mw.run(job, ctx, call_next)


class TimeLimit(Middleware):
    """Sets ``ctx.timed_out`` then ``ctx.cancelled`` when the job passes its ``timeout``.

    Python cannot stop a thread from outside, so the limit is cooperative; if a handler ignores
    it, its lease stops being extended soon after and the message is redelivered.
    """

    def __init__(self) -> None:
        self._deadlines = Deadlines()

    def run(self, job: Job, ctx: JobContext, call_next: Next) -> Outcome:
        # Scheduled in this order, timed_out is set first: a handler woken by cancelled
        # already knows why.
        entries = [
            self._deadlines.set_after(job.spec.timeout, event)
            for event in (ctx.timed_out, ctx.cancelled)
        ]
        try:
            return call_next(job, ctx)
        finally:
            for entry in entries:
                self._deadlines.discard(entry)

    def close(self) -> None:
        self._deadlines.close()


class RateLimit(Middleware):
    """One token per run from the limiter a job declares with ``@job(..., rate_limit=NAME)``."""

    def __init__(self, limiters: RateLimiters) -> None:
        self._limiters = limiters

    def run(self, job: Job, ctx: JobContext, call_next: Next) -> Outcome:
        name = job.spec.options.get("rate_limit")
        if name and self._limiters.acquire(name, 1, ctx.draining) is None:
            return Interrupted()  # draining: give the message back now, it never started
        return call_next(job, ctx)
