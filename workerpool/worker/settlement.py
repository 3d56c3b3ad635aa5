"""Carrying out what ``decide`` chose for a message, once: the ack or nack sent, a failure
record or a fresh copy published first where the decision asks for one, its label counted and
told to every middleware that listens (``Middleware.settled``).

``settle`` is the way out for one message whose run ended (or that never could start);
``nack_now`` for messages given back together (unstarted at a drain, or interrupted).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from workerpool import constants as c
from workerpool.constants import Label
from workerpool.worker.backoff import Backoff
from workerpool.worker.counts import Counts
from workerpool.worker.delivery import Delivery
from workerpool.worker.envelope import Job, job_id_of
from workerpool.worker.failures import Failure
from workerpool.worker.interfaces import Acks, FailureRecords, Leases
from workerpool.worker.middleware import Middleware
from workerpool.worker.outcome import (
    Ack,
    DeadLetter,
    Facts,
    Nack,
    Outcome,
    RecordFailed,
    Renew,
    Succeeded,
    decide,
)
from workerpool.worker.renewal import Renewer
from workerpool.worker.run import Run, Settled

log = logging.getLogger(__name__)

# How long a worker thread waits to learn whether an exactly-once ack took.
_ACK_CONFIRM_TIMEOUT = 60.0
_DEAD_LETTERED = Ack(Label.DEAD_LETTERED)


# Not frozen, as ``Facts``: one or two are made per message.
@dataclass(slots=True)
class Subject:
    """What a failure record, the logs and the decision say a message was."""

    job_name: str
    job_id: str
    attempt: int  # Pub/Sub's delivery attempt
    max_attempts: int = 1
    # This run's number among the job id's tries: its earlier failures + 1 where the
    # idempotency store counts them, else the delivery attempt (deferrals included).
    tries: int = 0
    tries_by_job: bool = False  # the store counts them: a copy of the message goes on from them

    @classmethod
    def of(cls, job: Job, run: Run | None = None) -> Subject:
        failures = None if run is None else run.failures
        tries = job.delivery_attempt if failures is None else failures + 1
        return cls(
            job.name, job.job_id, job.delivery_attempt, job.spec.max_attempts, tries,
            tries_by_job=failures is not None,
        )  # fmt: skip

    @classmethod
    def unstarted(cls, delivery: Delivery) -> Subject:
        """What a message that never started says it is (it may name any job, or none)."""
        attempt = delivery.delivery_attempt or 0
        return cls(delivery.attributes.get(c.ATTR_JOB, ""), job_id_of(delivery), attempt)


class Settlement:
    def __init__(
        self,
        acks: Acks,
        leases: Leases,
        records: FailureRecords,
        middleware: Sequence[Middleware],
        renewer: Renewer | None,
        *,
        backoff: Backoff,
        retry_policy: bool,
        exactly_once: bool,
        ordered: bool = False,
    ) -> None:
        """``renewer`` publishes a fresh copy of a message that must wait on the last delivery
        the subscription allows (None: it is nacked); ``retry_policy``: the subscription
        spaces redeliveries itself; ``exactly_once``: an ack can be refused, so its result is
        waited for; ``ordered``: the subscription delivers each ordering key in order."""
        self._acks = acks
        self._leases = leases
        self._records = records
        self._renewer = renewer
        self._backoff = backoff
        self._retry_policy = retry_policy
        self._exactly_once = exactly_once
        self._ordered = ordered
        # Those that hear how each message left: a call a message each, only where it is heard.
        self._hear_settled = [mw for mw in middleware if type(mw).settled is not Middleware.settled]
        self._before_records = [
            mw for mw in middleware if type(mw).dead_lettering is not Middleware.dead_lettering
        ]
        self._after_records = [
            mw for mw in middleware if type(mw).dead_lettered is not Middleware.dead_lettered
        ]
        self._counts: Counts[str] = Counts()
        self._unread = Facts(1, 1, backoff)  # what the decision of a success never reads

    def settle(
        self, delivery: Delivery, outcome: Outcome, subject: Subject, run: Run | None = None
    ) -> None:
        # A success is acked whatever the facts: they are made only for the other outcomes.
        facts = self._unread if isinstance(outcome, Succeeded) else self._facts(subject)
        action = decide(outcome, facts)
        error_type = ""
        renewed = False
        if isinstance(action, DeadLetter | Renew):
            # The lease stays extended while a record or a copy is published (SETTLING), and
            # a hand-back that came first means nothing is published.
            if not delivery.begin_settle():
                return
            if isinstance(action, DeadLetter):
                error_type = action.error_type
                action = self._record(delivery, action, subject, facts, run)
            if isinstance(action, Renew):  # also a record not published on the last delivery
                action = self._renewed([(delivery, action)])[0]
                renewed = isinstance(action, Ack)
            if action == _DEAD_LETTERED and delivery.recorded():
                self._dead_lettered(delivery, subject)
            if not delivery.finish_settle():
                return  # the end of a drain gave it back meanwhile
        elif not delivery.take():
            return  # a hand-back (drain deadline, lost claim) settled it already
        label = self._send(delivery, action)
        if label is not Label.DEAD_LETTERED:
            error_type = ""
        self._finish(
            Settled(label, subject.job_name, subject.job_id, delivery.message_id,
                    subject.attempt, run, error_type, attributes=delivery.attributes,
                    ack_id=delivery.ack_id, renewed=renewed)
        )  # fmt: skip

    def _facts(self, subject: Subject, *, renewable: bool = True) -> Facts:
        """``renewable``: a copy may be published now (not at the end of a drain)."""
        renewer = self._renewer
        return Facts(
            subject.tries or subject.attempt, subject.max_attempts, self._backoff,
            self._retry_policy,
            last_delivery=renewable and renewer is not None and renewer.last(subject.attempt),
            tries_outlive_message=subject.tries_by_job,
        )  # fmt: skip

    def _renewed(self, renewals: Sequence[tuple[Delivery, Renew]]) -> list[Ack | Nack]:
        """Each message's action once its copy is published (an ack) or not (its nack)."""
        assert self._renewer is not None, "only a renewer says a delivery is the last"
        published = self._renewer.renew([(delivery, r.after) for delivery, r in renewals])
        return [
            Ack(r.otherwise.label) if ok else r.otherwise
            for (_, r), ok in zip(renewals, published, strict=True)
        ]

    def _record(
        self, delivery: Delivery, action: DeadLetter, subject: Subject, facts: Facts,
        run: Run | None,
    ) -> Ack | Nack | Renew:  # fmt: skip
        record = Failure(
            action.error_type, action.error_message, subject.job_name, subject.job_id,
            subject.attempt,
        )  # fmt: skip
        try:
            for mw in self._before_records:
                mw.dead_lettering(delivery, run, action.error_type)
            self._records.publish(delivery, record)
        except Exception as exc:  # any failure to record means we must not ack
            log.error("failure record for %s not published: %s", subject.job_id, exc)
            retry = decide(RecordFailed(str(exc)), facts)
            assert not isinstance(retry, DeadLetter)
            return retry
        log.warning(
            "job %s (%s) dead-lettered: %s: %s",
            subject.job_name,
            subject.job_id,
            action.error_type,
            action.error_message,
        )
        return _DEAD_LETTERED

    def _dead_lettered(self, delivery: Delivery, subject: Subject) -> None:
        """Its record is out and its ack is this thread's to send, next: nothing else can take
        it any more (RECORDED: still leased), so those that hear of it never hear of a message
        given back."""
        for mw in self._after_records:
            try:
                mw.dead_lettered(delivery, subject.job_id)
            except Exception:
                log.exception("%s.dead_lettered failed", type(mw).__name__)

    def _send(self, delivery: Delivery, action: Ack | Nack) -> Label:
        """Queue the message's ack or nack, then let its lease go: a drain that sees no lease
        held left has every ack queued before it flushes them (let go first, a message taken
        but not acked yet looked settled, and the drain could close the acks before it came)."""
        try:
            confirmation = self._queue(delivery, action)
        finally:  # also when queuing failed (a bug): nothing else would let it go
            self._leases.remove(delivery)
        if isinstance(action, Nack) or self._confirmed(delivery, confirmation):
            return action.label
        return Label.ACK_FAILED

    def _queue(self, delivery: Delivery, action: Ack | Nack) -> Future[bool] | None:
        """Queue the ack or nack; for an ack whose answer is awaited, its future."""
        if isinstance(action, Ack):
            return self._acks.ack(delivery.ack_id, confirm=self._exactly_once)
        delivery.returned = True
        self._acks.modack([delivery.ack_id], self._give_back_after(delivery, action.delay))
        return None

    def _give_back_after(self, delivery: Delivery, delay: float) -> float:
        """A keyed message of an ordered subscription is not nacked but let lapse (at once
        would put it behind its key's later messages on the emulator; see ``ordering``)."""
        if self._ordered and delivery.ordering_key:
            return max(delay, c.ORDERED_GIVE_BACK_SECONDS)
        return delay

    def _confirmed(self, delivery: Delivery, confirmation: Future[bool] | None) -> bool:
        if confirmation is None:
            return True
        # Exactly-once: a refused or unanswered ack means the message comes back (or went to
        # another worker already); the idempotency store, not this ack, stops a second run.
        try:
            took = confirmation.result(timeout=_ACK_CONFIRM_TIMEOUT)
        except TimeoutError:
            log.error("ack of message %s was not confirmed in time", delivery.message_id)
            return False
        if not took:
            log.error("ack of message %s was refused by Pub/Sub", delivery.message_id)
        return took

    @property
    def stats(self) -> Counts[str]:
        """How many messages left under each label (``constants.Label``), live."""
        return self._counts

    def _finish(self, event: Settled) -> None:
        self._counts.add(event.label)
        for mw in self._hear_settled:
            try:
                mw.settled(event)
            except Exception:  # telemetry must never break the data path
                log.exception("%s.settled failed", type(mw).__name__)

    def nack_now(
        self,
        taken: Sequence[tuple[Delivery, Subject, Run | None]],
        outcome: Outcome,
        renewable: bool = True,
    ) -> None:
        """Settle messages already taken with ``outcome``, one request per delay for all (and,
        if ``renewable``, their copies published together, for those on their last delivery)."""
        try:
            labels = self._nack_taken(taken, outcome, renewable)
        finally:  # once each one's ack or nack is queued, as ``_send``; or queuing failed
            for delivery, _, _ in taken:
                self._leases.remove(delivery)
        for (delivery, subject, run), (label, renewed) in zip(taken, labels, strict=True):
            self._finish(
                Settled(label, subject.job_name, subject.job_id, delivery.message_id,
                        subject.attempt, run, attributes=delivery.attributes,
                        ack_id=delivery.ack_id, renewed=renewed)
            )  # fmt: skip

    def _nack_taken(
        self,
        taken: Sequence[tuple[Delivery, Subject, Run | None]],
        outcome: Outcome,
        renewable: bool,
    ) -> list[tuple[Label, bool]]:
        """Queue the nacks (or, for a copy published, the acks) of ``nack_now``; each one's
        label, and whether it was renewed."""
        decided = [
            decide(outcome, self._facts(subject, renewable=renewable)) for _, subject, _ in taken
        ]
        renewals = [
            (delivery, action)
            for (delivery, _, _), action in zip(taken, decided, strict=True)
            if isinstance(action, Renew)
        ]
        copied = iter(self._renewed(renewals) if renewals else ())
        by_delay: dict[float, list[str]] = defaultdict(list)
        labels = []
        for (delivery, _, _), decision in zip(taken, decided, strict=True):
            action = next(copied) if isinstance(decision, Renew) else decision
            match action:
                case Ack(label):
                    self._acks.ack(delivery.ack_id)  # its copy is out: a lost ack, a duplicate
                case Nack(delay, label):
                    delivery.returned = True
                    by_delay[self._give_back_after(delivery, delay)].append(delivery.ack_id)
                case _:
                    raise AssertionError(f"{outcome!r} must give the message back")
            labels.append((label, isinstance(decision, Renew) and isinstance(action, Ack)))
        for delay, ack_ids in by_delay.items():
            self._acks.modack(ack_ids, delay)
        return labels
