"""Concerns that wrap a job run, each one class with do-nothing hooks (Dramatiq's shape).

``before`` runs before the rest of the chain; returning an outcome ends the run there (as
the idempotency check does for a job already completed). ``around`` is for a middleware with
something to do after the rest too: a generator, what comes before its one ``yield`` runs
first, the ``yield`` gives it the outcome of the rest (or raises what the rest raised), and it
returns the run's outcome (returning before the ``yield`` ends the run there). A generator
rather than a wrapper that calls ``next``, so that ``Steps`` can stop between the two halves:
an ``async def`` handler runs as a task on the event loop while no thread waits for it, and
the halves after it run once it has ended. An ``around`` with nothing to do for some runs
can be a plain method that returns None for those, and its generator for the others.
``after`` is for a middleware whose part after the rest needs no generator's locals (what it
keeps from its ``before`` is on the ``Run``, or kept by run): a plain call, innermost first,
with the outcome of the rest (or what the rest raised), returning the run's outcome (or that
exception, to pass it on); it is called for every run that got past the middleware's
``before``, as an ``around``'s part after its ``yield`` would be. ``before`` and ``after``
cost a call each; ``around`` a generator (measured: about 1.5 us more per run each, half of
it the ``StopIteration`` that ends it), so a middleware uses the one it needs.
``admitted`` hears what the pool took in, before any of it starts, so a middleware can prepare
a pull's messages in one call (the idempotency store claims their job ids).
``settled`` hears, once, how every message left the pool, with its outcome label, run or not.
``dead_lettering`` comes before a message's failure record is published, for what must be
durable before that record and the message's ack (raising gives the message back instead,
as a record that cannot be published does); ``dead_lettered`` after it is out and before the
message's ack, once nothing else can give the message back.
``interrupted`` is called when a run is handed back while its handler still runs (the drain
deadline, a lost claim), so a middleware can give back what it holds. ``options`` names the
``@job`` options a middleware reads: ``@job`` refuses any option no middleware declares
(``workerpool.options``), and a worker any option none of its middleware reads.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Generator, Sequence
from types import MethodType
from typing import Any, ClassVar, cast

from workerpool.options import RATE_LIMIT, declare
from workerpool.ratelimit.limiters import RateLimiters
from workerpool.registry import JobSpec
from workerpool.worker.delivery import Delivery
from workerpool.worker.outcome import Interrupted, Outcome
from workerpool.worker.run import Run, Settled
from workerpool.worker.timers import Timers

log = logging.getLogger(__name__)

# What comes before the yield, the outcome of the rest of the chain, the run's outcome.
Around = Generator[None, Outcome, Outcome]
# What ended the rest of the chain (an outcome, or what it raised), and so the run.
Ended = Outcome | BaseException


class Middleware:
    options: ClassVar[frozenset[str]] = frozenset()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Declared as the class is defined, for ``@job`` to accept them (workerpool.options).
        declare(f"{cls.__module__}.{cls.__qualname__}", cls.options)
        if "run" in vars(cls):  # the wrapper form before ``around``: never skip it silently
            raise TypeError(
                f"{cls.__qualname__} defines run(run, call_next), which workerpool no longer "
                "calls: write it as before(run), or as around(run), a generator whose one "
                "yield stands for call_next(run) (see workerpool.worker.middleware)"
            )

    def start(self) -> None:
        """The worker starts: start any thread here, never in ``__init__``."""

    def admitted(self, deliveries: Sequence[Delivery]) -> None:
        """Messages the pool admitted (on the puller's thread); each is settled later."""

    def before(self, run: Run) -> Outcome | None:
        """Before the rest of the chain: None goes on, an outcome ends the run with it."""
        return None

    def ready_ahead(self, spec: JobSpec) -> bool:
        """Whether an async run of ``spec`` may go through this middleware's part before the
        handler and then wait for a permit (see ``pool``): not where what that part takes is
        spent or scarce meanwhile (a rate-limit token, a fleet-wide slot). What counts time
        from the start counts from ``run.started_at``, set when the handler starts."""
        return True

    def around(self, run: Run) -> Around | None:
        """Wraps the rest of the chain (see the module); runs after ``before``. None: nothing
        to wrap for this run. (This one is never called by ``Steps``: it is a generator only
        for an override that wraps it, ``return (yield from super().around(run))``.)"""
        return (yield)  # type: ignore[misc]

    def after(self, run: Run, ended: Ended) -> Ended:
        """After the rest of the chain, for a run that went on past ``before`` (see the
        module): ``ended`` is what ended the rest; returns the run's outcome, or ``ended``
        as it is to pass on what the rest raised."""
        return ended

    def settled(self, event: Settled) -> None:
        """A message left the pool (acked, nacked or recorded). Must be quick, must not raise."""

    def dead_lettering(self, delivery: Delivery, run: Run | None, error_type: str) -> None:
        """``delivery`` is about to be recorded on the dead-letter topic, for ``error_type``,
        and acked (``run``: None if it never ran). Raise to give it back instead."""

    def dead_lettered(self, delivery: Delivery, job_id: str) -> None:
        """``delivery``'s failure record is on the dead-letter topic, and its ack is sent next
        (nothing can give it back any more; a crash in between brings it back, and it is
        recorded again then; on an exactly-once subscription Pub/Sub may still refuse the
        ack). What this raises is logged, and the ack sent all the same: the record is out."""

    def interrupted(self, run: Run) -> None:
        """``run`` was handed back while it still ran; its message is being nacked."""

    @property
    def healthy(self) -> bool:
        """False while this middleware cannot do its work (``/healthz`` answers 503)."""
        return True

    def close(self, timeout: float) -> None:
        """The worker is stopping: release what is held within ``timeout`` seconds."""


_Hooks = tuple[
    Callable[[Run], Outcome | None] | None,
    Callable[[Run], Around | None] | None,
    Callable[[Run, Ended], Ended] | None,
]


class Chain:
    """The middleware of a processor, in order, with the hooks each one overrides: a
    middleware that overrides none costs a run nothing."""

    __slots__ = ("hooks",)

    def __init__(self, middleware: Sequence[Middleware]) -> None:
        hooks = (_hooks(mw) for mw in middleware)
        self.hooks = tuple(hook for hook in hooks if hook != (None, None, None))


def _hooks(mw: Middleware) -> _Hooks:
    """``mw``'s hooks of a run, None for each it leaves as ``Middleware`` has it."""
    kind = type(mw)
    return (
        mw.before if kind.before is not Middleware.before else None,
        mw.around if kind.around is not Middleware.around else None,
        _after(mw) if kind.after is not Middleware.after else None,
    )


def _after(mw: Middleware) -> Callable[[Run, Ended], Ended]:
    """``mw.after`` as a bound method, which ``Steps.leave`` tells from an around's generator
    by its type alone: an after that is a static method or a callable object is made one."""
    after = mw.after
    if isinstance(after, MethodType):
        return after
    return MethodType(lambda _mw, run, ended: after(run, ended), mw)


class Steps:
    """One run through a ``Chain``, stepped: ``enter`` runs each middleware's ``before`` and
    the part of its ``around`` before the yield, outermost first; ``leave`` the parts after,
    innermost first. The two may run on different threads, one after the other (an async
    handler runs in between, on the loop)."""

    __slots__ = ("_chain", "_entered", "run")

    def __init__(self, chain: Chain, run: Run) -> None:
        self._chain = chain
        self.run = run
        # The arounds under way and the afters to call, in the order entered.
        self._entered: list[Around | Callable[[Run, Ended], Ended]] = []

    def enter(self) -> Outcome | BaseException | None:
        """None: the handler may start. Else what ended the run before it: a middleware's
        outcome, or what one raised (a bug); either way hand it to ``leave``."""
        run = self.run
        entered = self._entered
        for before, around, after in self._chain.hooks:
            try:
                if before is not None and (ended := before(run)) is not None:
                    return ended
                if around is not None and (steps := around(run)) is not None:
                    next(steps)
                    entered.append(steps)
                if after is not None:
                    entered.append(after)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            except BaseException as exc:
                return exc
        return None

    def leave(self, result: Outcome | BaseException) -> Outcome:
        """The run's outcome, given what happened inside the middleware entered; raises what
        a middleware raised and no outer one handled."""
        entered = self._entered
        while entered:
            step = entered.pop()
            if isinstance(step, MethodType):  # a middleware's after (an around is a generator)
                try:
                    result = step(self.run, result)
                except BaseException as exc:
                    result = exc
                continue
            steps = cast(Around, step)
            try:
                if isinstance(result, BaseException):
                    steps.throw(result)
                else:
                    steps.send(result)
            except StopIteration as stop:
                result = stop.value
                continue
            except BaseException as exc:
                result = exc
                continue
            steps.close()
            name = getattr(steps, "__qualname__", "a middleware's around")
            result = RuntimeError(f"{name} yielded more than once")
        if isinstance(result, BaseException):
            raise result
        return result


class TimeLimit(Middleware):
    """Sets ``ctx.timed_out`` then ``ctx.cancelled`` when the job passes its ``timeout``,
    counted from this middleware's place in the chain, or from its handler's start if that
    came later (a run made ready ahead may wait for a permit after its middleware).

    Python cannot stop a thread from outside, so the limit is cooperative; if a handler ignores
    it, its lease stops being extended soon after and the message is redelivered.

    The runs under way are looked over on a tick rather than each given a timer: a run costs
    a dict's set and pop (measured: 2.0 against 0.3 us a run with a timer each, heap and
    lock included). A tick is a twentieth of the shortest timeout any run has had, from 10 ms
    to 1 s, so a run learns of its timeout that much after it at most.
    """

    def __init__(self, timers: Timers) -> None:
        self._timers = timers
        # The runs between their ``before`` and their ``after``, or their timeout, and when
        # their ``before`` came (monotonic). (A dict's set and pop are atomic: runs on any
        # thread, no lock.)
        self._running: dict[Run, float] = {}
        self._lock = threading.Lock()  # orders changes of the tick
        self._shortest = math.inf  # the shortest timeout of a run so far
        self._ticks = 0  # which chain of ticks is current: a shorter tick starts a new one

    def before(self, run: Run) -> None:
        self._running[run] = time.monotonic()
        if run.job.spec.timeout < self._shortest:  # the first run, or a shorter timeout
            self._tick_for(run.job.spec.timeout)

    def after(self, run: Run, ended: Ended) -> Ended:
        self._running.pop(run, None)
        return ended

    def _tick_for(self, timeout: float) -> None:
        with self._lock:
            if timeout >= self._shortest:
                return
            self._shortest = timeout
            self._ticks += 1
            self._timers.call_after(self._tick(), functools.partial(self._look, self._ticks))

    def _tick(self) -> float:
        return min(_MAX_TICK, max(_MIN_TICK, self._shortest / _TICKS_PER_TIMEOUT))

    def _look(self, ticks: int) -> None:
        """(On the timers' thread.) Tell each run past its timeout, then look again a tick
        later, unless a shorter tick has started a chain of its own."""
        if ticks != self._ticks:
            return
        try:
            now = time.monotonic()
            for run, entered in tuple(self._running.items()):  # a copy made holding the GIL
                # Its start moves ``started_at`` on before it clears ``waiting_since``.
                if run.waiting_since is not None:
                    continue
                if now - max(entered, run.started_at) >= run.job.spec.timeout:
                    self._running.pop(run, None)
                    _tell_timed_out(run)
        finally:  # a run's callback that raised must not end every later run's limit
            self._timers.call_after(self._tick(), functools.partial(self._look, ticks))


def _tell_timed_out(run: Run) -> None:
    # timed_out first: a handler woken by cancelled already knows why. Each flag is set
    # before its callbacks run, so one of the handler's that raises (``when_set``) stops
    # neither flag.
    for flag in (run.ctx.timed_out, run.ctx.cancelled):
        try:
            flag.set()
        except Exception:
            log.exception("job %s (%s): a callback on its timeout failed", run.job.name,
                          run.job.job_id)  # fmt: skip


_TICKS_PER_TIMEOUT = 20
_MIN_TICK = 0.01
_MAX_TICK = 1.0


class RateLimit(Middleware):
    """One token per run from the limiter a job declares with ``@job(..., rate_limit=NAME)``."""

    options = frozenset({RATE_LIMIT})

    def __init__(self, limiters: RateLimiters) -> None:
        self._limiters = limiters

    def ready_ahead(self, spec: JobSpec) -> bool:
        return not spec.options.get(RATE_LIMIT)  # a token taken is spent from then on

    def before(self, run: Run) -> Outcome | None:
        name = run.job.spec.options.get(RATE_LIMIT)
        if name and self._limiters.acquire(name, 1, run.ctx.draining) is None:
            return Interrupted()  # draining: give the message back now, it never started
        return None
