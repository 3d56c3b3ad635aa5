"""Heartbeats: one record per replica, rewritten every few seconds while it runs, lapsing when
it stops being rewritten (its replica died). The autoscaler reads them as its fast signal: what
each replica runs and holds now, seconds old, where Cloud Monitoring's backlog is minutes old.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass

from workerpool.stores import known_fields


@dataclass(frozen=True)
class Beat:
    """One replica's heartbeat. ``replica`` is the worker id (``host-pid-random``); ``host``
    is its host name (a pod's name on Kubernetes)."""

    replica: str
    subscription: str  # the full path of the subscription it pulls
    host: str
    pid: int
    slots: int  # its max_outstanding
    running: int  # jobs running now
    waiting: int  # messages held and not started yet
    completed: float  # jobs settled per second, recently
    saturated: bool  # its last pull filled every free place: more may be waiting
    draining: bool
    at: float  # wall time of the beat
    until: float  # the beat lapses then (its replica died) unless renewed


def encode(beat: Beat) -> str:
    return json.dumps(asdict(beat))


def decode(text: str) -> Beat:
    return known_fields(Beat, json.loads(text))


# A beat this long past its ``until`` is deleted by whoever reads it: its replica is gone, and
# nobody else would remove it (a clean exit removes its own).
FORGET_AFTER = 3600.0


class HeartbeatStore(ABC):
    """Every method may raise ``StoreError``, and nothing else."""

    @abstractmethod
    def beat(self, beat: Beat) -> None:
        """Write the replica's beat over its last one."""

    @abstractmethod
    def gone(self, replica: str) -> None:
        """The replica stopped cleanly: remove its beat at once."""

    @abstractmethod
    def live(self, subscription: str, now: float) -> list[Beat]:
        """The beats of ``subscription``'s replicas that have not lapsed at ``now``, by
        replica; beats lapsed long ago are removed on the way."""

    @abstractmethod
    def close(self) -> None:
        """Release connections; the store must not be used afterwards."""
