"""This replica's heartbeat: every few seconds, what its pool runs and holds, written to the
store the fleet shares, where the autoscaler reads it.

It is not on the data path: a store that cannot take a beat is logged once per outage and
costs the jobs nothing (the autoscaler then sees the replica lapse, and keeps it, since the
actuator still counts it). A drain writes a beat at once (the autoscaler stops counting the
replica's slots), and a clean exit removes the beat.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping

from workerpool.heartbeats import Beat, HeartbeatStore
from workerpool.stores import StoreError
from workerpool.worker.pool import Pool

log = logging.getLogger(__name__)

# A beat lapses after this many intervals without a new one: one lost write is not a death.
LAPSE_AFTER = 3


class Heartbeat:
    def __init__(
        self,
        store: HeartbeatStore,
        *,
        replica: str,
        subscription: str,
        pool: Pool,
        settled: Mapping[str, int],
        saturated: Callable[[], bool],
        interval: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._replica = replica
        self._subscription = subscription
        self._pool = pool
        self._settled = settled
        self._saturated = saturated
        self._interval = interval
        self._clock = clock
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._failing = False
        self._last: tuple[float, int] | None = None  # (when, messages settled by then)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="workerpool-heartbeat", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        """Beat now, not at the next interval (the pool started draining)."""
        self._wake.set()

    def close(self, timeout: float) -> None:
        """Stop beating and remove this replica's beat, within ``timeout`` seconds."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        try:
            self._store.gone(self._replica)
        except StoreError as exc:
            log.warning(
                "heartbeat of %s not removed (%s); it lapses on its own", self._replica, exc
            )
        finally:
            self._store.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._send()
            self._wake.wait(self._interval)
            self._wake.clear()

    def _send(self) -> None:
        try:
            self._store.beat(self.current())
        except StoreError as exc:
            if not self._failing:
                log.warning("heartbeat not written (%s); trying again every beat", exc)
            self._failing = True
            return
        if self._failing:
            log.info("heartbeat written again")
        self._failing = False

    def current(self) -> Beat:
        now = self._clock()
        settled = sum(self._settled.values())
        rate = 0.0
        if self._last is not None and now > self._last[0]:
            rate = (settled - self._last[1]) / (now - self._last[0])
        self._last = (now, settled)
        running = self._pool.running
        return Beat(
            replica=self._replica,
            subscription=self._subscription,
            host=socket.gethostname(),
            pid=os.getpid(),
            slots=self._pool.limits.max_outstanding,
            running=running,
            waiting=max(0, self._pool.held - running),
            completed=rate,
            saturated=self._saturated(),
            draining=self._pool.quieted,
            at=now,
            until=now + LAPSE_AFTER * self._interval,
        )
