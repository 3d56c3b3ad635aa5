"""Checkpoints and progress of a fleet on many hosts: a document per job id in
``<COLLECTION>-checkpoints``, one per running job in ``<COLLECTION>-progress``."""

from __future__ import annotations

from collections.abc import Sequence

from workerpool.progress.store import FORGET_AFTER, JobStateStore, Report, decode, encode
from workerpool.stores import firestore as docs

# Every progress document has it, so that one equality query reads them all (no index).
_KIND = "progress"


class FirestoreJobState(JobStateStore):
    """Only the run that holds a job id writes its checkpoint, and only the replica running a
    job its progress: blind writes, one round trip each, with no race to decide."""

    def __init__(self, project: str, collection: str, *, timeout: float = 5.0) -> None:
        self._checkpoints = docs.Documents(
            project, f"{collection}-checkpoints", timeout=timeout, label="checkpoints"
        )
        self._progress = docs.Documents(
            project, f"{collection}-progress", timeout=timeout, label="progress"
        )

    def save(self, job_id: str, state: str, at: float) -> None:
        self._checkpoints.put(job_id, {"job_id": job_id, "state": state, "at": at})

    def load(self, job_id: str) -> str | None:
        data = self._checkpoints.get(job_id)
        return None if data is None else str(data["state"])

    def load_many(self, job_ids: Sequence[str]) -> dict[str, str]:
        found = self._checkpoints.get_many(job_ids)
        return {job_id: str(data["state"]) for job_id, data in found.items()}

    def forget(self, job_ids: Sequence[str]) -> None:
        for job_id in job_ids:
            self._checkpoints.remove(job_id)

    def report(self, reports: Sequence[Report]) -> None:
        for r in reports:
            self._progress.put(r.key, {"kind": _KIND, "until": r.until, "report": encode(r)})

    def ended(self, keys: Sequence[str]) -> None:
        for key in keys:
            self._progress.remove(key)

    def running(self, now: float) -> list[Report]:
        found = self._progress.matching("kind", _KIND)
        stale = [doc_id for doc_id, data in found if data["until"] < now - FORGET_AFTER]
        if stale:
            self._progress.remove_ids(stale)
        live = [decode(data["report"]) for _, data in found if data["until"] > now]
        return sorted(live, key=lambda r: (r.started, r.key))

    def close(self) -> None:
        self._checkpoints.close()
        self._progress.close()
