"""The schedule: delayed messages by (topic, job id), each with when it is due and when it may
next be fired (``ready_at``: its due time, then, once a worker claimed it, the end of that
claim, so a worker that dies while publishing it leaves it to another)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    topic: str
    job_id: str
    due: float  # seconds since the epoch
    data: bytes
    attributes: dict[str, str]


class ScheduleStore(ABC):
    """Every method may raise ``StoreError``, and nothing else."""

    @abstractmethod
    def add(self, entry: Entry) -> bool:
        """Keep ``entry`` unless its (topic, job id) is there already (a message delivered
        twice is scheduled once); True if it was added."""

    @abstractmethod
    def claim_due(
        self, topic: str, now: float, lease: float, limit: int
    ) -> tuple[list[Entry], float | None]:
        """Up to ``limit`` of ``topic``'s entries ready at ``now``, oldest first, claimed for
        ``lease`` seconds; and when the next of the others is ready (None: there is none)."""

    @abstractmethod
    def fired(self, topic: str, job_ids: Sequence[str]) -> None:
        """The entries were published: remove them."""

    @abstractmethod
    def entries(self, topic: str | None = None, limit: int = 100) -> list[Entry]:
        """The soonest due entries (of ``topic``, if given), for ``workerpool schedule``."""

    @abstractmethod
    def close(self) -> None:
        """Release connections; the store must not be used afterwards."""
