"""What the autoscaler acts on, and what it knows of each replica.

A ``Beat`` is one replica's heartbeat, written by the worker to the store the fleet shares and
read back by the autoscaler: what it runs now, what it holds, whether it is draining. An
``Actuator`` changes the fleet's size (local processes, a Kubernetes Deployment, a Cloud Run
worker pool); it is told the replicas' beats so that a scale-in can spare busy replicas.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from workerpool.heartbeats.store import Beat

__all__ = ["Actuator", "Beat", "least_busy"]


class Actuator(ABC):
    """Changes the number of replicas. Implementations never stop a replica that runs work
    when an idle one can go instead, and say in ``scale``'s answer what they did."""

    name: str = ""

    @abstractmethod
    def current(self) -> int:
        """Replicas there are now, starting ones included, draining ones not."""

    @abstractmethod
    def scale(self, desired: int, beats: Sequence[Beat]) -> str:
        """Move the fleet to ``desired`` replicas, knowing each live replica's beat; return
        one line saying what was done (logged with the decision)."""

    def tend(self, beats: Sequence[Beat] | None) -> str:
        """Called every round before ``current``, with the live beats (None: unreadable):
        look after the replicas (restart those due); return what was done, or ""."""
        return ""

    def exits_at_start(self) -> int:
        """Replicas that have exited before their first beat so far (a crash loop)."""
        return 0

    def close(self) -> None:
        """Release clients; a process actuator leaves its replicas to drain on their own."""
        return None


def least_busy(beats: Sequence[Beat], count: int) -> list[Beat]:
    """The ``count`` replicas to remove first: not draining already, fewest jobs running,
    then fewest held (ties broken by name, so the choice is stable)."""
    candidates = sorted(
        (b for b in beats if not b.draining), key=lambda b: (b.running, b.waiting, b.replica)
    )
    return candidates[:count]
