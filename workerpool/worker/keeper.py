"""Keeps the store leases of running runs alive: idempotency claims, concurrency slots.

A lease is short (``ttl``) and renewed, all of a keeper's leases in one store call, every
``ttl / 3`` by the keeper's thread, so a lease whose holder died expires soon. A run whose
lease cannot be renewed (the store is down, refuses us, or is stalled) is handed back before
the lease can lapse: a watch timer, independent of the store call that may hang, cancels the
run and nacks its message to come back once the lease has lapsed, so a lease never has two
holders. Leases taken, or renewed, by one store call share their watch timer: one per claim
batch or renewal round, not one per lease (a timer per job was 3 us of CPU a job at N = 100,
measured). Leases of interrupted runs are released by the keeper's thread,
all in one call, off the drain's path.

A lease may also be held for a message before its run exists (a claim taken as the message is
admitted, while it waits for a slot): it is renewed the same way, and one that cannot be
renewed, or was taken over, is simply dropped (nothing runs under it yet). The run that starts
``adopt``s the lease, or takes its own if it was dropped.

None of this runs while the process is paused (a GC pause, a frozen VM): a lease may lapse,
and another take it, before the watch can act. So a run lists the leases it holds, each with
its deadline (``Held.lapsed``), and one that lapsed while held settles nothing as its owner
(``Run.lost_lease``, checked by the processor as the run ends).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from workerpool.stores import StoreError
from workerpool.worker.outcome import LAPSED_COME_BACK, LostLease
from workerpool.worker.run import Run
from workerpool.worker.timers import Timer, Timers

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)
# While renewals fail, try again this often (seconds) rather than every ttl / 3.
_RETRY_EVERY = 2.0


class _Watch(Generic[K]):
    """The watch timer of leases that may lapse at one time, and the keys it still watches:
    once it watches none, it is cancelled. It holds keys, not leases, so that it keeps no
    ended run alive until it comes due."""

    __slots__ = ("keys", "timer")

    def __init__(self, keys: set[K]) -> None:
        self.keys = keys
        self.timer: Timer | None = None


@dataclass(eq=False)
class Held(Generic[K]):
    # The run holding it; None while its message waits to start, and once let go.
    owner: Run | None
    key: K
    expires: float  # our clock: the lease may lapse from then on (measured from the request)
    watch: _Watch[K]
    what: str  # "claim", "slot"
    taken: bool = False  # the store said it is no longer ours, whatever our clock says

    def lapsed(self, now: float) -> bool:
        """Whether another may hold it by ``now`` (our clock): the deadline its last renewal
        (or grant) set has passed, or the store gave it to another."""
        return self.taken or now >= self.expires


class LeaseKeeper(Generic[K]):
    """``renew(keys)`` says, per key, whether the lease is still ours (one store call);
    ``release(keys)`` gives leases up; ``close_store`` runs last on the keeper's thread.
    ``what`` names the leases in log lines ("claim", "slot")."""

    def __init__(
        self,
        what: str,
        timers: Timers,
        ttl: float,
        renew: Callable[[Sequence[K]], list[bool]],
        release: Callable[[Sequence[K]], None],
        close_store: Callable[[], None],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._what = what
        self._timers = timers
        self.ttl = ttl
        self._renew = renew
        self._release = release
        self._close_store = close_store
        self._clock = clock
        # Hand a run back this long before its lease could lapse: time for its handler to
        # see ctx.cancelled and stop, and for the nack to reach Pub/Sub.
        self._margin = min(ttl / 6, 10.0)
        self._held: dict[K, Held[K]] = {}
        self._releases: list[K] = []
        self._releasing: list[K] = []  # the release in flight
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._renewing = True  # the last renewal round reached the store

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._keep, name=f"workerpool-{self._what}s", daemon=True
        )
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self._renewing and self._thread is not None and self._thread.is_alive()

    def hold(self, run: Run | None, key: K, sent: float) -> Held[K]:
        """Keep the lease ``key``, taken by a request sent at ``sent`` (our clock), alive
        while ``run`` runs (None: for a message that waits to start, see ``adopt``)."""
        return self.hold_many([key], sent, run)[0]

    def hold_many(self, keys: Sequence[K], sent: float, run: Run | None = None) -> list[Held[K]]:
        """``hold`` for leases of distinct ``keys`` taken by one request, under one watch."""
        if not keys:
            return []
        distinct = set(keys)
        if len(distinct) != len(keys):  # the second lease of a key would go unwatched
            raise ValueError(f"hold_many: a key given twice in {keys!r}")
        expires = sent + self.ttl
        with self._lock:
            watch = self._new_watch(distinct, expires)
            held = [Held(run, key, expires, watch, self._what) for key in keys]
            if run is not None:
                run.leases.extend(held)
            for lease in held:
                replaced = self._held.get(lease.key)
                if replaced is not None:
                    self._forget(replaced)
                self._held[lease.key] = lease
        return held

    def let_go(self, held: Held[K]) -> None:
        """Stop renewing (the caller releases or completes the lease itself)."""
        self.let_go_many([held])

    def let_go_many(self, held: Sequence[Held[K]]) -> None:
        now = self._clock()
        with self._lock:
            for lease in held:
                if self._held.get(lease.key) is lease:
                    self._forget(lease)
                if lease.owner is not None:
                    _unlist(lease.owner, lease, now)
                # A run may hold its lease (the idempotency completion does): lease and run
                # would hold each other, for the cyclic garbage collector to free. Those
                # cycles, 16 objects a job, were half its time, 6 of 13 us a job (measured).
                lease.owner = None

    def lapsed(self, held: Held[K]) -> bool:
        """``held.lapsed`` now, by this keeper's clock."""
        return held.lapsed(self._clock())

    def adopt(self, held: Held[K], run: Run) -> bool:
        """``run`` takes over a lease held for its waiting message; False if it was dropped
        meanwhile (it could not be renewed, or was taken over): then it is not ours to use."""
        with self._lock:
            if self._held.get(held.key) is not held:
                return False
            held.owner = run
            run.leases.append(held)
            return True

    def drop(self, held: Held[K]) -> None:
        """A lease held for a message that leaves without running: release it soon, off the
        caller's thread (unless it was dropped already)."""
        with self._lock:
            if self._held.get(held.key) is not held:
                return
            self._forget(held)
            self._releases.append(held.key)
        self._wake.set()

    def interrupted(self, key: K) -> None:
        """The run holding ``key`` was handed back: release its lease soon, off this thread."""
        with self._lock:
            held = self._held.get(key)
            if held is None:
                return
            self._forget(held)
            self._releases.append(key)
        self._wake.set()

    def releasing(self, key: K) -> bool:
        """Whether a release of ``key`` is queued or in flight: a lease taken again under it
        meanwhile would be released with it."""
        with self._lock:
            return key in self._releases or key in self._releasing

    def release_soon(self, keys: Sequence[K]) -> None:
        """Release leases no run holds (taken for a message that never ran), soon, off the
        caller's thread."""
        with self._lock:
            self._releases.extend(keys)
        self._wake.set()

    def _forget(self, held: Held[K]) -> None:
        """(Under the lock.) ``held`` is no longer kept: nor watched."""
        del self._held[held.key]
        self._unwatch(held)

    def _unwatch(self, held: Held[K]) -> None:
        """(Under the lock.) ``held``'s watch no longer watches it."""
        watch = held.watch
        watch.keys.discard(held.key)
        if not watch.keys and watch.timer is not None:
            watch.timer.cancel()
            watch.timer = None  # else it and its timer's callback hold each other

    def _new_watch(self, keys: set[K], expires: float) -> _Watch[K]:
        """(Under the lock.) A watch of ``keys``, whose leases may lapse from ``expires``."""
        watch: _Watch[K] = _Watch(keys)
        self._start_watch(watch, expires)
        return watch

    def _start_watch(self, watch: _Watch[K], expires: float) -> None:
        """(Under the lock.)"""
        watch.timer = self._timers.call_at(expires - self._margin, lambda: self._lapsing(watch))

    # --- on the timer thread -------------------------------------------------------------

    def _lapsing(self, watch: _Watch[K]) -> None:
        """Leases that may lapse soon and were not renewed in time."""
        lost: list[tuple[Run, float]] = []  # the runs to hand back, and when their lease expires
        with self._lock:
            watch.timer = None  # it came due: the watch and it no longer hold each other
            now = self._clock()
            for key in list(watch.keys):
                held = self._held.get(key)
                if held is None or held.watch is not watch or now < held.expires - self._margin:
                    continue  # (not so: once renewed, a lease is watched by that round's)
                self._forget(held)  # given up: nobody renews or releases it from now on
                # Unhealthy whatever the cause, a failed round or none in time (a starved or
                # stuck keeper thread), until a round reaches the store again.
                self._renewing = False
                if held.owner is not None:  # else nothing runs under it: the run that
                    lost.append((held.owner, held.expires))  # starts takes a claim of its own
            early = [self._held[key] for key in watch.keys if key in self._held]
            if early:  # still under it and not due (a clock that disagrees by a hair): later
                self._start_watch(watch, early[0].expires)
        for run, expires in lost:
            # Off the timer thread: a middleware's interrupted() may call its own store. A
            # thread each: a hand-back may block (a copy published on a last delivery) or
            # raise, and every other run under this watch must still stop within the margin.
            threading.Thread(
                target=self._give_up, args=(run, expires), name=f"workerpool-{self._what}-lost",
                daemon=True,
            ).start()  # fmt: skip

    def _give_up(self, run: Run, expires: float) -> None:
        remaining = max(0.0, expires - self._clock())
        # Past its deadline already: nothing ran here to renew it in time (the process was
        # paused, a GC pause or a frozen VM), and another may hold it now.
        when = (
            f"{remaining:.1f}s before the {self._what} can lapse"
            if remaining
            else f"after the {self._what} lapsed (was the process paused?)"
        )
        log.error(
            "%s for job %s could not be renewed: cancelling its run and handing its message "
            "back %s", self._what, run.job.job_id, when,
        )  # fmt: skip
        run.hand_back(LostLease(after=remaining + LAPSED_COME_BACK))

    # --- on the keeper's thread ----------------------------------------------------------

    def _keep(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.ttl / 3 if self._renewing else min(self.ttl / 3, _RETRY_EVERY))
            self._wake.clear()
            try:
                self._release_interrupted()
                if not self._stop.is_set():
                    self._renew_all()
            except Exception:  # not a StoreError (those are handled): a bug; keep going
                log.exception("keeping %ss alive failed; trying again", self._what)
                self._renewing = False
        try:
            self._release_interrupted()
            self._close_store()
        except Exception:
            log.exception("closing the %s store failed", self._what)

    def _renew_all(self) -> None:
        with self._lock:
            held = list(self._held.values())
        if not held:
            self._renewing = True
            return
        sent = self._clock()
        try:
            ours = self._renew([h.key for h in held])
        except StoreError as exc:
            log.warning("%d %ss not renewed: %s", len(held), self._what, exc)
            self._renewing = False
            return
        self._renewing = True
        self._extend([lease for lease, still_ours in zip(held, ours, strict=True) if still_ours],
                     sent + self.ttl)  # fmt: skip
        for lease, still_ours in zip(held, ours, strict=True):
            run = None if still_ours else self._taken_over(lease)
            if run is not None:
                # Someone took over (our renewals lapsed): stop rather than share the lease.
                log.warning(
                    "%s for job %s was taken over; cancelling its run", self._what, run.job.job_id
                )
                run.ctx.cancelled.set()

    def _taken_over(self, lease: Held[K]) -> Run | None:
        """The run to stop, of a lease the store says is no longer ours. None if it ended
        while the renewal was in flight (completed or released: nothing to stop, nothing to
        say), or if its message still waits: then the lease is dropped, and the run that
        starts finds the job id held elsewhere."""
        with self._lock:
            if self._held.get(lease.key) is not lease:
                return None
            lease.taken = True
            if lease.owner is None:
                self._forget(lease)
            return lease.owner

    def _extend(self, renewed: list[Held[K]], expires: float) -> None:
        """The leases ``renewed`` by one round may now last until ``expires``: one watch for
        them all."""
        with self._lock:
            # Only those still held: one that ended, or was given up, while the renewal was
            # in flight is not released either. The same key may have been taken here again
            # meanwhile, and a release would delete that live lease. A given-up lease that
            # was renewed so lingers until it expires.
            current = [lease for lease in renewed if self._held.get(lease.key) is lease]
            if not current:
                return
            watch = self._new_watch({lease.key for lease in current}, expires)
            for lease in current:
                self._unwatch(lease)
                lease.expires = expires
                lease.watch = watch

    def _release_interrupted(self) -> None:
        with self._lock:
            keys, self._releases = self._releases, []
            self._releasing = keys
        if not keys:
            return
        try:
            self._release(keys)
        except StoreError as exc:
            log.warning("%d %ss not released (%s); they expire", len(keys), self._what, exc)
        finally:
            with self._lock:
                self._releasing = []

    def close(self, timeout: float) -> None:
        """Release the interrupted runs' leases and close the store, within ``timeout``;
        what does not make it is left to expire."""
        self._stop.set()
        self._wake.set()
        if self._thread is None:
            self._close_store()
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("%s store still busy at the deadline; its leases will expire", self._what)


def _unlist(run: Run, lease: Held[K], now: float) -> None:
    """``run`` no longer holds ``lease``; if it had lapsed by then, the run says so."""
    run.leases.remove(lease)  # listed as it was held or adopted; let go once (owner None)
    if not run.lapsed and lease.lapsed(now):
        run.lapsed = lease.what
