"""What the fleet looks like now, from the fastest source that knows.

- Heartbeats (seconds old): what each live replica runs and holds but has not started. A
  replica whose pulls come back full holds ``prefetch`` messages waiting, so a saturated fleet
  shows demand beyond its slots and grows, without knowing how long the backlog is.
- A probe pull, only while no replica serves: the one signal that wakes a fleet at zero.
- Cloud Monitoring's backlog (minutes old) where it answers: the only source of the backlog's
  length while replicas run. It counts the messages replicas hold too, so what it adds is the
  undelivered count beyond them.
Draining replicas' work is left out: they are leaving, and it does not need new replicas.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from workerpool.autoscale.policy import Signals
from workerpool.autoscale.probe import Probe
from workerpool.heartbeats import Beat, HeartbeatStore
from workerpool.ops.monitoring import Backlog, BacklogReader


@dataclass(frozen=True)
class Observation:
    signals: Signals
    beats: list[Beat]  # live replicas' beats, draining ones included
    probed: bool | None  # what the probe saw (None: not asked, or it failed)
    monitored: Backlog | None

    def summary(self) -> str:
        """The signals in one line, for the decision log."""
        s = self.signals
        parts = [
            f"replicas {s.current}",
            f"beating {sum(not b.draining for b in self.beats)}",
            f"draining {sum(b.draining for b in self.beats)}",
            f"running {s.in_flight}",
            f"waiting {s.backlog}",
        ]
        if self.probed is not None:
            parts.append(f"probe {'saw a message' if self.probed else 'saw none'}")
        if self.monitored is not None:
            parts.append(f"monitoring backlog {self.monitored.undelivered}")
        return ", ".join(parts)


class SignalReader:
    def __init__(
        self,
        subscription: str,
        heartbeats: HeartbeatStore,
        *,
        probe: Probe | None,
        backlog: BacklogReader | None,
        slots_per_replica: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``slots_per_replica`` is used until a replica's beat says how many it has."""
        self._subscription = subscription
        self._heartbeats = heartbeats
        self._probe = probe
        self._backlog = backlog
        self._slots = slots_per_replica
        self._clock = clock

    def read(self, current: int) -> Observation:
        now = self._clock()
        beats = self._heartbeats.live(self._subscription, now)
        serving = [b for b in beats if not b.draining]
        if serving:
            self._slots = max(b.slots for b in serving)
        running = sum(b.running for b in serving)
        waiting = sum(b.waiting for b in serving)
        probed = None
        if not serving and self._probe is not None:
            probed = self._probe.waiting()
            if probed:
                waiting = max(waiting, 1)
        monitored = None if self._backlog is None else self._backlog.read()
        if monitored is not None and monitored.undelivered is not None:
            held = sum(b.running + b.waiting for b in serving)
            waiting = max(waiting, int(monitored.undelivered) - held)
        busy = [b for b in serving if b.running]
        per_slot = sum(b.completed for b in busy) / running if running else 0.0
        signals = Signals(
            now=now,
            current=current,
            slots_per_replica=self._slots,
            in_flight=running,
            backlog=waiting,
            oldest_age=None if monitored is None else monitored.oldest_age,
            service_rate=per_slot or None,
        )
        return Observation(signals, beats, probed, monitored)

    def close(self) -> None:
        self._heartbeats.close()
