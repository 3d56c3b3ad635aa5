"""What a handler knows about the run it is in: ``JobContext`` for a plain ``def`` handler,
``AsyncJobContext`` (the same, with ``sleep`` and ``acquire`` to ``await``) for ``async def``."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from workerpool.errors import Defer
from workerpool.flag import Flag as Flag  # re-exported: a run's context holds its flags
from workerpool.ratelimit.limiters import RateLimiters, UnknownLimiter


class Slots(Protocol):
    """Takes slots of the fleet's concurrency keys for one run (``ctx.slot``)."""

    # The fencing tokens of the slots the run was started in (its job's key, its pool's), by key.
    tokens: Mapping[str, int]

    def take(self, key: str, holder: str | None = None) -> Any:
        """A slot of ``key`` (its lease), waiting for one; raises ``Defer`` if none came
        free in time or the run must stop, ``LookupError`` for a key without a limit. A
        ``holder`` names the slot: asking again under that name gets the same slot."""
        ...

    def give(self, lease: Any, *, release: bool = True) -> None:
        """Release it, or (not ``release``) stop keeping it alive and let it lapse."""
        ...


class RunState(Protocol):
    """A run's checkpoints and progress in the store the fleet shares (``workerpool.progress``)."""

    def last(self) -> Any:
        """The checkpoint an earlier run of the job id left, None if none."""
        ...

    def save(self, state: Any) -> None:
        """Store ``state`` (a JSON value) as the job id's checkpoint; returns once stored."""
        ...

    def report(self, done: float, total: float | None, note: str) -> None:
        """Keep the run's progress, to be written to the store soon (not now)."""
        ...


@dataclass
class RunContext:
    """What every handler's context holds, sync or async.

    ``draining`` is set when the worker starts draining: finish soon or give up cleanly.
    ``cancelled`` is set at the drain deadline, when the job passes its own ``timeout``, or
    when its job id is cancelled (``workerpool cancel``): stop now; the message will be
    redelivered (drain) or retried (timeout), or the run ends cancelled. Both can be
    checked (``is_set()``), waited for (``wait``) or, in an ``async def`` handler, awaited.

    ``fencing_token`` (the run's claim on its job id) and ``slot_tokens`` (its slots, by key)
    grow with every grant: pass them to what the job writes, so that it refuses a run whose
    process was paused past its lease while another ran the job (an older token).
    """

    job: str
    job_id: str
    message_id: str
    delivery_attempt: int
    # When Pub/Sub published the message, in POSIX seconds (``publish_time`` as a float).
    published: float | None
    draining: Flag
    cancelled: Flag = field(default_factory=Flag)
    # Set (before ``cancelled``) when the cancel is the job's own timeout, not the drain.
    timed_out: Flag = field(default_factory=Flag)
    # Set (before ``cancelled``) by a cancel that leaves an ``async def`` handler this long to
    # end on its own (it may await ``cancelled``) before its task is cancelled; 0: at once.
    cancel_grace: float = 0.0
    # The job's section of the config file (``[jobs."NAME"]``): an instance of the job's
    # ``config`` dataclass if it declares one, else the section as it is (empty if none).
    config: Any = field(default_factory=dict)
    limiters: RateLimiters | None = field(default=None, repr=False)
    # Set by the concurrency middleware where limits are declared (``slot``).
    slots: Slots | None = field(default=None, repr=False)
    # The fencing token of the run's claim on its job id, where an idempotency store is
    # configured (else None): it grows with every claim granted on the job id. Pass it to
    # what the job writes, which refuses a write with an older token than it has seen: the
    # write of a run whose process was paused past its claim while another worker ran the job.
    fencing_token: int | None = None
    # Set by the checkpoints middleware where a shared store is configured.
    run_state: RunState | None = field(default=None, repr=False)
    # ``logger``'s adapter, made when a handler first asks for it: most never log.
    _logger: logging.LoggerAdapter[logging.Logger] | None = field(
        default=None, init=False, repr=False
    )

    @property
    def logger(self) -> logging.LoggerAdapter[logging.Logger]:
        """The job's logger (``workerpool.job.NAME``); its lines carry the job id."""
        if self._logger is None:
            self._logger = logging.LoggerAdapter(_job_logger(self.job), {"job_id": self.job_id})
        return self._logger

    @property
    def publish_time(self) -> datetime | None:
        """When Pub/Sub published the message, in UTC (made when asked for: most never do)."""
        return None if self.published is None else datetime.fromtimestamp(self.published, UTC)

    @property
    def slot_tokens(self) -> Mapping[str, int]:
        """The fencing tokens of the slots this run was started in (its job's concurrency
        key, its pool's), by key: each grows with every grant of its key (a slot taken with
        ``slot`` has its own, ``lease.token``)."""
        return {} if self.slots is None else self.slots.tokens

    @property
    def last_checkpoint(self) -> Any:
        """The state the last run of this job id stored with ``checkpoint`` (after a crash,
        a drain, a retry, a lost claim), to resume from; None if there is none."""
        return None if self.run_state is None else self.run_state.last()

    def progress(self, done: float, total: float | None = None, note: str = "") -> None:
        """Report how far the run has got (``workerpool status --running`` shows it). Cheap
        in a loop: kept in memory and written to the store about once a second."""
        if self.run_state is not None:
            self.run_state.report(done, total, note)

    def _run_state(self) -> RunState:
        if self.run_state is None:
            raise LookupError("checkpoints need a shared store: set idempotency_store")
        return self.run_state

    def throttled(self, limiter: str, retry_after: float | None = None) -> None:
        """Tell ``limiter`` the upstream answered "too many requests": it slows down."""
        if self.limiters is not None:
            self.limiters.throttled(limiter, retry_after)

    def _slots(self, key: str) -> Slots:
        if self.slots is None:
            raise LookupError(f"no concurrency limit is declared for {key!r}")
        return self.slots

    def _leaves_held(self, holder: str | None) -> bool:
        """A named slot outlives a run stopped inside its block."""
        return holder is not None and (self.draining.is_set() or self.cancelled.is_set())

    def _declared(self, limiter: str) -> RateLimiters:
        if self.limiters is None:
            raise UnknownLimiter(f"no rate limit named {limiter!r} is declared")
        return self.limiters


_DRAINED = "the pool is draining; gave up waiting for a rate-limit token"


@functools.cache
def _job_logger(name: str) -> logging.Logger:
    """Looked up once a job: ``getLogger`` takes the logging module's lock."""
    return logging.getLogger(f"workerpool.job.{name}")


@dataclass
class JobContext(RunContext):
    """Passed to every plain ``def`` handler as its first argument."""

    def acquire(self, limiter: str, tokens: float = 1.0) -> float:
        """Wait for ``tokens`` from the declared rate limit ``limiter`` (one per outbound call,
        say); return the seconds waited. The lease stays extended meanwhile. Raises ``Defer``
        (the message is given back at once, not counted as a failure) if the pool drains."""
        waited = self._declared(limiter).acquire(limiter, tokens, self.draining)
        if waited is None:
            raise Defer(_DRAINED, delay=0)
        return waited

    def sleep(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; return False early if the run is cancelled."""
        return not self.cancelled.wait(seconds)

    def checkpoint(self, state: Any) -> None:
        """Store ``state`` (a JSON value, at most 64 KiB encoded) under this job id; returns
        once it is stored. The next run of the job id, if this one does not finish, gets it
        as ``last_checkpoint``; it is deleted when the job finishes. Raises
        ``CheckpointTooLarge`` (a ``ValueError``) past the limit, ``TypeError`` for a value
        JSON cannot hold, ``LookupError`` where no shared store is configured."""
        self._run_state().save(state)

    @contextmanager
    def slot(self, key: str, *, holder: str | None = None) -> Iterator[Any]:
        """Hold a slot of the fleet-wide concurrency key ``key`` for the ``with`` block (a
        part of the run: one call to a partner, say); yields its lease, whose ``token`` is a
        fencing token. Waits for a free slot (keeping this run's place in the pool); if none
        comes free in time, or the pool drains, raises ``Defer``: the message comes back.

        A ``holder`` names the slot after the work it guards (a job id's BigQuery export):
        any run asking under that name holds the same slot, not a second one, and a run
        stopped inside the block (drain, cancel) leaves it held, since that work goes on
        without it: the next run of the job id takes it over, or it lapses after the TTL."""
        slots = self._slots(key)
        lease = slots.take(key, holder)
        try:
            yield lease
        except BaseException:
            slots.give(lease, release=not self._leaves_held(holder))
            raise
        slots.give(lease)


@dataclass
class AsyncJobContext(RunContext):
    """Passed to every ``async def`` handler: ``JobContext``'s waits, to ``await``. The
    run's task is cancelled when ``cancelled`` is set (``CancelledError`` at its next await)."""

    async def acquire(self, limiter: str, tokens: float = 1.0) -> float:
        """``JobContext.acquire``, waiting on the event loop instead of blocking it."""
        waited = await self._declared(limiter).acquire_async(limiter, tokens, self.draining)
        if waited is None:
            raise Defer(_DRAINED, delay=0)
        return waited

    async def sleep(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; return False early if the run is cancelled."""
        return not await self.cancelled.until(seconds)

    async def checkpoint(self, state: Any) -> None:
        """``JobContext.checkpoint``, the store's write on a thread, not on the event loop."""
        await asyncio.to_thread(self._run_state().save, state)

    @asynccontextmanager
    async def slot(self, key: str, *, holder: str | None = None) -> AsyncIterator[Any]:
        """``JobContext.slot`` for ``async with``: the store calls run on a thread, never
        on the event loop."""
        slots = self._slots(key)
        lease = await asyncio.to_thread(slots.take, key, holder)
        try:
            yield lease
        except BaseException:
            release = not self._leaves_held(holder)
            await asyncio.to_thread(functools.partial(slots.give, lease, release=release))
            raise
        await asyncio.to_thread(slots.give, lease)
