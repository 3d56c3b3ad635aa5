"""What a handler knows about the run it is in."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from workerpool.errors import Defer
from workerpool.ratelimit.limiters import RateLimiters, UnknownLimiter

_WAITING = threading.Lock()  # guards the lazy creation of every Flag's event


class Flag:
    """``threading.Event``'s ``set``/``is_set``/``wait``, made cheap to create: the event and
    its lock exist only once someone waits. Two of these per run made creating a run's context
    the largest cost of a no-op job (an Event is a Condition and two locks)."""

    __slots__ = ("_event", "_set")

    def __init__(self) -> None:
        self._set = False
        self._event: threading.Event | None = None

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        # Written before the event is read: a waiter that creates the event after this read
        # finds the flag set (see wait).
        self._set = True
        event = self._event
        if event is not None:
            event.set()

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


@dataclass
class JobContext:
    """Passed to every handler as its first argument.

    ``draining`` is set when the worker starts draining: finish soon or give up cleanly.
    ``cancelled`` is set at the drain deadline or when the job passes its own ``timeout``:
    stop now; the message will be redelivered (drain) or retried (timeout).
    """

    job: str
    job_id: str
    message_id: str
    delivery_attempt: int
    publish_time: datetime | None
    draining: threading.Event
    cancelled: Flag = field(default_factory=Flag)
    # Set (before ``cancelled``) when the cancel is the job's own timeout, not the drain.
    timed_out: Flag = field(default_factory=Flag)
    # The job's section of the config file (``[jobs."NAME"]``), empty if there is none.
    config: Mapping[str, Any] = field(default_factory=dict)
    limiters: RateLimiters | None = field(default=None, repr=False)
    logger: logging.Logger | logging.LoggerAdapter[logging.Logger] = field(
        default_factory=lambda: logging.getLogger("workerpool.job")
    )

    def acquire(self, limiter: str, tokens: float = 1.0) -> float:
        """Wait for ``tokens`` from the declared rate limit ``limiter`` (one per outbound call,
        say); return the seconds waited. The lease stays extended meanwhile. Raises ``Defer``
        (the message is given back at once, not counted as a failure) if the pool drains."""
        if self.limiters is None:
            raise UnknownLimiter(f"no rate limit named {limiter!r} is declared")
        waited = self.limiters.acquire(limiter, tokens, self.draining)
        if waited is None:
            raise Defer("the pool is draining; gave up waiting for a rate-limit token", delay=0)
        return waited

    def throttled(self, limiter: str, retry_after: float | None = None) -> None:
        """Tell ``limiter`` the upstream answered "too many requests": it slows down."""
        if self.limiters is not None:
            self.limiters.throttled(limiter, retry_after)

    def sleep(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; return False early if the run is cancelled."""
        return not self.cancelled.wait(seconds)
