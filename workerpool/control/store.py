"""Cancels: one record per cancelled job id, in the store the fleet shares, kept as long as
completions are (``DEFAULT_RETENTION``), so a cancel reaches whatever replica holds the job,
and one given while no worker is up is honoured when they start."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass

# How long after it is written a cancel is sure to be seen by any run about to start: a worker
# starts a job only after a read of its cancel that began at most this long before, and
# ``workerpool.cancel`` returns only once this long has passed since it wrote. The periodic
# read of every job a worker holds (once a second) serves most starts, so a start reads the
# store itself only when that read is late.
SEEN_WITHIN = 1.5


@dataclass(frozen=True)
class Cancel:
    """A job id cancelled, why (may be empty), and when (wall time, seconds since the epoch)."""

    job_id: str
    reason: str
    at: float


class CancelStore(ABC):
    """Every method may raise ``StoreError``, and nothing else."""

    def __init__(self, *, retention: float) -> None:
        self.retention = retention

    @abstractmethod
    def add(self, cancel: Cancel) -> Cancel:
        """Record ``cancel`` unless its job id has a live one; the record kept (the first)."""

    @abstractmethod
    def find(self, job_ids: Collection[str], now: float) -> dict[str, Cancel]:
        """The live cancels of these job ids, by job id: one read for them all."""

    @abstractmethod
    def close(self) -> None:
        """Release connections; the store must not be used afterwards."""

    def live(self, cancel: Cancel, now: float) -> bool:
        return cancel.at + self.retention > now
