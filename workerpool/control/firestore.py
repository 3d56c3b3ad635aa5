"""Cancels of a fleet on many hosts: one Firestore document per cancelled job id.

Set a TTL policy on the ``expire_at`` field (as on the claims' collection) to have Firestore
purge cancels past their retention; until then they are only ignored."""

from __future__ import annotations

from collections.abc import Collection
from datetime import UTC, datetime
from typing import Any

from workerpool.control.store import Cancel, CancelStore
from workerpool.stores import firestore as docs


class FirestoreCancels(CancelStore):
    """A cancel is created if absent (the first one's reason and time are kept); a worker
    reads the job ids it holds with one batched get by document id, which needs no index."""

    def __init__(
        self, project: str, collection: str, *, retention: float, timeout: float = 5.0
    ) -> None:
        super().__init__(retention=retention)
        self._docs = docs.Documents(project, collection, timeout=timeout, label="cancels")

    def add(self, cancel: Cancel) -> Cancel:
        def deciding(data: dict[str, Any] | None) -> tuple[Cancel, docs.DocChange]:
            if data is not None and self.live(_decoded(cancel.job_id, data), cancel.at):
                return _decoded(cancel.job_id, data), None
            expire_at = datetime.fromtimestamp(cancel.at + self.retention, tz=UTC)
            return cancel, {"reason": cancel.reason, "at": cancel.at, "expire_at": expire_at}

        return self._docs.mutate(cancel.job_id, deciding)

    def find(self, job_ids: Collection[str], now: float) -> dict[str, Cancel]:
        found = self._docs.get_many(list(job_ids))
        cancels = (_decoded(job_id, data) for job_id, data in found.items())
        return {c.job_id: c for c in cancels if self.live(c, now)}

    def close(self) -> None:
        self._docs.close()


def _decoded(job_id: str, data: dict[str, Any]) -> Cancel:
    return Cancel(job_id, str(data.get("reason", "")), float(data["at"]))
