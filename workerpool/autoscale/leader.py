"""Which autoscaler of a subscription acts: the one holding its lease, renewed every round.

Two autoscalers of one subscription (a second started by mistake, or a new one while the old
one's host hangs) would each size the fleet to the max: twice the max. Each round an
autoscaler claims the subscription's lease in the store the fleet shares; the holder acts, the
others stand by (said once) and take over within the lease's TTL once the holder stops
renewing (a clean stop releases it at once). The fencing token grows with each new holder: a
holder paused past its TTL and taken over gets back another holder's lease, and stops acting.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime

from workerpool.leadership import LeadershipStore, Lease, Noted
from workerpool.stores import StoreError

log = logging.getLogger(__name__)

# Long enough for a round's work (a probe, a store read, starting processes) many times over;
# short enough that a fleet is not left without an autoscaler for long.
LEASE_TTL = 15.0


class Leader:
    def __init__(
        self,
        store: LeadershipStore,
        name: str,
        *,
        ttl: float = LEASE_TTL,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._name = name
        self._ttl = ttl
        self._clock = clock
        self.holder = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._seen: Lease | None = None  # the lease as the last claim left it
        self._failing = False

    def active(self) -> bool:
        """Claim the lease; True if this autoscaler holds it now (the round may act)."""
        try:
            lease = self._store.claim(self._name, self.holder, self._clock(), self._ttl)
        except StoreError as exc:
            if not self._failing:
                log.warning("leadership of %s unreadable (%s): not acting", self._name, exc)
            self._failing = True
            return False
        self._failing = False
        last, self._seen = self._seen, lease
        if lease.holder == self.holder:
            if last is None or (last.holder, last.token) != (lease.holder, lease.token):
                log.info("autoscaler %s leads %s (token %d)", self.holder, self._name, lease.token)
            return True
        if last is None or (last.holder, last.token) != (lease.holder, lease.token):
            until = datetime.fromtimestamp(lease.until, UTC).strftime("%H:%M:%S")
            log.info(
                "standing by: autoscaler %s leads %s (token %d, lease until %s UTC)",
                lease.holder, self._name, lease.token, until,
            )  # fmt: skip
        return False

    def note(self, noted: Noted) -> None:
        """Keep a decision beside the lease, for the dashboard; one that cannot be written is
        a warning (the decision stands, only its record is lost)."""
        try:
            self._store.note(self._name, noted)
        except StoreError as exc:
            log.warning("could not keep the decision on %s: %s", self._name, exc)

    def close(self) -> None:
        """Give the lease up (a standby takes over at its next round), then close the store."""
        try:
            if self._seen is not None and self._seen.holder == self.holder:
                self._store.release(self._name, self.holder)
        except StoreError as exc:  # the standby takes over when the TTL runs out instead
            log.warning("could not release the lead of %s: %s", self._name, exc)
        finally:
            self._store.close()
