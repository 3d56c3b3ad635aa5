"""The batches of one process, for tests and the in-process worker."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from workerpool.batches.store import Batch, BatchStore, Transaction


class _Tables:
    def __init__(self) -> None:
        self.batches: dict[str, Batch] = {}
        self.ledger: dict[str, dict[str, str]] = {}

    def batch(self, batch_id: str) -> Batch | None:
        return self.batches.get(batch_id)

    def put_batch(self, batch: Batch) -> None:
        self.batches[batch.batch_id] = batch

    def outcome(self, batch_id: str, job_id: str) -> str | None:
        return self.ledger.get(batch_id, {}).get(job_id)

    def put_outcome(self, batch_id: str, job_id: str, outcome: str) -> None:
        self.ledger[batch_id][job_id] = outcome

    def add_children(self, batch_id: str, job_ids: Sequence[str]) -> None:
        self.ledger.setdefault(batch_id, {}).update(dict.fromkeys(job_ids, "pending"))

    def children(self, batch_id: str, outcome: str, limit: int) -> list[str]:
        chosen = sorted(j for j, o in self.ledger.get(batch_id, {}).items() if o == outcome)
        return chosen[:limit]


class MemoryBatches(BatchStore):
    def __init__(self) -> None:
        self._tables = _Tables()
        self._lock = threading.Lock()

    @contextmanager
    def _transaction(self) -> Iterator[Transaction]:
        with self._lock:
            yield self._tables

    def batches(self, limit: int = 100) -> list[Batch]:
        with self._lock:
            chosen = list(self._tables.batches.values())
        return sorted(chosen, key=lambda b: (b.deadline, b.batch_id))[:limit]

    def close(self) -> None:
        pass
