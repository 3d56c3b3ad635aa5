"""The idempotency middleware: claim a job id before running it, complete or release after.

Claims are short (``ttl``) and kept alive by a ``LeaseKeeper``, so a claim whose owner died
expires soon and another worker takes over, and a run whose claim cannot be renewed is handed
back before the claim can lapse: two workers never run one job id at once. A job that fails,
or is interrupted by the drain deadline, has its claim released, so the next delivery can
start it at once.
"""

from __future__ import annotations

import logging
import threading
import time

from workerpool import constants as c
from workerpool.idempotency.base import (
    Claimed,
    ClaimResult,
    Done,
    HeldElsewhere,
    IdempotencyStore,
    StoreError,
    StoreUnavailable,
)
from workerpool.worker.envelope import Job
from workerpool.worker.keeper import LeaseKeeper
from workerpool.worker.middleware import Middleware, Next
from workerpool.worker.outcome import (
    AlreadyDone,
    DuplicateOfRunning,
    Failed,
    Interrupted,
    Outcome,
    RedeliveredWhileRunning,
    Succeeded,
    Unavailable,
)
from workerpool.worker.run import Run
from workerpool.worker.timers import Timers

log = logging.getLogger(__name__)

_Key = tuple[str, str]  # (job_id, message_id)


class Idempotency(Middleware):
    def __init__(
        self,
        store: IdempotencyStore,
        owner: str,
        timers: Timers,
        *,
        ttl: float = c.DEFAULT_CLAIM_TTL,
        complete_patience: float = 60.0,
    ) -> None:
        self._store = store
        self._owner = owner
        self._complete_patience = complete_patience
        self.keeper: LeaseKeeper[_Key] = LeaseKeeper(
            "claim",
            timers,
            ttl,
            renew=lambda keys: store.renew_many(keys, owner, ttl),
            release=lambda keys: store.release_many(keys, owner),
            close_store=store.close,
        )
        self._active: set[_Key] = set()  # being processed here, claimed or not yet
        self._lock = threading.Lock()

    def start(self) -> None:
        self.keeper.start()

    @property
    def healthy(self) -> bool:
        return self.keeper.healthy

    # --- the run -----------------------------------------------------------------------------

    def run(self, run: Run, call_next: Next) -> Outcome:
        job = run.job
        key = (job.job_id, job.message_id)
        with self._lock:
            if key in self._active:
                return RedeliveredWhileRunning()  # its first delivery runs right here
            self._active.add(key)
        try:
            return self._run_claimed(run, call_next, key)
        finally:
            with self._lock:
                self._active.discard(key)

    def _run_claimed(self, run: Run, call_next: Next, key: _Key) -> Outcome:
        job = run.job
        sent = time.monotonic()
        claim: ClaimResult | None
        try:
            claim = self._store.claim(job.job_id, self._owner, job.message_id, self.keeper.ttl)
            if self._is_own_stale_claim(claim, job):
                claim = None  # taken back: its count of failures is not known
        except StoreError as exc:
            return Unavailable(f"idempotency store: {exc}")
        match claim:
            case Done():
                return AlreadyDone()
            case HeldElsewhere(message_id=holder) if holder == job.message_id:
                # This very message came back while its first delivery still runs somewhere.
                return RedeliveredWhileRunning()
            case HeldElsewhere():
                return DuplicateOfRunning()
            case Claimed(failures=failures):
                run.failures = failures
            case None:
                pass
        if run.delivery.settled:
            # Handed back (the drain deadline) while the claim was being made: never start
            # it, and do not leave the claim to hold the job id until it expires.
            self._release(job)
            return Interrupted()
        held = self.keeper.hold(run, key, sent)
        try:
            outcome = call_next(run)
            if isinstance(outcome, Succeeded):
                return self._complete(run)
            # A failure is counted with the job id, so deferrals and hand-backs, which Pub/Sub
            # counts as deliveries too, never use up its max_attempts. A run that ends after
            # its message was handed back (the drain deadline, a lost claim) did not fail.
            failed = isinstance(outcome, Failed) and not run.delivery.settled
            self._release(job, failed=failed)
            return outcome
        finally:
            self.keeper.let_go(held)

    def _is_own_stale_claim(self, claim: ClaimResult, job: Job) -> bool:
        """A claim of ours on this very message that no run here holds (``run`` checked):
        left by a claim whose reply was lost in an outage. Taking it back beats its TTL."""
        return (
            isinstance(claim, HeldElsewhere)
            and claim.owner == self._owner
            and claim.message_id == job.message_id
            and self._store.renew(job.job_id, self._owner, job.message_id, self.keeper.ttl)
        )

    def _complete(self, run: Run) -> Outcome:
        # The side effect happened: keep trying to record it rather than re-running the job,
        # but never ack what could not be recorded.
        job, cancelled = run.job, run.ctx.cancelled
        deadline = time.monotonic() + self._complete_patience
        delay = 0.2
        while True:
            try:
                self._store.complete(job.job_id, self._owner, job.message_id)
                return Succeeded()
            except StoreUnavailable as exc:
                if time.monotonic() + delay > deadline or cancelled.is_set():
                    log.error("job %s done but not recorded: %s", job.job_id, exc)
                    return Unavailable(f"completion not recorded: {exc}")
                cancelled.wait(delay)
                delay = min(delay * 2, 5.0)
            except StoreError as exc:  # not going to get better by waiting
                log.error("job %s done but not recorded: %s", job.job_id, exc)
                return Unavailable(f"completion not recorded: {exc}")

    def _release(self, job: Job, *, failed: bool = False) -> None:
        try:
            self._store.release(job.job_id, self._owner, job.message_id, failed=failed)
        except StoreError as exc:
            log.warning("claim on %s not released (%s); it expires on its own", job.job_id, exc)

        # --- interrupted runs and stopping ---------------------------------------------------

    def interrupted(self, run: Run) -> None:
        self.keeper.interrupted((run.job.job_id, run.job.message_id))

    def close(self, timeout: float) -> None:
        """Release the interrupted runs' claims and close the store, within ``timeout``;
        what does not make it is left to expire."""
        self.keeper.close(timeout)
