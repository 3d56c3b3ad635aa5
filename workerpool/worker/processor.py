"""From a leased message to its ack: decode, run through the middleware, decide, settle.

``process`` reads top to bottom as the data path; ``decide`` (in ``outcome``) is the one place
that chooses ack, nack or dead-letter, and ``Settlement.settle`` (in ``settlement``) the one
place that carries it out for a run's own end. A message can also leave without its run
ending: given back unstarted (``give_back``), or handed back while it runs
(``interrupt_running`` at the drain deadline, ``Run.hand_back`` for a lost claim). Every way
out goes through ``decide``, is counted under its label in ``stats`` and is told to every
middleware's ``settled``, once.
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
import inspect
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from workerpool import constants as c
from workerpool.context import AsyncJobContext, Flag, JobContext, RunContext
from workerpool.errors import Defer, PermanentError, RateLimitedError, RetryableError
from workerpool.ratelimit import RateLimiters
from workerpool.registry import Registry
from workerpool.worker.aio import EventLoop
from workerpool.worker.attempts import AttemptCounter
from workerpool.worker.backoff import Backoff
from workerpool.worker.counts import Counts
from workerpool.worker.delivery import Delivery
from workerpool.worker.envelope import Job, Rejection, decode
from workerpool.worker.interfaces import Acks, FailureRecords, Leases
from workerpool.worker.middleware import Chain, Middleware, Steps
from workerpool.worker.outcome import (
    LAPSED_COME_BACK,
    SUCCEEDED,
    CopyForAnother,
    Deferred,
    Failed,
    Interrupted,
    LostLease,
    NotStarted,
    Outcome,
    Rejected,
    Succeeded,
)
from workerpool.worker.renewal import Renewer
from workerpool.worker.run import UNPARKABLE, Permit, Run, recorded_now
from workerpool.worker.settlement import Settlement, Subject

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProcessorSettings:
    backoff: Backoff = field(default_factory=Backoff)
    max_payload_bytes: int = c.MAX_MESSAGE_BYTES
    # The subscription has a retry policy: Pub/Sub spaces redeliveries (see outcome.Facts).
    retry_policy: bool = False
    # The subscription delivers exactly once: an ack can be refused, so wait for its result.
    exactly_once: bool = False
    # The subscription delivers each ordering key in order: a keyed message goes back by a
    # short lease, not a nack (see ``Settlement``).
    ordered: bool = False
    # Each job's own section of the config file, ``[jobs."NAME"]``, handed to it as ctx.config
    # (converted to the job's ``config`` dataclass, if it declares one: ``Registry.configs``).
    job_config: Mapping[str, Any] = field(default_factory=dict)


class Ending(enum.Enum):
    """How far the thread that called ``Processor.process`` carried the message."""

    SETTLED = "settled"  # it settled: the message is held no more
    RECORDING = "recording"  # its run ended; it settles once its success is recorded
    CARRIED = "carried"  # its async handler runs on, with no thread; the rest is resumed


# Has a thread that may block carry the rest of an async run; what it returns is how far
# that thread carried it (SETTLED or RECORDING).
Resume = Callable[[Callable[[], Ending]], None]


class Processor:
    def __init__(
        self,
        registry: Registry,
        acks: Acks,
        leases: Leases,
        records: FailureRecords,
        middleware: Sequence[Middleware] = (),
        settings: ProcessorSettings = ProcessorSettings(),
        limiters: RateLimiters | None = None,
        loop: EventLoop | None = None,
        renewer: Renewer | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``loop`` runs the ``async def`` handlers (default: one of its own, whose thread
        starts with the first async run); ``renewer`` publishes a fresh copy of a message
        that must wait on the last delivery the subscription allows (None: it is nacked);
        ``clock`` is the one the leases' deadlines are on (see ``_fenced``)."""
        self._clock = clock
        self._registry = registry
        self._loop = loop or EventLoop()
        self._limiters = limiters
        self._leases = leases
        self._renewer = renewer
        self._middleware = list(middleware)
        self._chain = Chain(self._middleware)
        self._settlement = Settlement(
            acks, leases, records, self._middleware, renewer,
            backoff=settings.backoff, retry_policy=settings.retry_policy,
            exactly_once=settings.exactly_once, ordered=settings.ordered,
        )  # fmt: skip
        self._settings = settings
        self._attempts = AttemptCounter()
        self._running: dict[Delivery, Run] = {}  # started, until settled
        self._stopping = False  # the drain deadline passed: nothing starts any more
        self._lock = threading.Lock()
        self.draining = Flag()
        self._ahead: dict[str, bool] = {}  # by job name: see ``starts_ahead``

    def starts_ahead(self, delivery: Delivery) -> bool:
        """Whether ``delivery``'s run may go through the middleware before its handler while
        it waits for a permit, and start once granted one (see ``pool``): an async job whose
        every middleware lets it (``Middleware.ready_ahead``)."""
        name = delivery.attributes.get(c.ATTR_JOB, "")
        ahead = self._ahead.get(name)
        if ahead is None:
            spec = self._registry.get(name)
            if spec is None:
                return False  # any name may come: only registered ones are remembered
            ahead = (
                spec.is_async
                and not self._settings.exactly_once
                and all(mw.ready_ahead(spec) for mw in self._middleware)
            )
            self._ahead[name] = ahead
        return ahead

    def renew_until(self, deadline: float) -> None:
        """A drain ends at the monotonic ``deadline``: no message's copy is waited for beyond
        it (the message is nacked instead; see ``Renewer.stop_by``)."""
        if self._renewer is not None:
            self._renewer.stop_by(deadline)

    def admitted(self, deliveries: Sequence[Delivery]) -> None:
        """The pool took these in; none has started yet."""
        if self._renewer is not None:  # a copy for another subscription is only acked here
            deliveries = [d for d in deliveries if self._renewer.ours(d.attributes)]
        for mw in self._middleware:
            try:
                mw.admitted(deliveries)
            except Exception:  # a middleware that could not prepare does it when they run
                log.exception("%s.admitted failed", type(mw).__name__)

    def process(
        self,
        delivery: Delivery,
        permit: Permit = UNPARKABLE,
        left: Callable[[], None] | None = None,
        resume: Resume | None = None,
    ) -> Ending:
        """Run one message, holding ``permit`` (the pool's right to run), as far as this
        thread carries it (see ``Ending``): ``left`` is called once a message that settles
        later (``RECORDING``) has settled, on the thread that recorded it; ``resume`` is
        given the rest of an async run (``CARRIED``) when its task ends. Without ``resume``
        this thread waits for the task."""
        attempt = self._attempts.attempt(delivery)
        if self._renewer is not None and not self._renewer.ours(delivery.attributes):
            self._settlement.settle(delivery, CopyForAnother(), Subject.unstarted(delivery))
            return Ending.SETTLED
        decoded = decode(
            delivery,
            self._registry,
            attempt=attempt,
            max_payload_bytes=self._settings.max_payload_bytes,
        )
        if isinstance(decoded, Rejection):
            subject = Subject(decoded.job_name, decoded.job_id, attempt)
            self._settlement.settle(
                delivery, Rejected(decoded.error_type, decoded.error_message), subject
            )
            return Ending.SETTLED
        run = self._begin(decoded, delivery, permit)
        if run is None:
            self._settlement.settle(delivery, Interrupted(), Subject.of(decoded))
            return Ending.SETTLED
        steps = Steps(self._chain, run)
        if decoded.spec.is_async and resume is not None and not self._settings.exactly_once:
            # (An exactly-once ack waits for Pub/Sub's confirmation: a slot thread carrying
            # the ends of several runs one after another would make each wait for the last.)
            return self._start_async(run, steps, left, resume)
        ended = steps.enter()
        if ended is None:
            ended = self._start_handler(run)
        return self._end(run, steps, ended, left)

    def _start_async(
        self, run: Run, steps: Steps, left: Callable[[], None] | None, resume: Resume
    ) -> Ending:
        # The middleware runs in a context of the run's own, which its task runs in too (a
        # span made current before the handler is current inside it) and which the slot
        # thread that resumes the run enters again to run the middleware after it.
        context = contextvars.copy_context()
        ended = context.run(steps.enter)
        if ended is not None:
            return context.run(self._end, run, steps, ended, left)

        def end(outcome: Outcome) -> None:
            # Now, not once a thread carries the rest (``_end``): a hand-back may come between.
            run.handler_returned = True
            resume(lambda: context.run(self._end, run, steps, outcome, left))

        def finished(error: BaseException | None) -> None:
            end(SUCCEEDED if error is None else _failure(run.job, run.ctx, error))

        def start(granted: bool) -> None:
            # On whichever thread granted the permit: the loop's own, when a task ended.
            if not granted:
                end(NotStarted())  # the pool drained while it waited, ready: release it
                return
            if not self._lease_from_now(run):
                end(_not_started(run))
                return
            if run.waiting_since is not None:  # first: TimeLimit reads the two in this order
                run.started_at += time.monotonic() - run.waiting_since
                run.waiting_since = None
            self._loop.start(run.job.spec.handler, run.ctx, run.job.payload, context, finished)

        run.waiting_since = time.monotonic()
        run.permit.start_when_held(start)
        return Ending.CARRIED

    def _end(
        self,
        run: Run,
        steps: Steps,
        ended: Outcome | BaseException,
        left: Callable[[], None] | None,
    ) -> Ending:
        """Leave the middleware with what ``ended`` the run, and settle its message by the
        outcome: now, or once its success is recorded."""
        run.handler_returned = True
        delivery = run.delivery
        try:
            try:
                outcome = steps.leave(self._fenced(run, ended))
            except BaseException as exc:  # a middleware bug: handlers cannot raise through
                # _invoke. Whatever it was (``sys.exit()`` in a hook, say), the completion an
                # inner middleware left must still be recorded or answered: else its job
                # id's claim stays held, and renewed, for as long as the process lives.
                log.exception("job %s: the middleware raised", run.job.name)
                outcome = Failed(type(exc).__name__, str(exc), exc)
            run.outcome = outcome
            if run.completion is None:
                self._settlement.settle(delivery, outcome, Subject.of(run.job, run), run)
                return Ending.SETTLED
            if self._settings.exactly_once:
                # Its ack waits for Pub/Sub's confirmation: on the recording thread that wait
                # would hold up every completion after it, so this slot waits instead.
                final = _when_recorded(outcome, recorded_now(run.completion))
                self._settlement.settle(delivery, final, Subject.of(run.job, run), run)
                return Ending.SETTLED

            def recorded(result: Outcome) -> None:
                try:
                    final = _when_recorded(outcome, result)
                    self._settlement.settle(delivery, final, Subject.of(run.job, run), run)
                finally:
                    if left is not None:
                        left()

            # The next message of its ordering key starts once this one is settled.
            run.completion(recorded, awaited=self._settings.ordered and bool(delivery.ordering_key))
            return Ending.RECORDING
        finally:
            with self._lock:  # only now: the end of a drain may still give it back
                self._running.pop(delivery, None)

    def _fenced(self, run: Run, ended: Outcome | BaseException) -> Outcome | BaseException:
        """What ended the run, unless a lease it held (its claim, a slot) lapsed meanwhile:
        its process was paused past the lease's deadline, and the lease's next holder may
        have run the job too. Then, whatever its handler did, the run neither records the
        job as done nor settles it as its owner would (an ack, a dead letter): its message
        goes back, as a lost claim's does. Checked before the middleware after the handler
        lets its slots go and records the completion."""
        if isinstance(ended, BaseException) or not (run.leases or run.lapsed):
            return ended  # (no store lease: no clock read either, on every run's path)
        lost = run.lost_lease(self._clock())
        if not lost:
            return ended
        log.error(
            "job %s (%s): its %s lapsed while it ran (its process was paused?); not acked, "
            "its message goes back",
            run.job.name, run.job.job_id, lost,
        )  # fmt: skip
        return LostLease(after=LAPSED_COME_BACK)

    def _begin(self, job: Job, delivery: Delivery, permit: Permit) -> Run | None:
        context = AsyncJobContext if job.spec.is_async else JobContext
        ctx = context(
            job=job.name,
            job_id=job.job_id,
            message_id=job.message_id,
            delivery_attempt=job.delivery_attempt,
            published=job.published,
            draining=self.draining,
            config=self._settings.job_config.get(job.name, {}),
            limiters=self._limiters,
        )
        run = Run(job, ctx, delivery, self._hand_back, permit=permit)
        with self._lock:
            if self._stopping:
                return None  # dequeued just as the drain deadline passed: never start it
            self._running[delivery] = run
        return run

    def _start_handler(self, run: Run) -> Outcome:
        if not self._lease_from_now(run):
            return _not_started(run)
        return _invoke(run.job, run.ctx, self._loop)

    def _lease_from_now(self, run: Run) -> bool:
        """Just before the handler starts: False if the message was handed back, or its job
        id cancelled, while a middleware or a run made ready ahead waited (it never starts;
        the cancel watch makes the outcome cancelled). The lease follows the job's own
        timeout, however long, and stops soon after it; it counts from here, after any wait
        for a token."""
        if run.delivery.settled or run.ctx.cancelled.is_set():
            return False
        run.delivery.lease_until = time.monotonic() + run.job.spec.timeout + self._leases.extension
        return True

    @property
    def stats(self) -> Counts[str]:
        """How many messages left under each label (``constants.Label``), live."""
        return self._settlement.stats

    # --- messages that leave without their run's own end -----------------------------------

    def give_back(self, deliveries: Sequence[Delivery], *, force: bool = False) -> int:
        """Give back messages that never started, so another worker can have them now; with
        ``force``, at the very end of a drain, whatever is still held, even a message whose
        run is still publishing its failure record (that publish may yet succeed: a second
        record after its redelivery is better than a lost message), but not one whose record
        is out (its run acks it next)."""
        taken = [d for d in deliveries if (d.force() if force else d.take())]
        with self._lock:
            runs = [self._running.get(d) for d in taken]
        self._settlement.nack_now(
            [(d, Subject.of(run.job) if run else Subject.unstarted(d), run)
             for d, run in zip(taken, runs, strict=True)],
            Interrupted() if force else NotStarted(),
            renewable=not force,
        )  # fmt: skip
        return len(taken)

    def interrupt_running(self) -> int:
        """At the drain deadline: cancel what still runs and give its messages back now;
        nothing starts from here on."""
        with self._lock:
            self._stopping = True
            running = list(self._running.values())
        return self._hand_back_all(running, Interrupted(), renewable=False)

    def _hand_back(self, run: Run, outcome: Outcome) -> bool:
        return self._hand_back_all([run], outcome) == 1

    def _hand_back_all(
        self, runs: Sequence[Run], outcome: Outcome, *, renewable: bool = True
    ) -> int:
        # Take first, then cancel: a cancelled handler (an async one's task at once) may end
        # and settle its own message before a take made after the cancel.
        # Returned as it is taken: a run ending before its nack is queued (a copy being
        # published) lets no later message of its key start, to be acked before it comes back.
        taken = [run for run in runs if run.delivery.take_back()]
        try:
            for run in runs:
                run.ctx.cancelled.set()
            self._settlement.nack_now(
                [(run.delivery, Subject.of(run.job), run) for run in taken], outcome, renewable
            )
            for run in taken:
                for mw in self._middleware:
                    try:
                        mw.interrupted(run)
                    except Exception:
                        log.exception("%s.interrupted failed", type(mw).__name__)
        finally:  # (also when something above failed, a bug: else they stay held for good)
            for run in taken:
                self._finish_hand_back(run.delivery)
        return len(taken)

    @staticmethod
    def _finish_hand_back(delivery: Delivery) -> None:
        """The hand-back of ``delivery`` is done (its nack or copy queued, or it failed): what
        its run, if it ended meanwhile, left for then (its place in the pool, its key's next)."""
        if (after := delivery.handed_back()) is None:
            return
        try:
            after(delivery)
        except Exception:  # a bug: the other hand-backs must still be finished
            log.exception("releasing %s after its hand-back failed", delivery.message_id)


def _not_started(run: Run) -> Outcome:
    """How a run that may not start its handler (``_lease_from_now``) ends: handed back (a
    lost claim, the drain deadline) or cancelled by job id meanwhile; or past its timeout
    already, its middleware having taken that long, a timeout as any other."""
    if run.ctx.timed_out.is_set() and not run.delivery.settled:
        timeout = f"its timeout of {run.job.spec.timeout:g} s passed before its handler started"
        return Failed(c.ERR_TIMED_OUT, timeout)
    return Interrupted()


def _invoke(job: Job, ctx: RunContext, loop: EventLoop) -> Outcome:
    """Call the handler (an async one as a task on ``loop``, waiting for it) and name what
    happened; nothing it raises escapes."""
    try:
        if job.spec.is_async:
            loop.run(job.spec.handler, ctx, job.payload)
            return SUCCEEDED
        result = job.spec.handler(ctx, job.payload)
    except BaseException as exc:
        return _failure(job, ctx, exc)
    # (None, as most handlers return, skips the checks: isawaitable's is an ABC's, 0.3 us.)
    if result is not None and (inspect.isawaitable(result) or inspect.isgenerator(result)):
        # Registration refuses generator functions and knows async ones; a plain def can
        # still return a coroutine (a lambda around one, say). Its body never ran: never
        # call that done.
        close = getattr(result, "close", None)
        if close is not None:
            close()  # no "coroutine was never awaited" warning at garbage collection
        return Rejected(
            c.ERR_HANDLER_RETURNED_AWAITABLE,
            f"handler returned {type(result).__name__} instead of running: declare it with "
            "async def, so the worker awaits it",
        )
    return SUCCEEDED


def _failure(job: Job, ctx: RunContext, exc: BaseException) -> Outcome:
    """What a handler's raising ``exc`` means."""
    match exc:
        case PermanentError():
            return Rejected(exc.error_type, str(exc) or type(exc).__name__, exc)
        case Defer():
            return Deferred(str(exc), exc.delay)
        case RateLimitedError():
            if exc.limiter:
                ctx.throttled(exc.limiter, exc.retry_after)
            return Failed(type(exc).__name__, str(exc), exc)
        case RetryableError():
            return Failed(type(exc).__name__, str(exc), exc)
        case asyncio.CancelledError() if ctx.timed_out.is_set():
            timeout = f"ran past its timeout of {job.spec.timeout:g} s and was cancelled"
            return Failed(c.ERR_TIMED_OUT, timeout, exc)
        case asyncio.CancelledError() if ctx.cancelled.is_set():
            return Failed(type(exc).__name__, "cancelled: its message was handed back", exc)
    # sys.exit(), a stray CancelledError, any other exception: never end the slot
    ctx.logger.exception("job %s raised %s", job.name, type(exc).__name__)
    return Failed(type(exc).__name__, str(exc), exc)


def _when_recorded(outcome: Outcome, recording: Outcome) -> Outcome:
    """Recorded: the chain's outcome stands (an outer middleware may have turned the success
    into a retry); not recorded: why, so the message is never acked."""
    return outcome if isinstance(recording, Succeeded) else recording
