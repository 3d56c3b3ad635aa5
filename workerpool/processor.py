"""From a leased message to its ack: decode, run through the middleware, decide, settle.

``process`` reads top to bottom as the data path; ``decide`` (in ``outcome``) is the one place
that chooses ack, nack or dead-letter, and ``_settle`` the one place that carries it out.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from workerpool import constants as c
from workerpool.acks import Acknowledger
from workerpool.backoff import Backoff
from workerpool.context import JobContext
from workerpool.deadletter import DeadLetterPublisher, Failure
from workerpool.delivery import Delivery
from workerpool.envelope import Job, Rejection, decode
from workerpool.errors import Defer, PermanentError, RateLimitedError, RetryableError
from workerpool.lease import Leaser
from workerpool.listeners import Listener, Settled
from workerpool.middleware import Middleware, chain
from workerpool.outcome import (
    Ack,
    Action,
    DeadLetter,
    Deferred,
    Failed,
    Interrupted,
    Nack,
    Outcome,
    RecordFailed,
    Rejected,
    Succeeded,
    decide,
)
from workerpool.ratelimit import RateLimiters
from workerpool.registry import Registry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProcessorSettings:
    backoff: Backoff = field(default_factory=Backoff)
    max_payload_bytes: int = c.MAX_MESSAGE_BYTES
    # The subscription has a retry policy: Pub/Sub spaces redeliveries after a plain nack.
    # On the emulator, delaying with modify_ack_deadline(d) on such a subscription lost
    # messages for minutes (a batch of 2 or 6, per-message calls too), so we nack with 0 there.
    server_backoff: bool = False
    # The subscription delivers exactly once: an ack can be refused, so wait for its result.
    exactly_once: bool = False
    # Each job's own section of the config file, ``[jobs."NAME"]``, handed to it as ctx.config.
    job_config: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


# How long a worker thread waits to learn whether an exactly-once ack took.
_ACK_CONFIRM_TIMEOUT = 60.0


@dataclass(frozen=True)
class _Subject:
    """What a failure record and the logs say a message was."""

    job_name: str
    job_id: str
    attempt: int


class AttemptCounter:
    """Counts deliveries per message when Pub/Sub does not (no dead-letter policy).

    Only this process's deliveries are seen, so it is a fallback, not a replacement for the
    subscription's ``delivery_attempt``.
    """

    def __init__(self, capacity: int = 100_000) -> None:
        self._seen: OrderedDict[str, int] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def attempt(self, delivery: Delivery) -> int:
        if delivery.delivery_attempt:
            return delivery.delivery_attempt
        with self._lock:
            count = self._seen.pop(delivery.message_id, 0) + 1
            self._seen[delivery.message_id] = count
            if len(self._seen) > self._capacity:
                self._seen.popitem(last=False)
            return count


@dataclass
class _Running:
    job: Job
    ctx: JobContext
    delivery: Delivery


class Processor:
    def __init__(
        self,
        registry: Registry,
        acks: Acknowledger,
        leaser: Leaser,
        dead_letters: DeadLetterPublisher,
        middleware: Sequence[Middleware] = (),
        settings: ProcessorSettings = ProcessorSettings(),
        limiters: RateLimiters | None = None,
        listeners: Sequence[Listener] = (),
    ) -> None:
        """``listeners`` hear how each delivery ended (telemetry), once, as it is counted."""
        self._registry = registry
        self._listeners = list(listeners)
        self._limiters = limiters
        self._acks = acks
        self._leaser = leaser
        self._dead_letters = dead_letters
        self._middleware = list(middleware)
        self._run_chain = chain(self._middleware, self._start_handler)
        self._settings = settings
        self._attempts = AttemptCounter()
        self._running: dict[int, _Running] = {}  # by id(ctx)
        self._lock = threading.Lock()
        self.draining = threading.Event()
        self.stats: Counter[str] = Counter()

    def process(self, delivery: Delivery) -> None:
        attempt = self._attempts.attempt(delivery)
        decoded = decode(
            delivery,
            self._registry,
            attempt=attempt,
            max_payload_bytes=self._settings.max_payload_bytes,
        )
        if isinstance(decoded, Rejection):
            outcome: Outcome = Rejected(decoded.error_type, decoded.error_message)
            subject, max_attempts = _Subject(decoded.job_name, decoded.job_id, attempt), 1
        else:
            outcome = self._run(decoded, delivery)
            subject = _Subject(decoded.name, decoded.job_id, attempt)
            max_attempts = decoded.spec.max_attempts
        action = decide(
            outcome, attempt=attempt, max_attempts=max_attempts, backoff=self._settings.backoff
        )
        self._settle(delivery, action, subject)

    def _run(self, job: Job, delivery: Delivery) -> Outcome:
        delivery.started_at = time.monotonic()
        ctx = JobContext(
            job=job.name,
            job_id=job.job_id,
            message_id=job.message_id,
            delivery_attempt=job.delivery_attempt,
            publish_time=job.publish_time,
            draining=self.draining,
            config=self._settings.job_config.get(job.name, {}),
            limiters=self._limiters,
            logger=logging.LoggerAdapter(
                logging.getLogger(f"workerpool.job.{job.name}"), {"job_id": job.job_id}
            ),
        )
        with self._lock:
            self._running[id(ctx)] = _Running(job, ctx, delivery)
        try:
            return self._run_chain(job, ctx)
        finally:
            with self._lock:
                self._running.pop(id(ctx), None)

    def _start_handler(self, job: Job, ctx: JobContext) -> Outcome:
        """Innermost step. The lease follows the job's own timeout, however long, and stops
        soon after it; it starts counting here, after any wait for a rate-limit token."""
        with self._lock:
            entry = self._running.get(id(ctx))
        if entry is not None:
            entry.delivery.lease_until = (
                time.monotonic() + job.spec.timeout + self._leaser.extension
            )
        return _invoke(job, ctx)

    def _settle(self, delivery: Delivery, action: Action, subject: _Subject) -> None:
        if not delivery.settle():
            return  # the drain deadline already gave this message back
        error_type = action.error_type if isinstance(action, DeadLetter) else ""
        if isinstance(action, DeadLetter):
            # After settle(): a message the drain already gave back must get no record.
            action = self._record_failure(delivery, action, subject)
        self._leaser.remove(delivery)
        match action:
            case Ack(label):
                if not self._ack(delivery):
                    label = "ack_failed"
            case Nack(delay, label):
                self._acks.modack([delivery.ack_id], 0 if self._settings.server_backoff else delay)
        self._count(label)
        self._notify(delivery, subject, label, error_type if label == "dead_lettered" else "")

    def _ack(self, delivery: Delivery) -> bool:
        confirmation = self._acks.ack(delivery.ack_id, confirm=self._settings.exactly_once)
        if confirmation is None or confirmation.result(timeout=_ACK_CONFIRM_TIMEOUT):
            return True
        # Exactly-once: the message will come back (or went to another worker already); the
        # idempotency store, not this ack, is what stops a second run.
        log.error("ack of message %s was refused by Pub/Sub", delivery.message_id)
        return False

    def _record_failure(self, delivery: Delivery, action: DeadLetter, subject: _Subject) -> Action:
        record = Failure(
            action.error_type, action.error_message, subject.job_name, subject.job_id,
            subject.attempt,
        )  # fmt: skip
        try:
            self._dead_letters.publish(delivery, record)
        except Exception as exc:  # any failure to record means we must not ack
            log.error("failure record for %s not published: %s", subject.job_id, exc)
            return decide(
                RecordFailed(str(exc)),
                attempt=subject.attempt,
                max_attempts=subject.attempt + 1,
                backoff=self._settings.backoff,
            )
        log.warning(
            "job %s (%s) dead-lettered: %s: %s",
            subject.job_name,
            subject.job_id,
            action.error_type,
            action.error_message,
        )
        return Ack("dead_lettered")

    def _count(self, label: str) -> None:
        with self._lock:
            self.stats[label] += 1

    def _notify(self, delivery: Delivery, subject: _Subject, label: str, error_type: str) -> None:
        if not self._listeners:
            return
        started = delivery.started_at
        settled = Settled(
            label, subject.job_name, subject.job_id, delivery.message_id, subject.attempt,
            None if started is None else time.monotonic() - started, error_type,
        )  # fmt: skip
        for listener in self._listeners:
            try:
                listener(settled)
            except Exception:  # telemetry must never break the data path
                log.exception("settle listener %r failed", listener)

    def interrupt_running(self) -> int:
        """At the drain deadline: cancel what still runs and give its messages back now."""
        with self._lock:
            running = list(self._running.values())
        for entry in running:
            entry.ctx.cancelled.set()
            for mw in self._middleware:
                mw.interrupted(entry.job, entry.ctx)
            job = entry.job
            action = decide(
                Interrupted(),
                attempt=job.delivery_attempt,
                max_attempts=job.spec.max_attempts,
                backoff=self._settings.backoff,
            )
            self._settle(
                entry.delivery, action, _Subject(job.name, job.job_id, job.delivery_attempt)
            )
        return len(running)


def _invoke(job: Job, ctx: JobContext) -> Outcome:
    """Call the handler and name what happened; nothing it raises escapes."""
    try:
        result = job.spec.handler(ctx, job.payload)
    except PermanentError as exc:
        return Rejected(exc.error_type, str(exc) or type(exc).__name__, exc)
    except Defer as exc:
        return Deferred(str(exc), exc.delay)
    except RateLimitedError as exc:
        if exc.limiter:
            ctx.throttled(exc.limiter, exc.retry_after)
        return Failed(type(exc).__name__, str(exc), exc)
    except RetryableError as exc:
        return Failed(type(exc).__name__, str(exc), exc)
    except (Exception, SystemExit) as exc:  # a handler's sys.exit() must not end the slot
        ctx.logger.exception("job %s raised %s", job.name, type(exc).__name__)
        return Failed(type(exc).__name__, str(exc), exc)
    if inspect.isawaitable(result) or inspect.isgenerator(result):
        # Registration refuses async and generator functions; a handler can still return a
        # coroutine (a lambda around one, say). Its body never ran: never call that done.
        close = getattr(result, "close", None)
        if close is not None:
            close()  # no "coroutine was never awaited" warning at garbage collection
        return Rejected(
            c.ERR_HANDLER_RETURNED_AWAITABLE,
            f"handler returned {type(result).__name__} instead of running: async handlers "
            "are not supported yet",
        )
    return Succeeded()
