"""The idempotency middleware: claim a job id before running it, complete or release after.

Claims are short (``ttl``) and kept alive by a ``LeaseKeeper``, so a claim whose owner died
expires soon and another worker takes over, and a run whose claim cannot be renewed is handed
back before the claim can lapse: two workers never run one job id at once, but for a process
paused past its claim, whose run then neither records nor acks its job (``Run.lost_lease``);
``ctx.fencing_token`` lets what the job writes refuse it. A job that fails, or is interrupted
by the drain deadline, has its claim released, so the next delivery can start it at once.

A job costs the store a share of two transactions, not two calls of its own: the job ids of a
pull are claimed together as the pool admits it (the keeper renews those claims while the
messages wait, and one whose message leaves without running is released), and completions
are recorded in batches off the slot threads (``Completions``; a batch child's slot waits
for its own); a message is acked only once its completion is recorded, and its job id counts
as running here until then, its claim held even if its message is handed back meanwhile. A
message that has no claim from its admission (the batch claim failed, or another delivery of
it held one) claims on its own when it starts.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from workerpool import constants as c
from workerpool.idempotency.base import (
    Claimed,
    ClaimResult,
    Done,
    HeldElsewhere,
    IdempotencyStore,
    StoreError,
)
from workerpool.idempotency.completions import Completions
from workerpool.worker.delivery import Delivery
from workerpool.worker.envelope import Job, first_message_id, job_id_of
from workerpool.worker.keeper import Held, LeaseKeeper
from workerpool.worker.middleware import Ended, Middleware
from workerpool.worker.outcome import (
    AlreadyDone,
    Cancelled,
    DuplicateOfRunning,
    Failed,
    Interrupted,
    Outcome,
    RedeliveredWhileRunning,
    Rejected,
    Succeeded,
    Unavailable,
)
from workerpool.worker.run import Recording, Run, Settled
from workerpool.worker.timers import Timers
from workerpool.worker.together import together

log = logging.getLogger(__name__)

_Key = tuple[str, str]  # (job_id, message_id): the first message's id, for a copy


# Not frozen, made once a job: see completions._Completion.
@dataclass(slots=True)
class _Admitted:
    """What claiming a message's job id found as the pool admitted it."""

    ack_id: str  # of the delivery it was taken for
    result: ClaimResult
    sent: float  # monotonic: when the claim was asked for
    held: Held[_Key] | None  # the claim, kept alive while the message waits (Claimed only)
    answered: float  # monotonic: when the store's answer came (a grant was made before it)


class Idempotency(Middleware):
    def __init__(
        self,
        store: IdempotencyStore,
        owner: str,
        timers: Timers,
        *,
        ttl: float = c.DEFAULT_CLAIM_TTL,
        complete_patience: float = 60.0,
        write_batch: int = 1,
    ) -> None:
        """``write_batch``: completions worth one write; the first of fewer waits a few
        milliseconds for more (``Completions``; 1: never)."""
        self._store = store
        self._owner = owner
        self.keeper: LeaseKeeper[_Key] = LeaseKeeper(
            "claim",
            timers,
            ttl,
            renew=lambda keys: store.renew_many(keys, owner, ttl),
            release=lambda keys: store.release_many(keys, owner),
            close_store=store.close,
        )
        self._completions: Completions[Held[_Key]] = Completions(
            store, owner, patience=complete_patience, let_go=self._recorded,
            lapsed=self.keeper.lapsed, enough=write_batch,
        )  # fmt: skip
        # Being processed here, claimed or not yet, until its completion is recorded.
        self._active: set[_Key] = set()
        self._admitted: dict[_Key, _Admitted] = {}  # claimed at admission, not started yet
        # The claim each run holds, from its ``before`` to its ``after``. (A dict's set and pop
        # are atomic: runs on any thread, no lock.) Not a generator's ``around``: that was
        # 1.5 us more a run, measured.
        self._claims: dict[Run, Held[_Key]] = {}
        self._lock = threading.Lock()

    def start(self) -> None:
        self.keeper.start()
        self._completions.start()

    @property
    def healthy(self) -> bool:
        return self.keeper.healthy

    # --- admission ---------------------------------------------------------------------------

    def admitted(self, deliveries: Sequence[Delivery]) -> None:
        fresh: dict[_Key, Delivery] = {}
        with self._lock:
            for delivery in deliveries:
                key = (
                    job_id_of(delivery),
                    first_message_id(delivery.attributes, delivery.message_id),
                )
                if key not in self._active and key not in self._admitted:
                    fresh.setdefault(key, delivery)
        if not fresh:
            return
        sent = time.monotonic()
        try:
            results = self._store.claim_many(list(fresh), self._owner, self.keeper.ttl)
        except StoreError as exc:
            log.warning("%d admitted job ids not claimed (%s); each tries when it starts",
                        len(fresh), exc)  # fmt: skip
            return
        answered = time.monotonic()
        given_back: list[_Key] = []
        claimed: list[tuple[_Key, Delivery, ClaimResult]] = []
        with self._lock:
            for (key, delivery), result in zip(fresh.items(), results, strict=True):
                if key in self._active:
                    continue  # another delivery of it started meanwhile, with a claim of its own
                if not isinstance(result, Claimed):
                    self._admitted[key] = _Admitted(delivery.ack_id, result, sent, None, answered)
                elif delivery.settled:  # given back meanwhile (a drain): settled() missed it
                    given_back.append(key)
                else:
                    claimed.append((key, delivery, result))
            held = self.keeper.hold_many([key for key, _, _ in claimed], sent)
            for (key, delivery, result), lease in zip(claimed, held, strict=True):
                self._admitted[key] = _Admitted(delivery.ack_id, result, sent, lease, answered)
        if given_back:
            self.keeper.release_soon(given_back)

    def settled(self, event: Settled) -> None:
        together(self._settled_many, event)

    def _settled_many(self, events: list[Settled]) -> None:
        """Those that never ran let their claims taken at admission go."""
        dropped = []
        with self._lock:
            for event in events:
                key = (event.job_id, first_message_id(event.attributes, event.message_id))
                admitted = self._admitted.get(key)
                if admitted is None or admitted.ack_id != event.ack_id:
                    continue  # it ran (its run took the claim), or never had one
                del self._admitted[key]
                if admitted.held is not None:
                    dropped.append(admitted.held)
        for held in dropped:
            self.keeper.drop(held)  # left without running: another may have it now

    # --- the run -----------------------------------------------------------------------------

    def before(self, run: Run) -> Outcome | None:
        key = _key(run.job)
        with self._lock:
            if key in self._active:
                return RedeliveredWhileRunning()  # its first delivery runs right here
            self._active.add(key)
            admitted = self._admitted.pop(key, None)
        try:
            held = self._claimed(run, key, admitted)
        except BaseException:
            self._idle(key)
            raise
        if not isinstance(held, Held):
            self._idle(key)
            return held  # what ended the run before its handler began
        self._claims[run] = held
        return None

    def after(self, run: Run, ended: Ended) -> Ended:
        held = self._claims.pop(run)
        if isinstance(ended, Succeeded | Cancelled):
            # The side effect happened, or the job was cancelled (it must not run again
            # either): record it, off this thread, before the ack. The claim stays held, and
            # the job id busy here, until then.
            run.completion = self._completion(run, held.key, held)
            return ended
        try:
            self.keeper.let_go(held)
            if not isinstance(ended, BaseException):  # (a middleware's bug: left to expire)
                # A failure is counted with the job id, so deferrals and hand-backs, which
                # Pub/Sub counts as deliveries too, never use up its max_attempts. A run that
                # ends after its message was handed back (the drain deadline, a lost claim)
                # did not fail.
                failed = isinstance(ended, Failed) and not run.delivery.settled
                self._release(held.key, failed=failed)
                if isinstance(ended, Failed | Rejected) and not run.delivery.settled:
                    self._count_failed()  # retried or dead-lettered: a failed run, by minute
        finally:
            self._idle(held.key)
        return ended

    def _idle(self, key: _Key) -> None:
        """No run here holds ``key`` any more: another delivery of it may start."""
        with self._lock:
            self._active.discard(key)

    def _claimed(self, run: Run, key: _Key, admitted: _Admitted | None) -> Held[_Key] | Outcome:
        """The claim the run holds from now on, or the outcome that ends it before it begins."""
        try:
            claim, held, sent = self._claim(run, key, admitted)
        except StoreError as exc:
            return Unavailable(f"idempotency store: {exc}")
        match claim:
            case Done():
                return AlreadyDone()
            case HeldElsewhere(message_id=holder) if holder == key[1]:
                # This very message (or a copy of it) came back while its first delivery
                # still runs somewhere, or its claim is still being let go.
                return RedeliveredWhileRunning(self._lapsing(claim))
            case HeldElsewhere():
                return DuplicateOfRunning()
            case Claimed(failures=failures, token=token):
                run.failures = failures
                run.ctx.fencing_token = token
            case None:
                pass
        # Once the claim is granted, at the latest: the one taken with the pull was answered
        # before anything read with the pull began (``Checkpoints.admitted``).
        run.claimed_at = admitted.answered if held is not None and admitted else time.monotonic()
        if held is None:
            held = self.keeper.hold(run, key, sent)
        if run.delivery.settled:
            # Handed back (the drain deadline) while the claim was being made: never start
            # it, and do not leave the claim to hold the job id until it expires.
            self.keeper.let_go(held)
            self._release(key)
            return Interrupted()
        return held

    def _claim(
        self, run: Run, key: _Key, admitted: _Admitted | None
    ) -> tuple[ClaimResult | None, Held[_Key] | None, float]:
        """The run's claim (None: taken back, see below), the claim's lease if the run adopted
        the one its message's admission took, and when the claim was asked for."""
        if admitted and admitted.held and self.keeper.adopt(admitted.held, run):
            return admitted.result, admitted.held, admitted.sent
        sent = time.monotonic()
        claim: ClaimResult | None
        if admitted is not None and isinstance(admitted.result, Done):
            claim = admitted.result  # done when admitted: done for good
        else:  # none taken; dropped while the message waited (not renewed, taken over); or
            # held elsewhere then, and since lapsed, renewed or let go
            claim = self._store.claim(key[0], self._owner, key[1], self.keeper.ttl)
        if self._is_own_stale_claim(claim, key):
            assert isinstance(claim, HeldElsewhere)
            run.ctx.fencing_token = claim.token  # granted to us: its reply was lost
            claim = None  # taken back: its count of failures is not known
        return claim, None, sent

    def _lapsing(self, claim: HeldElsewhere) -> float | None:
        """Seconds until ``claim`` lapses, if its holder seems to have stopped renewing it;
        else None. A live holder renews it every ``ttl / 3`` (the fleet's ttl, as ours): with
        less than half of it left, a renewal is late by a sixth of it, and its holder died or
        is about to give its run back. (A live one's message is spaced by the backoff.)"""
        left = self._store.lapses_in(claim)
        return left if left < self.keeper.ttl / 2 else None

    def _is_own_stale_claim(self, claim: ClaimResult, key: _Key) -> bool:
        """A claim of ours on this very message that no run here holds (``run`` checked):
        left by a claim whose reply was lost in an outage. Taking it back beats its TTL;
        not while its release is on the way, which would release it from under the run (a
        message given back, then a copy or redelivery of it here: it waits instead)."""
        return (
            isinstance(claim, HeldElsewhere)
            and claim.owner == self._owner
            and claim.message_id == key[1]
            and not self.keeper.releasing(key)
            and self._store.renew(key[0], self._owner, key[1], self.keeper.ttl)
        )

    def _completion(self, run: Run, key: _Key, held: Held[_Key]) -> Recording:
        delivery = run.delivery
        return functools.partial(
            self._completions.add, key[0], key[1], lambda: delivery.settled, held
        )

    def _recorded(self, held: list[Held[_Key]]) -> None:
        """Completions answered: renewed, and busy here, until now (nobody may start their job
        ids meanwhile), no longer."""
        try:
            self.keeper.let_go_many(held)
        finally:  # (a bug there must not keep the job ids busy here for good)
            with self._lock:
                for lease in held:
                    self._active.discard(lease.key)

    def _count_failed(self) -> None:
        try:
            self._store.count_failed()
        except StoreError as exc:
            log.warning("a failed run not counted by the minute (%s)", exc)

    def _release(self, key: _Key, *, failed: bool = False) -> None:
        try:
            self._store.release(key[0], self._owner, key[1], failed=failed)
        except StoreError as exc:
            log.warning("claim on %s not released (%s); it expires on its own", key[0], exc)

        # --- interrupted runs and stopping ---------------------------------------------------

    def interrupted(self, run: Run) -> None:
        if run.handler_returned:
            # On its way out of the chain: ``after`` records the job done, the claim held
            # until the record is written (a slot may wait for it: a batch child, an
            # exactly-once ack), or releases the claim itself. A release now would let
            # another worker run a job that succeeded here before its record lands.
            return
        self.keeper.interrupted(_key(run.job))

    def close(self, timeout: float) -> None:
        """Record the completions queued, release the interrupted runs' claims and close the
        store, within ``timeout``; what does not make it is left to expire."""
        deadline = time.monotonic() + timeout
        self._completions.close(timeout)
        self.keeper.close(max(0.0, deadline - time.monotonic()))


def _key(job: Job) -> _Key:
    """A claim's job id and message: every copy of a message claims as its first."""
    return job.job_id, first_message_id(job.attributes, job.message_id)
