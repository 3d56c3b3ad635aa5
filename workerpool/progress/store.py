"""What a job's runs leave in the store the fleet shares: its last checkpoint (kept until the
job finishes, for the next run of its job id) and each running job's progress (rewritten while
it runs, lapsing when its replica stops rewriting it)."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from workerpool.stores import known_fields

# A checkpoint is a job's own resume point (a cursor, a page token, the last row done), not
# its data: a bound keeps one within a Firestore document (1 MiB) and an SQLite row cheap.
MAX_CHECKPOINT_BYTES = 64 * 1024

# A progress record this long past its ``until`` is deleted by whoever reads it: its replica
# died, and nobody else would remove it (a run that ends removes its own).
FORGET_AFTER = 3600.0


@dataclass(frozen=True)
class Report:
    """One running job as ``workerpool status --running`` shows it. ``key`` names the run
    (its replica and job id); ``started`` and ``at`` are wall times."""

    key: str
    job: str
    job_id: str
    replica: str
    started: float
    done: float | None  # None: the job has reported no progress yet
    total: float | None
    note: str
    at: float  # when it was written
    until: float  # it lapses then (its replica died) unless written again


def encode(report: Report) -> str:
    return json.dumps(asdict(report))


def decode(text: str) -> Report:
    return known_fields(Report, json.loads(text))


class JobStateStore(ABC):
    """Every method may raise ``StoreError``, and nothing else."""

    @abstractmethod
    def save(self, job_id: str, state: str, at: float) -> None:
        """Keep ``state`` (JSON text) as ``job_id``'s checkpoint, over any earlier one; durable
        once this returns."""

    @abstractmethod
    def load(self, job_id: str) -> str | None:
        """``job_id``'s checkpoint (JSON text), None if it has none."""

    @abstractmethod
    def load_many(self, job_ids: Sequence[str]) -> dict[str, str]:
        """The checkpoints of those of these job ids that have one, by job id: one read."""

    @abstractmethod
    def forget(self, job_ids: Sequence[str]) -> None:
        """Delete the checkpoints of these job ids (their jobs finished)."""

    @abstractmethod
    def report(self, reports: Sequence[Report]) -> None:
        """Write these runs' progress over what each had."""

    @abstractmethod
    def ended(self, keys: Sequence[str]) -> None:
        """These runs ended: remove their progress."""

    @abstractmethod
    def running(self, now: float) -> list[Report]:
        """The progress of every run that has not lapsed at ``now``, oldest first; records
        lapsed long ago are removed on the way."""

    @abstractmethod
    def close(self) -> None:
        """Release connections; the store must not be used afterwards."""
