"""A replica's shares of the keys leased in bulk (``"20/bulk"``): runs start inside them
with no store write, and one store call a period renews them all.

A share is a number of slots the key's record holds for this replica (``allocation``). A
run takes one of them in memory and gives it back in memory when it ends. Once a period the
``ShareManager``'s thread asks about every key with a share or a demand in one store call:
per key, the slots it keeps (those in use, up to what its runs want) and what its runs want;
the record answers with the share's size and the replica's fair target (and writes only what
changed). While that call is in flight the share is capped at what it keeps, so runs here
never use more than the record grants. Above its target, the share shrinks as runs end (it
starts none beyond the target).

Rounds come twice a period while slots may move (another replica's runs wait, or this one's
want more than its share holds), and between them only where one moves slots: a share whose
runs want more than it holds while the record has room for it (a key's first ask saw only
the first of its runs), or one holding slots its runs have not used for a period while
another replica's runs wait. Until then it keeps them, and tells the record its runs want
them: a replica's runs of a key pause between pulls, and slots given back at once went back
and forth between the replicas at every pause, a write of the record each way.

A share not renewed in time lapses here before it can in the record (a watch timer, as the
keeper's for per-run slots): it starts no more runs, and its runs are cancelled and handed
back. A run lists its use of the share among its leases, so a process paused past the
expiry settles nothing as the owner (``Run.lost_lease``).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from workerpool import constants as c
from workerpool.slots.allocation import ShareAsk, ShareGrant
from workerpool.slots.keys import Limits
from workerpool.slots.sharding import Sharding
from workerpool.slots.store import MIN_COME_BACK, SlotStore
from workerpool.stores import StoreError
from workerpool.worker.outcome import LAPSED_COME_BACK, LostLease
from workerpool.worker.run import Run
from workerpool.worker.timers import Timer, Timers

log = logging.getLogger(__name__)

# How often a waiting run looks at its run (draining? handed back?) while it waits.
_CHECK_EVERY = 0.25
# A key's first round waits this long (seconds) for the runs of the pull that brought it.
_GATHER = 0.05
# How much one run's hold time moves a share's mean hold time (for deferrals' delays).
_HOLD_WEIGHT = 0.2
# Periods a share nobody else waits for keeps slots its runs no longer want: a key's runs
# come in waves (as pulls bring them), and each time it gives them back and asks again is a
# write of the key's record.
_LINGER = 2
# Periods a share keeps slots its runs stopped using while another replica's runs wait: a
# replica's runs of a key pause between pulls (0.25-0.6 s in the per-tenant fleet test), and
# giving the slots back at once for the other's runs, then asking for them again with the
# next pull's, was 5-7 writes of the key's record for each such pause (the busiest key there
# 2.3 writes a second, 1.4 with this; 2.2 with half a period).
_PAUSE = 1


class ShareUse:
    """One run's slot of a share, listed among the run's leases: lapsed once the share's
    expiry passed, or the share lapsed and was taken anew since the run started."""

    what = "slot"
    __slots__ = ("generation", "run", "share", "since")

    def __init__(self, share: Share, run: Run, since: float) -> None:
        self.share = share
        self.generation = share.generation
        self.run = run
        self.since = since

    def lapsed(self, now: float) -> bool:
        return self.generation != self.share.generation or now >= self.share.expires


@dataclass(eq=False, order=False)
class _Ticket:
    # Jobs that came back (deferred, or delivered again) go ahead of first deliveries.
    rank: tuple[int, int]
    held: bool = True  # its run holds its pool permit (it did not put it down to wait)


@dataclass(eq=False)
class Share:
    """This replica's share of one key, as the record last said (``granted``), and what its
    runs may use now (``cap`` <= ``granted``)."""

    key: str
    limit: int
    granted: int = 0
    cap: int = 0
    target: int = 0
    room: int = 0  # its part at least, were its runs to want more
    token: int = 0
    expires: float = -math.inf  # our clock: it may lapse in the record from then on
    generation: int = 0  # grows when it lapses: the runs of an earlier one hold nothing
    answered: bool = False  # the record has answered for it once
    contended: bool = False  # the record said another replica's runs wait for slots
    wanted: float = -math.inf  # our clock: the last round at which its runs wanted slots
    full: float = -math.inf  # our clock: the last time its runs used or waited for all of it
    hold: float = 0.0  # mean seconds a run held a slot
    uses: set[ShareUse] = field(default_factory=set)
    line: list[_Ticket] = field(default_factory=list)
    watch: Timer | None = None

    @property
    def want(self) -> int:
        return len(self.uses) + len(self.line)

    def free_for(self, ticket: _Ticket) -> bool:
        """Whether a slot of the share is free for ``ticket`` now: those ahead go first, but
        not those whose runs put their permits down to wait (``up_next``) until they have
        them back, so a slot never waits for a permit that runs waiting for it hold."""
        ahead = self.line[: self.line.index(ticket)]
        return ticket.held and sum(t.held for t in ahead) < self.cap - len(self.uses)

    def up_next(self, ticket: _Ticket) -> bool:
        """Whether a slot of the share is free for ``ticket`` by its place in line."""
        return self.line.index(ticket) < self.cap - len(self.uses)

    @property
    def owed(self) -> bool:
        """Its runs want more than it holds, and the record has room for them."""
        return self.granted < min(self.room, self.want)

    @property
    def unsettled(self) -> bool:
        """Slots may move to or from it: its runs want more than it holds, or another
        replica's runs wait for slots (one of which may be the newcomer its share is to
        shrink for)."""
        return self.contended or self.want > self.granted

    def idle(self, now: float, pause: float) -> bool:
        """It holds slots its runs do not use while another replica's runs wait for some,
        and has for ``pause`` seconds (its runs do not pause between pulls)."""
        return self.contended and self.want < self.cap and now - self.full >= pause

    def note_full(self, now: float) -> None:
        """(Under the lock; before a run leaves it.) When its runs use or wait for all of
        it, now is the last time they did."""
        if self.want >= self.cap:
            self.full = now


class ShareManager:
    """The shares of one replica (``owner``) and the thread that renews them."""

    def __init__(
        self,
        store: SlotStore,
        owner: str,
        limits: Limits,
        timers: Timers,
        *,
        ttl: float = c.DEFAULT_SLOT_TTL,
        period: float = c.SLOT_SHARE_PERIOD,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._owner = owner
        self._limits = limits
        self._timers = timers
        self.ttl = ttl
        self._period = period
        self._clock = clock
        # Lapse here this long before the record may: time for runs to see ctx.cancelled.
        self._margin = min(ttl / 6, 10.0)
        self._pause = _PAUSE * period
        self._shares: dict[str, Share] = {}
        # Which record each key's round writes (a split key's: this replica's shard).
        self._sharding = Sharding(store, owner, limits, ttl=ttl, clock=clock)
        self._cond = threading.Condition()
        self._arrivals = itertools.count()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.healthy = True

    def start(self) -> None:
        self._thread = threading.Thread(target=self._keep, name="workerpool-shares", daemon=True)
        self._thread.start()

    def shares(self) -> dict[str, Share]:
        with self._cond:
            return dict(self._shares)

    # --- on the runs' threads ------------------------------------------------------------

    def take(self, key: str, run: Run, patience: float, *, park: bool) -> ShareUse | str:
        """A slot of ``key``'s share for ``run``, waiting up to ``patience`` seconds; or why
        not: "stopped" (the run must not start), "patience", "no_room" (the key is held by
        other replicas and the pool has no room to wait without the permit). With ``park``,
        it waits without its permit where the pool has room, else holding it: a bulk key's
        runs are short, and a slot of a share that is not empty frees within one."""
        came_back = (run.delivery.delivery_attempt or 1) > 1
        ticket = _Ticket((0 if came_back else 1, next(self._arrivals)))
        deadline = self._clock() + patience
        with self._cond:
            share = self._share(key)
            owed = share.owed
            bisect.insort(share.line, ticket, key=lambda t: t.rank)
            share.note_full(self._clock())
            if share.answered and share.owed and not owed:
                self._wake.set()  # its target has room for this run: ask now, not in a period
            try:
                while not share.free_for(ticket):
                    if should_stop(run):
                        return "stopped"
                    if not ticket.held and share.up_next(ticket):
                        # Its permit back first (runs behind that hold theirs may take the
                        # slot meanwhile); then it waits with it, never parking again.
                        if not self._permit(run.permit.pick_up):
                            return "stopped"
                        ticket.held, park = True, False
                        continue
                    if park and ticket.held:
                        # Asked again at each wake: the pool may have room by then.
                        ticket.held = not self._permit(run.permit.put_down)
                        if ticket.held and share.answered and share.room == 0:
                            return "no_room"
                        if share.up_next(ticket):
                            continue  # freed while the lock was let go: no wake will come
                    left = deadline - self._clock()
                    if left <= 0:
                        return "patience"
                    self._cond.wait(min(left, _CHECK_EVERY))
                use = ShareUse(share, run, self._clock())
                share.uses.add(use)
            finally:
                share.line.remove(ticket)
                self._cond.notify_all()
        run.leases.append(use)
        return use

    def _permit(self, call: Callable[[], bool]) -> bool:
        """(Under the lock.) ``run.permit.put_down`` or ``pick_up``, the lock let go
        meanwhile: the pool takes its own lock for it (and a pick-up waits for a permit),
        and may call into a middleware that takes this one."""
        self._cond.release()
        try:
            return call()
        finally:
            self._cond.acquire()

    def _share(self, key: str) -> Share:
        """(Under the lock.) The key's share, a new one asked for soon (no run waits a
        whole period for a key's first slots), once the pull that brought the first run has
        brought its others: a first ask for one slot was a first second spent with one."""
        share = self._shares.get(key)
        if share is None:
            share = self._shares[key] = Share(key, self._limits.of(key) or 0)
            self._timers.call_after(_GATHER, self._wake.set)
        return share

    def give(self, use: ShareUse, *, held: bool = True) -> None:
        """The run ended (or never started: ``held`` False): its slot is free here at once.
        A slot over the share's target goes back to the record instead, at the next round."""
        share = use.share
        now = self._clock()
        with self._cond:
            if use not in share.uses:
                return  # handed back already, or its share lapsed
            was_full = share.want >= share.cap
            share.note_full(now)
            share.uses.discard(use)
            if held:
                sample = now - use.since
                share.hold = (
                    sample if not share.hold else share.hold + _HOLD_WEIGHT * (sample - share.hold)
                )
            shrinking = share.cap > share.target
            share.cap = min(share.cap, max(share.target, len(share.uses)))
            if (shrinking and share.cap == share.target) or share.idle(now, self._pause):
                self._wake.set()  # slots others wait for: they go out now, not in a period
            elif was_full and share.contended and share.want < share.cap:
                # Its runs may have paused between pulls: slots others wait for go out once
                # the pause has lasted, not a period after.
                self._timers.call_after(self._pause, self._wake.set)
            self._cond.notify_all()
        _unlist(use, now)

    def interrupted(self, run: Run) -> None:
        """``run`` was handed back: its slots are free here now."""
        with self._cond:
            mine = [use for share in self._shares.values() for use in share.uses if use.run is run]
        for use in mine:
            self.give(use, held=False)

    def come_back_in(self, key: str) -> float:
        """Seconds until a job that found ``key``'s share full should come back: when the
        runs waiting here now may have had their turn (no store call, no booking)."""
        with self._cond:
            share = self._share(key)
            turns = (len(share.line) + 1) * share.hold / max(1, share.granted)
        return max(MIN_COME_BACK, turns)

    # --- on the manager's thread ---------------------------------------------------------

    def _keep(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.next_round())
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.renew()
                demand = {k: (s.granted, s.want) for k, s in self.shares().items()}
                if self._sharding.keep_balanced(demand):
                    self._wake.set()  # this replica's shard grew: its share may, now
            except Exception:  # not a StoreError (handled): a bug; keep going
                log.exception("renewing the slot shares failed; trying again")
                self.healthy = False
            # Rounds asked for early (a new key, slots given back) come no closer than this.
            self._stop.wait(self._period / 4)

    def next_round(self) -> float:
        """Seconds until the next round: half a period while slots may move to or from a
        share (such a round is mostly a read of the record, a write only where a share or a
        target moves). A share learns of others' wants only at its own rounds: one whose
        round came just before a newcomer's first ask kept its larger share a whole period
        while the others shrank for it, and one that shrank for it regrew only a period
        after the newcomer left."""
        with self._cond:
            unsettled = any(s.unsettled for s in self._shares.values())
        return self._period / 2 if unsettled else self._period

    def renew(self, *, closing: bool = False) -> None:
        """One store call for every share: renew it, grow it toward its target, give back
        what its runs do not use (all of it, ``closing``)."""
        now = self._clock()
        with self._cond:
            asking = [s for s in self._shares.values() if s.granted or s.want or s.uses]
            asks = []
            for share in asking:
                want = 0 if closing else share.want
                if want:
                    share.wanted = now
                share.note_full(now)
                if (
                    closing
                    or share.idle(now, self._pause)
                    or now - share.wanted >= _LINGER * self._period
                ):
                    # Slots its runs do not use go back (only here) once another replica
                    # waits for them, or its runs have wanted none for a while; until then
                    # they stay for its next runs (a pull's runs come in waves), unwritten.
                    share.cap = max(len(share.uses), min(share.cap, want))
                # Slots it keeps are slots its runs want, as far as others' rounds go: a want
                # below them moved another's fair target, a write, though no slot could move.
                want = want if closing else max(want, share.cap)
                asks.append(ShareAsk(share.key, self._owner, share.limit, share.cap, want))
        if not asks:
            self.healthy = True
            return
        sent = self._clock()
        try:
            grants = self._sharding.lease(asks, self.ttl)
        except StoreError as exc:
            log.warning("slot shares of %d keys not renewed: %s", len(asks), exc)
            self.healthy = False
            return
        self.healthy = True
        for share, grant in zip(asking, grants, strict=True):
            self._apply(share, grant, sent)

    def _apply(self, share: Share, grant: ShareGrant, sent: float) -> None:
        if grant.lapsed:
            log.error("slot share of %s lapsed in the store (was the process paused?)", share.key)
            self._lapse(share, share.expires)
        with self._cond:
            share.granted, share.target, share.token = grant.granted, grant.target, grant.token
            share.room = grant.room
            share.answered, share.contended = True, grant.contended
            share.expires = sent + grant.left
            share.cap = min(share.granted, max(share.target, len(share.uses)))
            if share.watch is not None:
                share.watch.cancel()
            expires = share.expires
            share.watch = self._timers.call_at(
                expires - self._margin, lambda: self._lapse(share, expires)
            )
            if share.idle(self._clock(), self._pause):
                self._wake.set()  # others wait for slots its runs do not use
            self._cond.notify_all()

    def _lapse(self, share: Share, expires: float) -> None:
        """The share was not renewed in time (or the record says it lapsed): it starts no
        more runs, and its runs are cancelled and handed back before others get its slots."""
        with self._cond:
            if share.expires != expires:
                return  # renewed since
            lost = list(share.uses)
            share.uses.clear()
            share.generation += 1
            share.granted = share.cap = 0
            share.watch = None
            self._cond.notify_all()
        if lost:
            log.error("slot share of %s not renewed in time: handing back %d runs",
                      share.key, len(lost))  # fmt: skip
        remaining = max(0.0, expires - self._clock())
        for use in lost:
            threading.Thread(
                target=use.run.hand_back, args=(LostLease(after=remaining + LAPSED_COME_BACK),),
                name="workerpool-share-lost", daemon=True,
            ).start()  # fmt: skip

    def close(self, timeout: float) -> None:
        """Give every share back (one last store call), within ``timeout``."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        try:
            self.renew(closing=True)
        except Exception:  # they lapse on their own within the TTL
            log.exception("slot shares not given back")
        with self._cond:
            for share in self._shares.values():
                if share.watch is not None:
                    share.watch.cancel()


def _unlist(use: ShareUse, now: float) -> None:
    """The run no longer holds ``use``; if it had lapsed by then, the run says so."""
    run = use.run
    if use in run.leases:
        run.leases.remove(use)
    if not run.lapsed and use.lapsed(now):
        run.lapsed = use.what


def should_stop(run: Run) -> bool:
    """Whether a run waiting for a slot must give up: it was settled, handed back, or the
    pool drains."""
    return run.delivery.settled or run.ctx.draining.is_set() or run.ctx.cancelled.is_set()
