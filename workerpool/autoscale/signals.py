"""What the fleet looks like now, from the fastest source that knows.

- Heartbeats (seconds old): what each live replica runs and holds but has not started. A
  replica whose pulls come back full holds ``prefetch`` messages waiting, so a saturated fleet
  shows demand beyond its slots and grows, without knowing how long the backlog is.
- A probe pull, only while the fleet is at zero: it wakes the fleet, and says how many
  messages at least wait, so the fleet wakes to the size they need. Each probe is a delivery
  of every message it touches, which a dead-letter policy counts, so it is asked once per
  wake-up: its finding stands, less what the fleet has taken since, and it is not asked again
  while it stands. It stands while no replica beats (they are starting, or exit at start: a
  bad deploy's crash loop must not probe the backlog into the dead-letter topic), then for
  ``probe_hold`` seconds at most. (Seeing arrivals without a delivery would need a
  subscription of the autoscaler's own on the topic, or Cloud Monitoring, minutes late.)
- Cloud Monitoring's backlog (minutes old) where it answers: the only source of the backlog's
  length while replicas run. Its point counts what replicas held then too, and what the fleet
  has taken since (``Taken``) is not waiting any more, so what it adds is its figure less both:
  a backlog drained since the point was taken adds nothing.
Draining replicas' work is left out of the demand: they are leaving, and it does not need new
replicas.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from workerpool.autoscale.policy import Signals
from workerpool.autoscale.probe import MOST_PER_PULL, Probe
from workerpool.autoscale.taken import Taken
from workerpool.heartbeats import Beat, HeartbeatStore
from workerpool.ops.monitoring import Backlog, BacklogReader

# How long a probe's finding stands, once replicas beat, for messages they have not taken:
# long enough for the rest of a fleet to start (a Kubernetes pod waiting for a new node takes
# minutes); bounded, so messages taken by someone else do not hold replicas for ever.
PROBE_HOLD = 180.0


@dataclass(frozen=True)
class Sighting:
    """Messages seen waiting (not held by any replica) at ``at``."""

    waiting: float
    at: float
    serving_from: float | None = None  # when a replica first beat after it


@dataclass(frozen=True)
class Observation:
    signals: Signals
    beats: list[Beat]  # live replicas' beats, draining ones included
    probed: int | None  # messages the probe saw this round (None: not asked, or it failed)
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
            parts.append(f"probe saw {self.probed}")
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
        max_replicas: int | None = None,
        probe_hold: float = PROBE_HOLD,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``slots_per_replica`` is used until a replica's beat says how many it has. A probe
        pulls as many messages as ``max_replicas`` replicas have slots (Pub/Sub's most per
        pull without it): more would not change the count, and each is a delivery."""
        self._subscription = subscription
        self._heartbeats = heartbeats
        self._probe = probe
        self._backlog = backlog
        self._slots = slots_per_replica
        self._max_replicas = max_replicas
        self._probe_hold = probe_hold
        self._clock = clock
        self._taken = Taken()
        self._found: Sighting | None = None  # the last probe's finding, while it stands

    def beats(self) -> list[Beat]:
        """The subscription's live beats now (``StoreError`` if the store cannot say)."""
        return self._heartbeats.live(self._subscription, self._clock())

    def read(self, current: int, beats: list[Beat] | None = None) -> Observation:
        """The signals, from ``beats`` (read now if not given) and the fleet's ``current``
        size."""
        now = self._clock()
        beats = self.beats() if beats is None else beats
        self._taken.update(now, beats)
        serving = [b for b in beats if not b.draining]
        if serving:
            self._slots = max(b.slots for b in serving)
        running = sum(b.running for b in serving)
        probed = None
        if current == 0 and self._found is None and self._probe is not None:
            probed = self._probe.count(self._probe_limit())
            if probed is not None:
                self._found = Sighting(probed, now) if probed else None
        self._hold(now, bool(serving))
        found = self._left(self._found)
        if not found:
            self._found = None  # the fleet has taken as many as the probe saw
        monitored = None if self._backlog is None else self._backlog.read()
        reported = self._left(self._unheld(monitored))
        busy = [b for b in serving if b.running]
        per_slot = sum(b.completed for b in busy) / running if running else 0.0
        signals = Signals(
            now=now,
            current=current,
            slots_per_replica=self._slots,
            in_flight=running,
            backlog=sum(b.waiting for b in serving) + max(found, reported),
            oldest_age=monitored.oldest_age if reported and monitored is not None else None,
            service_rate=per_slot or None,
        )
        return Observation(signals, beats, probed, monitored)

    def _hold(self, now: float, serving: bool) -> None:
        """Start the finding's ``probe_hold`` at the first beat after it; drop it after."""
        found = self._found
        if found is not None and found.serving_from is None and serving:
            self._found = found = Sighting(found.waiting, found.at, now)
        if found and found.serving_from is not None and now - found.serving_from > self._probe_hold:
            self._found = None

    def _probe_limit(self) -> int:
        if self._max_replicas is None:
            return MOST_PER_PULL
        return min(MOST_PER_PULL, self._max_replicas * self._slots)

    def _unheld(self, monitored: Backlog | None) -> Sighting | None:
        """What Monitoring's point says waited, not held by replicas, when it was taken; None
        if it cannot be told (no figure, no time, or taken before this reader watched)."""
        if monitored is None or monitored.undelivered is None or monitored.at is None:
            return None
        held = self._taken.held_at(monitored.at)
        return None if held is None else Sighting(monitored.undelivered - held, monitored.at)

    def _left(self, sighting: Sighting | None) -> int:
        """Of the messages seen waiting then, how many the fleet has not taken since."""
        if sighting is None:
            return 0
        taken = self._taken.since(sighting.at)
        return 0 if taken is None else max(0, round(sighting.waiting - taken))

    def close(self) -> None:
        self._heartbeats.close()
