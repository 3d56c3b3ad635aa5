"""The pull loop: ask Pub/Sub for exactly as many messages as the pool has room for.

On the emulator, google-cloud-pubsub's StreamingPull client held hundreds of leased messages
even with ``FlowControl(max_messages=1)`` and kept only 0.80-0.84 of N slots busy (see
BENCHMARKS.md), so this loop owns the intake over the same library's unary ``pull``: it
never holds more than N + prefetch.
Connection failures are retried with capped, jittered backoff; the loop never exits on them.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Sequence
from typing import Any, Protocol

from google.api_core import exceptions as gexc

from workerpool.worker.delivery import Delivery
from workerpool.worker.pool import Pool
from workerpool.worker.rpc import subscriber_rpc

log = logging.getLogger(__name__)


def to_delivery(received: Any) -> Delivery:
    """A ``ReceivedMessage`` of the protobuf runtime, not the client's proto-plus one (reading
    its fields through proto-plus cost 26 us a message, measured, reading them here 3 us)."""
    message = received.message
    attributes = message.attributes
    published = None
    if message.HasField("publish_time"):
        stamp = message.publish_time  # its nanoseconds cut to microseconds, as ToDatetime does
        published = stamp.seconds + stamp.nanos // 1000 / 1e6
    return Delivery(
        ack_id=received.ack_id,
        message_id=message.message_id,
        data=message.data,
        # A comprehension, not dict(): the protobuf map is no Mapping of C, so dict() reads
        # it through the abc's Python keys view (0.43 against 0.89 us a message, measured).
        attributes={key: attributes[key] for key in attributes},
        published=published,
        delivery_attempt=received.delivery_attempt or None,
        ordering_key=message.ordering_key,
    )


class Gate(Protocol):
    """Bounds a pull further than the pool's room: a pool that declares a concurrency key
    pulls only for slots of it that it holds (``slots.gate.PoolGate``)."""

    def reserve(self, room: int, timeout: float, stop: threading.Event) -> int:
        """How many of ``room`` messages may be pulled now (0 after ``timeout`` or ``stop``)."""
        ...

    def bind(self, deliveries: Sequence[Delivery]) -> None:
        """What the pull brought (nothing, if it failed), before the pool admits it."""
        ...


class Puller:
    def __init__(
        self,
        client: Any,
        subscription: str,
        pool: Pool,
        *,
        gate: Gate | None = None,
        pull_timeout: float = 2.0,
        max_backoff: float = 10.0,
    ) -> None:
        self._rpc = subscriber_rpc(client, subscription)
        self._pool = pool
        self._gate = gate
        self._pull_timeout = pull_timeout
        self._max_backoff = max_backoff
        self._failures = 0
        self._stop = threading.Event()
        self.healthy = threading.Event()
        # The last pull brought all it asked for: more messages may be waiting (a heartbeat
        # tells the autoscaler).
        self.saturated = False
        self._thread = threading.Thread(target=self._run, name="workerpool-puller", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """Stop pulling; a pull already in flight is waited for so nothing it brings is lost."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        gate = self._gate
        while not self._stop.is_set():
            # A gated pool pulls only what can start at once: each message comes with its slot.
            room = self._pool.wait_for_room(timeout=0.5, startable=gate is not None)
            if room and gate is not None:
                room = gate.reserve(room, timeout=0.5, stop=self._stop)
            if room == 0:
                continue
            received = self._pull(room)
            self.saturated = len(received) >= room
            try:
                deliveries = [to_delivery(r) for r in received]
            except Exception:  # a bug; those messages come back after their lease
                log.exception("reading %d pulled messages failed", len(received))
                self.healthy.clear()
                deliveries = []
            if gate is not None:
                gate.bind(deliveries)
            if deliveries:
                # admit() gives back at once anything beyond the bound, including all of it
                # once the pool is quiet.
                try:
                    self._pool.admit(deliveries)
                except Exception:  # a bug; what was not admitted comes back after its lease
                    log.exception("admitting %d messages failed", len(deliveries))
                    self.healthy.clear()

    def _pull(self, room: int) -> list[Any]:
        """Up to ``room`` received messages; none when the pull failed or nothing came."""
        try:
            # The emulator answers an idle pull with an empty response just before the
            # call's deadline, so a short deadline bounds how long a drain waits for it.
            # Never retried by the client: this loop owns retries (logged, backed off, never
            # past a drain); its default policy silently retried a stopped emulator for ~50 s.
            received = self._rpc.pull(room, self._pull_timeout)
        except gexc.DeadlineExceeded:
            # Nothing arrived in time: not a failure. An idle subscription may answer
            # every pull this way, and /healthz must not fail an idle worker for it.
            self.healthy.set()
            return []
        except Exception as exc:
            # Anything (NotFound after an emulator restart, PermissionDenied while IAM
            # propagates, ...) is logged and retried with backoff: the loop never dies
            # silently, and /healthz reports it unhealthy meanwhile.
            self._failures += 1
            self.healthy.clear()
            delay = min(self._max_backoff, 0.1 * 2 ** min(self._failures, 16))
            delay *= random.uniform(0.5, 1.0)
            log.warning("pull failed (%s); retrying in %.1fs", type(exc).__name__, delay)
            self._stop.wait(delay)
            return []
        self._failures = 0
        self.healthy.set()
        return list(received)
