"""Fleet-wide concurrency limits: a job declared with ``concurrency="KEY"`` runs only while it
holds one of KEY's slots (taken by ``SlotLeases``, workerpool.slots.leases). A process paused
past its slot's TTL cannot be stopped by the lease keeper: its run settles nothing as the owner
once it ends (``Run.lost_lease``), and ``ctx.slot_tokens`` lets what it writes refuse it
meanwhile."""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Mapping

from workerpool import constants as c
from workerpool.errors import Defer
from workerpool.options import CONCURRENCY
from workerpool.registry import JobSpec
from workerpool.slots.gate import PoolGate
from workerpool.slots.keys import NO_SHARD_MARK, SHARD_MARK, BadPayloadKey, KeyTemplate
from workerpool.slots.leases import GaveUp, Lease, SlotLeases, Taken
from workerpool.stores import StoreError
from workerpool.worker.middleware import Around, Middleware
from workerpool.worker.outcome import Deferred, Interrupted, Outcome, Rejected, Unavailable
from workerpool.worker.run import Run, Settled

log = logging.getLogger(__name__)


class Concurrency(Middleware):
    """Runs a job declared with ``@job(..., concurrency="KEY")`` inside a slot of KEY (a
    template over payload fields, ``"partner:{partner_id}"``, names one key per tenant), and
    every job of a pool with a ``gate`` inside a slot of the pool's key, the one reserved for
    its message before it was pulled."""

    options = frozenset({CONCURRENCY})

    def __init__(
        self,
        leases: SlotLeases,
        *,
        patience: float = c.DEFAULT_SLOT_WAIT,
        gate: PoolGate | None = None,
    ) -> None:
        self._leases = leases
        self._patience = patience
        self.gate = gate

    def ready_ahead(self, spec: JobSpec) -> bool:
        # A slot taken ahead would idle, while every other replica waits for it.
        return self.gate is None and not spec.options.get(CONCURRENCY)

    def start(self) -> None:
        self._leases.start()

    @property
    def healthy(self) -> bool:
        return self._leases.healthy

    def around(self, run: Run) -> Around:
        slots = run.ctx.slots = _RunSlots(self, run)
        taken: list[Taken] = []
        try:
            keys = self._keys(run)
            if isinstance(keys, Rejected):
                return keys
            for key in keys:
                slot = self._take(key, run)
                if not isinstance(slot, Taken):
                    return slot
                taken.append(slot)
            slots.tokens = {slot.lease.key: slot.lease.token for slot in taken}
            return (yield)
        finally:
            try:
                for slot in reversed(taken):
                    self._leases.give(slot)
            finally:
                # The run is over: its context stops leading back to it (run -> ctx ->
                # slots -> run), so the run, its message and its payload are freed as soon
                # as the pool lets go of them, instead of waiting, every one of them, for
                # the cyclic garbage collector.
                slots.end()

    def _keys(self, run: Run) -> list[str] | Rejected:
        """The keys ``run`` needs a slot of: its pool's, then its job's own."""
        keys = [self.gate.key] if self.gate is not None else []
        text = run.job.spec.options.get(CONCURRENCY)
        if text:
            try:
                key = _template(text).render(run.job.payload)
            except BadPayloadKey as exc:
                return Rejected(c.ERR_INVALID_PAYLOAD, str(exc))
            if self._leases.limits.of(key) is None:
                return Rejected(c.ERR_UNKNOWN_CONCURRENCY_KEY, f"no limit declared for key {key!r}")
            if key not in keys:
                keys.append(key)
        return keys

    def _take(self, key: str, run: Run) -> Taken | Outcome:
        if self.gate is not None and key == self.gate.key:
            reserved = self.gate.claim(run.delivery)
            if reserved is not None:
                return self._leases.keep(run, reserved.lease, reserved.sent)
        try:
            taken = self._leases.take(key, run, self._patience)
        except StoreError as exc:
            return Unavailable(f"slot store: {exc}")
        match taken:
            case GaveUp.STOPPED:
                return Interrupted()  # never started: another worker can have it now
            case GaveUp.PATIENCE | GaveUp.NO_ROOM:
                return self._defer(key, run.job.job_id, taken)
        return taken

    def settled(self, event: Settled) -> None:
        if self.gate is not None:
            self.gate.settled(event.message_id)

    def give(self, taken: Taken, *, release: bool = True) -> None:
        if release:
            self._leases.give(taken)
        else:
            self._leases.leave(taken)

    def _defer(self, key: str, job_id: str, why: GaveUp) -> Outcome:
        """Come back when a slot may be free for this job (its booking in the key's line):
        spread out, each return a likely start, so a long backlog costs few deliveries."""
        reason = (
            f"every slot of {key} stayed busy for {self._patience:g}s"
            if why is GaveUp.PATIENCE
            else f"every slot of {key} is busy and the pool's prefetch is taken by waiters"
        )
        try:
            delay = self._leases.come_back_in(key, job_id)
        except StoreError:
            delay = None  # backed off by the delivery attempt instead
        if delay is not None:
            delay = min(delay * random.uniform(1.0, 1.1), c.MAX_ACK_DEADLINE_SECONDS)
        return Deferred(reason, delay)

    def interrupted(self, run: Run) -> None:
        self._leases.interrupted(run)

    def close(self, timeout: float) -> None:
        self._leases.close(timeout)

    def take_in_run(self, key: str, run: Run | None, holder: str | None = None) -> Taken:
        """A slot for part of a running job (``ctx.slot``); raises ``Defer`` or
        ``LookupError`` as ``context.Slots.take`` says (``run`` None: it has ended)."""
        if SHARD_MARK in key:
            raise LookupError(f"concurrency key {key!r}: {NO_SHARD_MARK}")
        if self._leases.limits.of(key) is None:
            raise LookupError(f"no concurrency limit is declared for {key!r}")
        if run is None:
            raise Defer(f"gave up waiting for a slot of {key}: the run must stop", delay=0)
        try:
            taken = self._leases.take(key, run, self._patience, park=False, holder=holder or "")
        except StoreError as exc:
            raise Defer(f"slot store: {exc}") from exc
        if isinstance(taken, GaveUp):
            if taken is GaveUp.STOPPED:
                raise Defer(f"gave up waiting for a slot of {key}: the run must stop", delay=0)
            outcome = self._defer(key, run.job.job_id, taken)
            assert isinstance(outcome, Deferred)
            raise Defer(outcome.reason, delay=outcome.delay)
        return taken


class _RunSlots:
    """``context.Slots`` for one run."""

    __slots__ = ("_concurrency", "_run", "_taken", "tokens")

    def __init__(self, concurrency: Concurrency, run: Run) -> None:
        self._concurrency = concurrency
        self._run: Run | None = run
        self._taken: dict[int, Taken] = {}
        self.tokens: Mapping[str, int] = {}

    def end(self) -> None:
        """The run's chain has returned: forget the run (a handler still going after it
        gets no new slot; it can still give back what it took)."""
        self._run = None

    def take(self, key: str, holder: str | None = None) -> Lease:
        taken = self._concurrency.take_in_run(key, self._run, holder)
        self._taken[id(taken.lease)] = taken
        return taken.lease

    def give(self, lease: Lease, *, release: bool = True) -> None:
        self._concurrency.give(self._taken.pop(id(lease)), release=release)


@functools.cache
def _template(text: str) -> KeyTemplate:
    return KeyTemplate(text)
