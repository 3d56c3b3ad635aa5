"""Blocked ordering keys of a fleet on many hosts: a document per blocked key in
``<COLLECTION>-ordering-blocks`` beside the idempotency store's collection."""

from __future__ import annotations

import time

from workerpool.ordering.blocks import Block
from workerpool.stores import firestore as docs

# Every block document has it, so that one equality query reads them all (no index).
_KIND = "ordering-block"


class FirestoreBlocks:
    """Blind writes, one round trip each: a key is blocked by the one run that exhausted its
    job's attempts and unblocked by an operator, so there is no race to decide. A worker
    reads a key's document before each of its messages runs (one read per keyed message, on
    workers that run a job of ``ordered_exhausted="block"``)."""

    def __init__(self, project: str, collection: str, *, timeout: float = 5.0) -> None:
        self._docs = docs.Documents(
            project, f"{collection}-ordering-blocks", timeout=timeout, label="blocked keys"
        )

    def block(self, key: str, job: str, job_id: str) -> None:
        data = {"kind": _KIND, "key": key, "job": job, "job_id": job_id, "at": time.time()}
        self._docs.put(key, data)

    def blocker(self, key: str) -> str | None:
        data = self._docs.get(key)
        return None if data is None else str(data["job_id"])

    def unblock(self, key: str) -> bool:
        # Two operators unblocking one key at once are both told it was blocked: harmless.
        if self._docs.get(key) is None:
            return False
        self._docs.remove(key)
        return True

    def all(self) -> list[Block]:
        found = [data for _, data in self._docs.matching("kind", _KIND)]
        blocks = [Block(d["key"], d["job"], d["job_id"], float(d["at"])) for d in found]
        return sorted(blocks, key=lambda b: b.key)

    def close(self) -> None:
        self._docs.close()
