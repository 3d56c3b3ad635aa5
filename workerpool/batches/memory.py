"""The batches of one process, for tests and the in-process worker."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import replace

from workerpool.batches.store import PENDING, Batch, BatchStore, T, Tally, Transaction


class _Tables:
    """A batch's counts are in its record: its one tally."""

    def __init__(self) -> None:
        self.records: dict[str, Batch] = {}
        self.ledger: dict[str, dict[str, str]] = {}

    def batch(self, batch_id: str) -> Batch | None:
        return self.records.get(batch_id)

    def put_batch(self, batch: Batch) -> None:
        self.records[batch.batch_id] = batch

    def batches(self, limit: int) -> list[Batch]:
        return sorted(self.records.values(), key=lambda b: (b.deadline, b.batch_id))[:limit]

    def child(self, batch_id: str, job_id: str) -> tuple[str, Tally] | None:
        outcome = self.ledger.get(batch_id, {}).get(job_id)
        batch = self.records.get(batch_id)
        return None if outcome is None or batch is None else (outcome, Tally.of(batch))

    def put_child(self, batch_id: str, job_id: str, outcome: str, tally: Tally) -> None:
        self.ledger[batch_id][job_id] = outcome
        batch = self.records[batch_id]
        self.records[batch_id] = replace(batch, done=tally.done, failed=tally.failed)

    def tally(self, batch: Batch) -> Tally:
        return Tally.of(batch)

    def add_children(self, batch: Batch, job_ids: Sequence[str]) -> None:
        self.ledger.setdefault(batch.batch_id, {}).update(dict.fromkeys(job_ids, PENDING))

    def has_children(self, batch_id: str, job_ids: Sequence[str]) -> bool:
        return set(job_ids) <= self.ledger.get(batch_id, {}).keys()

    def unsent(self, limit: int) -> list[Batch]:
        return [b for b in self.batches(len(self.records)) if b.unsent][:limit]

    def children(self, batch_id: str, outcome: str, limit: int) -> list[str]:
        chosen = sorted(j for j, o in self.ledger.get(batch_id, {}).items() if o == outcome)
        return chosen[:limit]

    def count_children(self, batch_id: str, outcome: str) -> int:
        return sum(o == outcome for o in self.ledger.get(batch_id, {}).values())


class MemoryBatches(BatchStore):
    def __init__(self) -> None:
        self._tables = _Tables()
        self._lock = threading.Lock()

    def _atomic(self, body: Callable[[Transaction], T]) -> T:
        with self._lock:
            return body(self._tables)

    def purge(self) -> None:
        pass  # the process's own: gone with it

    def close(self) -> None:
        pass
