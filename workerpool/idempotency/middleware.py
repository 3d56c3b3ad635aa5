"""The idempotency middleware: claim a job id before running it, complete or release after.

Claims are short (``ttl``) and renewed every ``ttl / 3`` while the job runs, so a claim whose
owner died expires soon and another worker takes over. A job that fails, or is interrupted by
the drain deadline, has its claim released first, so the next delivery can start it at once.
"""

from __future__ import annotations

import logging
import threading
import time

from workerpool.context import JobContext
from workerpool.envelope import Job
from workerpool.idempotency.base import (
    Claimed,
    ClaimResult,
    Done,
    HeldElsewhere,
    IdempotencyStore,
    StoreUnavailable,
)
from workerpool.middleware import Middleware, Next
from workerpool.outcome import (
    AlreadyDone,
    DuplicateOfRunning,
    Outcome,
    RedeliveredWhileRunning,
    Succeeded,
    Unavailable,
)

log = logging.getLogger(__name__)

_Key = tuple[str, str]  # (job_id, message_id)


class Idempotency(Middleware):
    def __init__(
        self,
        store: IdempotencyStore,
        owner: str,
        *,
        ttl: float = 60.0,
        complete_patience: float = 60.0,
    ) -> None:
        self._store = store
        self._owner = owner
        self._ttl = ttl
        self._complete_patience = complete_patience
        self._claims: dict[_Key, JobContext] = {}  # claimed and running: renewed
        self._active: set[_Key] = set()  # being processed here, claimed or not yet
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew_loop, name="workerpool-claims")
        self._renewer.daemon = True
        self._renewer.start()

    def run(self, job: Job, ctx: JobContext, call_next: Next) -> Outcome:
        key = (job.job_id, job.message_id)
        with self._lock:
            if key in self._active:
                return RedeliveredWhileRunning()  # its first delivery runs right here
            self._active.add(key)
        try:
            return self._run_claimed(job, ctx, call_next, key)
        finally:
            with self._lock:
                self._active.discard(key)

    def _run_claimed(self, job: Job, ctx: JobContext, call_next: Next, key: _Key) -> Outcome:
        try:
            claim = self._store.claim(job.job_id, self._owner, job.message_id, self._ttl)
            if self._is_own_stale_claim(claim, job):
                claim = Claimed()
        except StoreUnavailable as exc:
            return Unavailable(f"idempotency store: {exc}")
        match claim:
            case Done():
                return AlreadyDone()
            case HeldElsewhere(message_id=holder) if holder == job.message_id:
                # This very message came back while its first delivery still runs somewhere.
                return RedeliveredWhileRunning()
            case HeldElsewhere():
                return DuplicateOfRunning()
            case Claimed():
                pass
        with self._lock:
            self._claims[key] = ctx
        try:
            outcome = call_next(job, ctx)
        finally:
            with self._lock:
                self._claims.pop(key, None)
        if isinstance(outcome, Succeeded):
            return self._complete(job, ctx)
        self._release(job)
        return outcome

    def _is_own_stale_claim(self, claim: ClaimResult, job: Job) -> bool:
        """A claim of ours on this very message that no run here holds (``run`` checked):
        left by a claim whose reply was lost in an outage. Taking it back beats its TTL."""
        return (
            isinstance(claim, HeldElsewhere)
            and claim.owner == self._owner
            and claim.message_id == job.message_id
            and self._store.renew(job.job_id, self._owner, job.message_id, self._ttl)
        )

    def _complete(self, job: Job, ctx: JobContext) -> Outcome:
        # The side effect happened: keep trying to record it rather than re-running the job,
        # but never ack what could not be recorded.
        deadline = time.monotonic() + self._complete_patience
        delay = 0.2
        while True:
            try:
                self._store.complete(job.job_id, self._owner, job.message_id)
                return Succeeded()
            except StoreUnavailable as exc:
                if time.monotonic() + delay > deadline or ctx.cancelled.is_set():
                    log.error("job %s done but not recorded: %s", job.job_id, exc)
                    return Unavailable(f"completion not recorded: {exc}")
                ctx.cancelled.wait(delay)
                delay = min(delay * 2, 5.0)

    def _release(self, job: Job) -> None:
        try:
            self._store.release(job.job_id, self._owner, job.message_id)
        except StoreUnavailable as exc:
            log.warning("claim on %s not released (%s); it expires on its own", job.job_id, exc)

    def interrupted(self, job: Job, ctx: JobContext) -> None:
        with self._lock:
            self._claims.pop((job.job_id, job.message_id), None)
        self._release(job)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self._ttl / 3):
            with self._lock:
                claims = list(self._claims.items())
            for (job_id, message_id), ctx in claims:
                try:
                    ours = self._store.renew(job_id, self._owner, message_id, self._ttl)
                except StoreUnavailable as exc:
                    log.warning("claim on %s not renewed: %s", job_id, exc)
                    continue
                if not ours:
                    # Someone took over (our renewals lapsed): stop rather than run it twice.
                    log.warning("claim on %s was taken over; cancelling our run", job_id)
                    ctx.cancelled.set()

    def close(self) -> None:
        self._stop.set()
        self._renewer.join()
        self._store.close()
