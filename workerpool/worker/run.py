"""One run of a job, as it travels down the middleware chain, and how a message left the pool.

``Run`` is the one object every middleware gets (Temporal-interceptor style: an input object
and a ``next``), so a field added here changes no middleware's signature. Its ``Permit`` is
its right to run, one of the pool's N. ``Settled`` is what
every middleware hears once per message that leaves the pool, run or not.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from opentelemetry.trace import INVALID_SPAN, Span

from workerpool.constants import Label
from workerpool.context import RunContext
from workerpool.worker.delivery import Delivery
from workerpool.worker.envelope import Job

if TYPE_CHECKING:
    from workerpool.worker.outcome import Outcome


class Permit(Protocol):
    """The right to run that a run holds, one of the pool's N. A run that must wait before
    its handler starts (for a concurrency slot) puts it down, so another message may run
    meanwhile, and picks it up again before it goes on."""

    def put_down(self) -> bool:
        """Wait without the permit; False if there is no room to wait (the caller gives up)."""
        ...

    def pick_up(self) -> bool:
        """Take a permit back, waiting for one; False once the pool drains."""
        ...

    def start_when_held(self, start: Callable[[bool], None]) -> None:
        """Call ``start(True)`` once the run holds a permit: now if it does, else (an async
        run made ready ahead, without one) on the thread that frees one for it; or
        ``start(False)`` if the pool drains first and the run must not start."""
        ...


class Unparkable:
    """The permit of a run outside a pool: it never waits without it."""

    def put_down(self) -> bool:
        return False

    def pick_up(self) -> bool:
        return True

    def start_when_held(self, start: Callable[[bool], None]) -> None:
        start(True)


UNPARKABLE: Permit = Unparkable()


class Lease(Protocol):
    """A store lease a run holds (its idempotency claim, a concurrency slot: ``keeper.Held``)."""

    what: str  # "claim", "slot": for log lines

    def lapsed(self, now: float) -> bool:
        """Whether another may hold it by ``now`` (the monotonic clock)."""
        ...


class Recording(Protocol):
    """Records a run's completion durably, then tells ``then`` how that went: Succeeded, or
    why not. ``awaited``: something waits for the answer (a slot's exactly-once ack or batch
    child, the next message of an ordering key), so it is recorded without waiting for other
    completions to share its write."""

    def __call__(self, then: Callable[[Outcome], None], *, awaited: bool = False) -> None: ...


def recorded_now(completion: Recording) -> Outcome:
    """Record ``completion`` without waiting for others to share its write, and return how
    that went (Succeeded, or why not), waited for on this thread."""
    answered = threading.Event()
    heard: list[Outcome] = []

    def answer(result: Outcome) -> None:
        heard.append(result)
        answered.set()

    completion(answer, awaited=True)
    answered.wait()
    return heard[0]


@dataclass(eq=False)
class Run:
    job: Job
    ctx: RunContext
    delivery: Delivery
    # Hands the message back now with the given outcome, while the handler may still run.
    _hand_back: Callable[[Run, Outcome], bool] = field(repr=False)
    started_at: float = field(default_factory=time.monotonic)
    # Since when an async run made ready ahead waits for a permit (None: it is not waiting).
    # Its start moves ``started_at`` on by the wait, so its timeout and duration leave it out.
    waiting_since: float | None = None
    # The run's span while it is traced (the tracing middleware sets it), for log lines too.
    span: Span = INVALID_SPAN
    # What the chain returned, once it has.
    outcome: Outcome | None = None
    permit: Permit = UNPARKABLE
    # How many earlier runs of this job id failed, as the idempotency store counts them (None:
    # not known, and Pub/Sub's delivery attempt, which counts deferrals too, stands in).
    failures: int | None = None
    # Set by a middleware whose record of the run's success must be durable before its
    # message is acked (the idempotency store's completion), to record it off the slot
    # thread: called once the chain has returned, with what to do once recorded (Succeeded)
    # or not (why). The message stays held meanwhile. An outer middleware that must follow
    # the record (a batch child's ledger) records it itself, waiting, and sets it None.
    completion: Recording | None = None
    # Its handler has returned or raised (or will never start): the chain unwinds from here,
    # and each middleware lets go of what it holds for the run on its way out. A hand-back
    # from now on must not take that decision from it: a claim released before the
    # idempotency middleware records the job done would let another worker run it again.
    handler_returned: bool = False
    # When the claim the run holds on its job id was granted, or later (``time.monotonic``;
    # None: no claim). What was read of the job before then may be older than what another
    # worker, holding the claim meanwhile, wrote since (a checkpoint read with the pull).
    claimed_at: float | None = None
    # The store leases it holds now (kept by ``keeper.LeaseKeeper``), and what it held that
    # had lapsed when it was let go ("": none): see ``lost_lease``.
    leases: list[Lease] = field(default_factory=list)
    lapsed: str = ""

    def lost_lease(self, now: float) -> str:
        """What lease of the run ("claim", "slot") lapsed while the run held it, by ``now``
        (the monotonic clock), or "". A process paused past its lease (a GC pause, a frozen
        VM) may have overlapped the lease's next holder: such a run must not settle its job
        as the owner."""
        if self.lapsed:
            return self.lapsed
        for lease in list(self.leases):  # (another thread's keeper may change it meanwhile)
            if lease.lapsed(now):
                return lease.what
        return ""

    def hand_back(self, outcome: Outcome) -> bool:
        """Cancel this run and settle its message now with ``outcome`` (a lost claim, say);
        False if its message was already settled. The handler sees ``ctx.cancelled``."""
        return self._hand_back(self, outcome)


# Frozen, and made once a message: its own ``__init__`` fills the instance's dict in one
# call, where a frozen dataclass's sets each field through ``object.__setattr__`` (measured:
# 1.55 -> 0.82 us a message). Assigning to a field still raises ``FrozenInstanceError``.
@dataclass(frozen=True, init=False)
class Settled:
    """How one message left the pool: its ``label``, and its run if it had one."""

    label: Label
    job: str
    job_id: str
    message_id: str
    attempt: int
    # The run, None for a message that never ran (bad input, given back unstarted).
    run: Run | None = None
    # Why it was dead-lettered (``error_type`` of the failure record), else "".
    error_type: str = ""
    settled_at: float = field(default_factory=time.monotonic)
    # The message's attributes (its batch, say), as it came.
    attributes: Mapping[str, str] = field(default_factory=dict)
    # Which delivery of the message this was (a redelivery has an ack id of its own).
    ack_id: str = ""
    # On the last delivery its subscription's dead-letter policy allows, it was published
    # again as a fresh copy before its ack (``label`` still says why it had to come back).
    renewed: bool = False

    def __init__(
        self,
        label: Label,
        job: str,
        job_id: str,
        message_id: str,
        attempt: int,
        run: Run | None = None,
        error_type: str = "",
        settled_at: float | None = None,
        attributes: Mapping[str, str] | None = None,
        ack_id: str = "",
        renewed: bool = False,
    ) -> None:
        """The fields in their order; ``settled_at`` is now and ``attributes`` empty unless
        given."""
        self.__dict__.update(
            label=label, job=job, job_id=job_id, message_id=message_id, attempt=attempt,
            run=run, error_type=error_type,
            settled_at=time.monotonic() if settled_at is None else settled_at,
            attributes={} if attributes is None else attributes, ack_id=ack_id,
            renewed=renewed,
        )  # fmt: skip

    @property
    def duration(self) -> float | None:
        """Seconds from the start of its run to its settlement; None if it never ran."""
        return None if self.run is None else self.settled_at - self.run.started_at
