"""The idempotency middleware: claim a job id before running it, complete or release after.

Claims are short (``ttl``) and renewed, all in one store call, every ``ttl / 3`` by a keeper
thread, so a claim whose owner died expires soon and another worker takes over. A run whose
claim cannot be renewed (the store is down, refuses us, or is stalled) is handed back before
the claim can lapse: a watch timer per claim, independent of the store call that may hang,
cancels the run and nacks its message to come back once the claim has lapsed, so two workers
never run one job id at once. A job that fails, or is interrupted by the drain deadline, has
its claim released, so the next delivery can start it at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

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
from workerpool.worker.middleware import Middleware, Next
from workerpool.worker.outcome import (
    AlreadyDone,
    DuplicateOfRunning,
    Interrupted,
    LostClaim,
    Outcome,
    RedeliveredWhileRunning,
    Succeeded,
    Unavailable,
)
from workerpool.worker.run import Run
from workerpool.worker.timers import Timer, Timers

log = logging.getLogger(__name__)

_Key = tuple[str, str]  # (job_id, message_id)
# While renewals fail, try again this often (seconds) rather than every ttl / 3.
_RETRY_EVERY = 2.0


@dataclass(eq=False)
class _Claim:
    run: Run
    key: _Key
    expires: float  # our clock: the claim may lapse from then on (measured from the request)
    watch: Timer


class Idempotency(Middleware):
    def __init__(
        self,
        store: IdempotencyStore,
        owner: str,
        timers: Timers,
        *,
        ttl: float = c.DEFAULT_CLAIM_TTL,
        complete_patience: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._owner = owner
        self._timers = timers
        self._ttl = ttl
        # Hand a run back this long before its claim could lapse: time for its handler to
        # see ctx.cancelled and stop, and for the nack to reach Pub/Sub.
        self._margin = min(ttl / 6, 10.0)
        self._complete_patience = complete_patience
        self._clock = clock
        self._claims: dict[_Key, _Claim] = {}  # claimed and running: renewed
        self._active: set[_Key] = set()  # being processed here, claimed or not yet
        self._releases: list[_Key] = []  # claims of interrupted runs, released by the keeper
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        self._renewing = True  # the last renewal round reached the store

    def start(self) -> None:
        self._keeper = threading.Thread(target=self._keep, name="workerpool-claims", daemon=True)
        self._keeper.start()

    @property
    def healthy(self) -> bool:
        return self._renewing and self._keeper is not None and self._keeper.is_alive()

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
        sent = self._clock()
        try:
            claim = self._store.claim(job.job_id, self._owner, job.message_id, self._ttl)
            if self._is_own_stale_claim(claim, job):
                claim = Claimed()
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
            case Claimed():
                pass
        if run.delivery.settled:
            # Handed back (the drain deadline) while the claim was being made: never start
            # it, and do not leave the claim to hold the job id until it expires.
            self._release(job)
            return Interrupted()
        held = self._hold(run, key, sent + self._ttl)
        try:
            outcome = call_next(run)
            if isinstance(outcome, Succeeded):
                return self._complete(run)
            self._release(job)
            return outcome
        finally:
            self._let_go(held)

    def _is_own_stale_claim(self, claim: ClaimResult, job: Job) -> bool:
        """A claim of ours on this very message that no run here holds (``run`` checked):
        left by a claim whose reply was lost in an outage. Taking it back beats its TTL."""
        return (
            isinstance(claim, HeldElsewhere)
            and claim.owner == self._owner
            and claim.message_id == job.message_id
            and self._store.renew(job.job_id, self._owner, job.message_id, self._ttl)
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

    def _release(self, job: Job) -> None:
        try:
            self._store.release(job.job_id, self._owner, job.message_id)
        except StoreError as exc:
            log.warning("claim on %s not released (%s); it expires on its own", job.job_id, exc)

    # --- keeping claims alive ------------------------------------------------------------

    def _hold(self, run: Run, key: _Key, expires: float) -> _Claim:
        claim = _Claim(run, key, expires, self._watch(key, expires))
        with self._lock:
            self._claims[key] = claim
        return claim

    def _watch(self, key: _Key, expires: float) -> Timer:
        return self._timers.call_at(expires - self._margin, lambda: self._lapsing(key))

    def _let_go(self, claim: _Claim) -> None:
        claim.watch.cancel()
        with self._lock:
            if self._claims.get(claim.key) is claim:
                del self._claims[claim.key]

    def _lapsing(self, key: _Key) -> None:
        """On the timer thread: the claim may lapse soon and was not renewed in time."""
        with self._lock:
            claim = self._claims.get(key)
            if claim is None or self._clock() < claim.expires - self._margin:
                return  # ended, or renewed meanwhile
            del self._claims[key]  # given up: nobody renews or releases it from now on
        # Off the timer thread: a middleware's interrupted() may call its own store.
        threading.Thread(
            target=self._give_up, args=(claim,), name="workerpool-claim-lost", daemon=True
        ).start()

    def _give_up(self, claim: _Claim) -> None:
        remaining = max(0.0, claim.expires - self._clock())
        log.error(
            "claim on %s could not be renewed: cancelling its run and handing its message "
            "back %.1fs before the claim can lapse",
            claim.key[0],
            remaining,
        )
        claim.run.hand_back(LostClaim(after=remaining + 1.0))

    def _keep(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._ttl / 3 if self._renewing else min(self._ttl / 3, _RETRY_EVERY))
            self._wake.clear()
            try:
                self._release_interrupted()
                if not self._stop.is_set():
                    self._renew_all()
            except Exception:  # not a StoreError (those are handled): a bug; keep going
                log.exception("keeping claims alive failed; trying again")
                self._renewing = False
        self._close_store()

    def _renew_all(self) -> None:
        with self._lock:
            claims = list(self._claims.values())
        if not claims:
            self._renewing = True
            return
        sent = self._clock()
        try:
            ours = self._store.renew_many([claim.key for claim in claims], self._owner, self._ttl)
        except StoreError as exc:
            log.warning("%d claims not renewed: %s", len(claims), exc)
            self._renewing = False
            return
        self._renewing = True
        for claim, still_ours in zip(claims, ours, strict=True):
            if still_ours:
                self._extend(claim, sent + self._ttl)
            else:
                # Someone took over (our renewals lapsed): stop rather than run it twice.
                log.warning("claim on %s was taken over; cancelling our run", claim.key[0])
                claim.run.ctx.cancelled.set()

    def _extend(self, claim: _Claim, expires: float) -> None:
        with self._lock:
            if self._claims.get(claim.key) is not claim:
                # Ended, or given up, while the renewal was in flight. Not released: the same
                # message may have been claimed here again meanwhile, under the same key, and
                # a release would delete that live claim. A given-up claim that was renewed
                # so lingers until it expires; its message is deferred until then.
                return
            claim.watch.cancel()
            claim.expires = expires
            claim.watch = self._watch(claim.key, expires)

    # --- interrupted runs and stopping ---------------------------------------------------

    def interrupted(self, run: Run) -> None:
        key = (run.job.job_id, run.job.message_id)
        with self._lock:
            claim = self._claims.pop(key, None)
            if claim is None:
                return
            claim.watch.cancel()
            self._releases.append(key)
        self._wake.set()  # released by the keeper, all in one call, off the drain's path

    def _release_interrupted(self) -> None:
        with self._lock:
            keys, self._releases = self._releases, []
        if not keys:
            return
        try:
            self._store.release_many(keys, self._owner)
        except StoreError as exc:
            log.warning("%d claims not released (%s); they expire on their own", len(keys), exc)

    def _close_store(self) -> None:
        try:
            self._release_interrupted()
            self._store.close()
        except Exception:
            log.exception("closing the idempotency store failed")

    def close(self, timeout: float) -> None:
        """Release the interrupted runs' claims and close the store, within ``timeout``;
        what does not make it is left to expire."""
        self._stop.set()
        self._wake.set()
        if self._keeper is None:
            self._close_store()
            return
        self._keeper.join(timeout)
        if self._keeper.is_alive():
            log.warning("idempotency store still busy at the deadline; its claims will expire")
