"""What happened to a message, and the one table that turns it into ack, nack or dead-letter.

Every path of the processor ends in an ``Outcome``; ``decide`` is the only place that maps an
outcome to an ``Action``. The branches mirror the table in DESIGN.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workerpool import constants as c
from workerpool.backoff import Backoff


@dataclass(frozen=True)
class Succeeded:
    pass


@dataclass(frozen=True)
class Failed:
    """RetryableError or an unexpected exception."""

    error_type: str
    error_message: str
    # What the handler raised, for the trace (not part of the decision).
    exc: BaseException | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Rejected:
    """PermanentError, or input that can never run (bad JSON, unknown job, ...)."""

    error_type: str
    error_message: str
    exc: BaseException | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class AlreadyDone:
    pass


@dataclass(frozen=True)
class DuplicateOfRunning:
    """Another message carries a job id that a live worker is running."""


@dataclass(frozen=True)
class RedeliveredWhileRunning:
    """This very message came back (its lease lapsed) while its first delivery still runs."""


@dataclass(frozen=True)
class Deferred:
    """The handler asked to run later (``Defer``): not a failure."""

    reason: str
    delay: float | None = None


@dataclass(frozen=True)
class Interrupted:
    """Draining caught the job: its deadline passed while the handler ran, or the pool
    drained while the job still waited for a rate-limit token."""


@dataclass(frozen=True)
class Unavailable:
    """A dependency the decision needs (the idempotency store) could not be reached."""

    reason: str


@dataclass(frozen=True)
class RecordFailed:
    """The failure record could not be published to the dead-letter topic."""

    reason: str


Outcome = (
    Succeeded
    | Failed
    | Rejected
    | AlreadyDone
    | DuplicateOfRunning
    | RedeliveredWhileRunning
    | Deferred
    | Interrupted
    | Unavailable
    | RecordFailed
)


@dataclass(frozen=True)
class Ack:
    label: str


@dataclass(frozen=True)
class Nack:
    delay: float
    label: str


@dataclass(frozen=True)
class DeadLetter:
    """Publish a failure record, then ack."""

    error_type: str
    error_message: str


Action = Ack | Nack | DeadLetter


def decide(outcome: Outcome, *, attempt: int, max_attempts: int, backoff: Backoff) -> Action:
    match outcome:
        case Succeeded():
            # Completion is recorded by the idempotency middleware before we get here.
            return Ack("done")
        case Failed(error_type, error_message) if attempt >= max_attempts:
            # Last attempt: keep the reason, stop redelivering.
            return DeadLetter(
                c.ERR_ATTEMPTS_EXHAUSTED,
                f"{error_type} after {attempt} attempts: {error_message}",
            )
        case Failed():
            # Transient: come back later, spaced by the attempt number, never in a hot loop.
            return Nack(backoff.delay(attempt), "retried")
        case Rejected(error_type, error_message):
            # Retrying cannot help: record why, then ack so it never loops.
            return DeadLetter(error_type, error_message)
        case AlreadyDone():
            # At-least-once delivery: the work is done, drop the copy.
            return Ack("duplicate")
        case DuplicateOfRunning():
            # The holder's own message stays unacked until its job ends, so nothing is lost.
            return Ack("duplicate")
        case RedeliveredWhileRunning():
            # Never ack: the holder may still fail and need this message. Never run a second
            # copy either. Come back later; spaced, since each deferral counts as a delivery.
            return Nack(backoff.delay(attempt + 1), "deferred")
        case Deferred(_, delay):
            # Not a failure, so it never dead-letters by our count; the handler may say when.
            return Nack(backoff.delay(attempt) if delay is None else delay, "deferred")
        case Interrupted():
            # Give it to another worker now; the handler has seen ctx.cancelled.
            return Nack(0.0, "drained")
        case Unavailable() | RecordFailed():
            # We could not record what happened: neither run-and-ack nor drop; retry later.
            return Nack(backoff.delay(attempt), "retried")
    raise AssertionError(f"unhandled outcome {outcome!r}")
