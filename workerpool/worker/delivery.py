"""One received message and its lease, as the pool tracks it from pull to ack."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum


class _State(Enum):
    HELD = "held"  # leased to us; nobody has decided its fate yet
    SETTLING = "settling"  # its own run owns it and is publishing its failure record
    RECORDED = "recorded"  # its failure record is out: only its own run may settle it now
    SETTLED = "settled"  # its ack or nack is queued: nothing else may be sent for it


@dataclass(eq=False)
class Delivery:
    """A message leased to this worker.

    Exactly one ack or nack is ever queued for it, by whoever moves it to SETTLED first: its
    run's own end, or a hand-back (drain deadline, a lost claim). Until then its lease is
    extended, also while its run publishes a failure record (SETTLING) and then tells the
    middleware it is out (RECORDED), so a slow publish cannot let it be redelivered
    meanwhile.
    """

    ack_id: str
    message_id: str
    data: bytes
    attributes: dict[str, str]
    # When Pub/Sub published it, in POSIX seconds to the microsecond (a ``datetime`` only
    # for the handler's ``ctx.publish_time``: made from the protobuf for every message, it
    # cost 2 us of the puller's, a float 0.6, measured).
    published: float | None
    delivery_attempt: int | None
    ordering_key: str = ""
    # Monotonic time after which the lease is no longer extended (set from the job's timeout).
    lease_until: float = float("inf")
    # Its one settle was a nack, or a hand-back took it (which nacks it, or on its last
    # delivery publishes a copy in its place): Pub/Sub delivers it again (and, on an ordered
    # subscription, every later message of its key after it).
    returned: bool = False
    _state: _State = _State.HELD
    # A hand-back took it and is not done yet (``take_back`` to ``handed_back``); and what its
    # run's end left to do once it is (``leave_after``).
    _handing_back: bool = False
    _after_hand_back: Callable[[Delivery], None] | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.size = len(self.data) + sum(len(k) + len(v) for k, v in self.attributes.items())

    # What it counts against max_bytes, read twice a message (admitted, settled): made once.
    size: int = field(init=False)

    @property
    def settled(self) -> bool:
        return self._state is _State.SETTLED

    def take(self) -> bool:
        """HELD -> SETTLED: True if the caller now must queue this message's one ack or nack."""
        return self._move((_State.HELD,), _State.SETTLED)

    def take_back(self) -> bool:
        """``take``, for a hand-back: ``returned`` is set with the move, so a run that ends on
        its own and finds the message taken reads it so (its key's next must not start).
        The hand-back calls ``handed_back`` once it is done."""
        return self._move((_State.HELD,), _State.SETTLED, taken_back=True)

    def handed_back(self) -> Callable[[Delivery], None] | None:
        """The hand-back is done (its nack or copy queued, or it failed): what the run's end
        left for then, if it has ended (``leave_after``)."""
        with self._lock:
            self._handing_back = False
            after, self._after_hand_back = self._after_hand_back, None
            return after

    def leave_after(self, then: Callable[[Delivery], None]) -> bool:
        """For a run that ended on a message a hand-back took: True if ``then`` is left to
        be called with it once the hand-back is done; False if it is (call it now). On an ordered
        subscription the key's later messages go back in ``then``: given back first, they
        could be published again before this one's copy."""
        with self._lock:
            if not self._handing_back:
                return False
            self._after_hand_back = then
            return True

    def begin_settle(self) -> bool:
        """HELD -> SETTLING, for a run about to publish its failure record: a hand-back leaves
        it alone from now on (only ``force`` can still take it)."""
        return self._move((_State.HELD,), _State.SETTLING)

    def recorded(self) -> bool:
        """SETTLING -> RECORDED, once its failure record is out: False if ``force`` took it
        meanwhile (then send nothing). From here on nothing but its run settles it."""
        return self._move((_State.SETTLING,), _State.RECORDED)

    def finish_settle(self) -> bool:
        """SETTLING or RECORDED -> SETTLED: False if ``force`` took it meanwhile (then send
        nothing)."""
        return self._move((_State.SETTLING, _State.RECORDED), _State.SETTLED)

    def force(self) -> bool:
        """HELD or SETTLING -> SETTLED, at the end of a drain: nothing may outlive it (but a
        message whose failure record is out, RECORDED: its run acks it next)."""
        return self._move((_State.HELD, _State.SETTLING), _State.SETTLED)

    def _move(
        self, sources: tuple[_State, ...], target: _State, *, taken_back: bool = False
    ) -> bool:
        with self._lock:
            if self._state not in sources:
                return False
            self._state = target
            if taken_back:
                self.returned = self._handing_back = True
            return True
