"""What the fleet has taken off the subscription since a given moment, from its beats.

A count of waiting messages is only as good as its age: a probe's finding is seconds old by
the time the replicas it woke serve, Cloud Monitoring's point two to three minutes. Messages
counted then that the fleet has taken since (settled, or held now) are not waiting any more, so
what such a count still says is its figure less what was taken since it was taken.

Settled messages are counted from each replica's beats: a beat's rate times the time since
that replica's previous beat is what it settled in between; a replica whose beat is gone (a
drain ends when its runs do) settled the runs its last beat reported. Both slightly misjudge
(messages given back count as settled; a crashed replica's runs come back), and both err
towards less waiting, which the beats' own saturation corrects within a beat.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from workerpool.heartbeats import Beat

# Kept this long: Cloud Monitoring's points are read from the last 10 minutes.
REMEMBERED = 900.0


@dataclass(frozen=True)
class _Sample:
    at: float
    settled: float  # messages settled since the tally began
    held: int  # messages running or held by live replicas


class Taken:
    def __init__(self) -> None:
        self._last: dict[str, Beat] = {}  # each live replica's latest beat seen
        self._settled = 0.0
        self._samples: deque[_Sample] = deque()

    def update(self, now: float, beats: Sequence[Beat]) -> None:
        """Count what the beats say was settled since the last update, and remember now."""
        live = {b.replica: b for b in beats}
        for replica, gone in list(self._last.items()):
            if replica not in live:
                self._settled += gone.running
                del self._last[replica]
        for beat in beats:
            last = self._last.get(beat.replica)
            if last is not None and beat.at > last.at:
                self._settled += beat.completed * (beat.at - last.at)
            self._last[beat.replica] = beat
        held = sum(b.running + b.waiting for b in beats)
        self._samples.append(_Sample(now, self._settled, held))
        while self._samples[0].at < now - REMEMBERED:
            self._samples.popleft()

    def held_at(self, at: float) -> int | None:
        """Messages the replicas held at ``at``; None before the tally began."""
        sample = self._at(at)
        return None if sample is None else sample.held

    def since(self, at: float) -> float | None:
        """Messages taken off the subscription since ``at``: settled since, plus held now,
        less held then; None before the tally began."""
        then = self._at(at)
        if then is None:
            return None
        now = self._samples[-1]
        return now.settled - then.settled + now.held - then.held

    def _at(self, at: float) -> _Sample | None:
        """The latest sample at or before ``at``."""
        index = bisect_right(self._samples, at, key=lambda sample: sample.at)
        return self._samples[index - 1] if index else None
