"""What happened to a message, and the one table that turns it into ack, nack or dead-letter.

Every path ends in an ``Outcome``: a run's own end, a message that never ran (bad input, given
back unstarted), a run handed back while it still ran (drain deadline, lost claim), a failure
record that could not be published. ``decide`` is the only place that maps an outcome and the
``Facts`` around it to an ``Action``; its branches mirror the decide table of the design page
(docs/design.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workerpool import constants as c
from workerpool.constants import Label
from workerpool.worker.backoff import Backoff


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
class CopyForAnother:
    """A copy of a message made on its last delivery for another subscription of the topic
    (``worker.renewal``): this one had the message itself."""


@dataclass(frozen=True)
class DuplicateOfRunning:
    """Another message carries a job id that a live worker is running."""


@dataclass(frozen=True)
class RedeliveredWhileRunning:
    """This very message came back (its lease lapsed) while its first delivery still runs.
    ``lapses_in``: seconds until that delivery's claim lapses, where another process holds it
    and seems to have stopped renewing it (None: it runs here, or its holder renews it)."""

    lapses_in: float | None = None


@dataclass(frozen=True)
class Deferred:
    """The handler asked to run later (``Defer``): not a failure."""

    reason: str
    delay: float | None = None


@dataclass(frozen=True)
class Scheduled:
    """Not due yet (``not_before``): the message is in the schedule, which publishes it again
    when it is due."""

    not_before: str


@dataclass(frozen=True)
class Cancelled:
    """The job id was cancelled (``workerpool cancel``): not started, or stopped while it ran."""

    reason: str = ""


@dataclass(frozen=True)
class Interrupted:
    """Draining caught the job: its deadline passed while the handler ran, or the pool
    drained while the job still waited for a rate-limit token."""


# A message whose run lost a lease comes back this long after the lease lapsed.
LAPSED_COME_BACK = 1.0


@dataclass(frozen=True)
class LostLease:
    """A lease the run holds (its idempotency claim, a concurrency slot) could not be renewed:
    the run was cancelled and handed back before the lease could lapse; the message returns
    once it has (``after`` seconds)."""

    after: float


@dataclass(frozen=True)
class NotStarted:
    """Held but never started: beyond the bound, or still waiting when the pool drained."""


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
    | CopyForAnother
    | DuplicateOfRunning
    | RedeliveredWhileRunning
    | Deferred
    | Scheduled
    | Cancelled
    | Interrupted
    | LostLease
    | NotStarted
    | Unavailable
    | RecordFailed
)


# Not frozen: one is made per message, and a frozen dataclass's __init__ costs more than three
# times as much (0.85 against 0.25 us for six fields, measured). Nothing changes it once made.
@dataclass(slots=True)
class Facts:
    """What the decision needs besides the outcome."""

    attempt: int
    max_attempts: int
    backoff: Backoff
    # The subscription has a retry policy: Pub/Sub spaces redeliveries after a plain nack.
    # On the emulator, delaying with modify_ack_deadline(d) on such a subscription lost
    # messages for minutes (a batch of 2 or 6, per-message calls too), so every nack is 0 there.
    retry_policy: bool = False
    # This delivery is the last the subscription's dead-letter policy allows: if the message
    # comes back once more, Pub/Sub forwards it, raw, to the dead-letter topic, its job not run.
    last_delivery: bool = False
    # ``attempt`` counts the job id's tries in the idempotency store, not this message's
    # deliveries, so a fresh copy of the message carries the count on.
    tries_outlive_message: bool = False


@dataclass(frozen=True)
class Ack:
    label: Label


@dataclass(frozen=True)
class Nack:
    delay: float
    label: Label


@dataclass(frozen=True)
class DeadLetter:
    """Publish a failure record, then ack; if the record is not published, ``decide`` is
    asked again with ``RecordFailed``."""

    error_type: str
    error_message: str


@dataclass(frozen=True)
class Renew:
    """Publish a fresh copy of the message (job id and all, not run for ``after`` seconds),
    then ack this one: the subscription's dead-letter policy would take it if it came back.
    If the copy is not published, ``otherwise`` (the policy's forward is then the backstop)."""

    after: float
    otherwise: Nack


Action = Ack | Nack | DeadLetter | Renew
# What most messages end with, made once: a frozen dataclass costs 0.4-1 us to make (measured),
# and these never change.
SUCCEEDED = Succeeded()
_ACK_DONE = Ack(Label.DONE)
# How long after a claim's lapse, by the claim's clock, a message waiting for it comes back:
# the holder's clock and ours may differ by a little, and Pub/Sub takes whole seconds.
_PAST_A_LAPSE = 1.0


# One branch per row of the design page's decide table (docs/design.md), side by side on
# purpose: not split up.
def decide(outcome: Outcome, facts: Facts) -> Action:  # noqa: C901
    match outcome:
        case Succeeded():
            # Completion is recorded by the idempotency middleware before we get here.
            return _ACK_DONE
        case Failed(error_type, error_message) if facts.attempt >= facts.max_attempts:
            # Last attempt: keep the reason, stop redelivering.
            return DeadLetter(
                c.ERR_ATTEMPTS_EXHAUSTED,
                f"{error_type} after {facts.attempt} attempts: {error_message}",
            )
        case Failed(error_type, error_message) if facts.last_delivery and not (
            facts.tries_outlive_message
        ):
            # Pub/Sub would forward it raw, and a copy would count its tries from 1 again.
            return DeadLetter(
                c.ERR_DELIVERY_LIMIT,
                f"{error_type} at delivery {facts.attempt}, the last the subscription's "
                f"dead-letter policy allows: {error_message}",
            )
        case Failed():
            # Transient: come back later, spaced by the attempt number, never in a hot loop.
            return _later(facts.backoff.delay(facts.attempt), Label.RETRIED, facts)
        case Rejected(error_type, error_message):
            # Retrying cannot help: record why, then ack so it never loops.
            return DeadLetter(error_type, error_message)
        case AlreadyDone() | DuplicateOfRunning() | CopyForAnother():
            # At-least-once delivery: the work is done, drop the copy. Or it runs elsewhere,
            # and the holder's own message (or its copy) stays unacked until its job ends:
            # nothing is lost. Or the copy was made for another subscription.
            return Ack(Label.DUPLICATE)
        case RedeliveredWhileRunning(lapses_in):
            # Never ack: the holder may still fail and need this message. Never run a second
            # copy either. Come back later; spaced, since each deferral counts as a delivery,
            # but no later than just after the claim of a holder that stopped renewing it
            # lapses: one that was killed, whose job runs then, not a backoff step after.
            wait = facts.backoff.delay(facts.attempt + 1)
            if lapses_in is not None:
                wait = min(wait, max(facts.backoff.minimum, lapses_in + _PAST_A_LAPSE))
            return _later(wait, Label.DEFERRED, facts)
        case Deferred(_, delay):
            # Not a failure, so it never dead-letters by our count; the handler may say when.
            wait = facts.backoff.delay(facts.attempt) if delay is None else delay
            return _later(wait, Label.DEFERRED, facts)
        case Scheduled():
            # The schedule holds it now and publishes it again when due, job id and all.
            return Ack(Label.SCHEDULED)
        case Cancelled():
            # Cancelled from outside: its job id is done with (a run's is recorded as done,
            # a cancel is kept as long as completions are), so the message goes, no record.
            return Ack(Label.CANCELLED)
        case Interrupted():
            # Give it to another worker now; the handler has seen ctx.cancelled.
            return _later(0.0, Label.DRAINED, facts)
        case LostLease(after):
            # Not a failure: come back once the lease has lapsed, so nobody runs it meanwhile.
            # (With a retry policy the nack is 0 as every nack there is, and the policy spaces
            # it; back before the claim lapsed, it is deferred once more.)
            return _later(after, Label.DEFERRED, facts)
        case NotStarted():
            # Another worker can start it now.
            return _later(0.0, Label.RELEASED, facts)
        case Unavailable() | RecordFailed():
            # We could not record what happened: neither run-and-ack nor drop; retry later.
            return _later(facts.backoff.delay(facts.attempt), Label.RETRIED, facts)
    raise AssertionError(f"unhandled outcome {outcome!r}")


def _later(delay: float, label: Label, facts: Facts) -> Nack | Renew:
    """Give the message back, to come again in ``delay`` seconds. Waiting is not failing,
    but Pub/Sub counts each delivery: on the last one a copy comes back instead."""
    nack = Nack(0.0 if facts.retry_policy else delay, label)
    return Renew(delay, nack) if facts.last_delivery else nack
