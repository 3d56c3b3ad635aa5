"""Leases of a fleet on many hosts: one Firestore document per name."""

from __future__ import annotations

from typing import Any

from workerpool.leadership.decisions import Noted, appended, read
from workerpool.leadership.store import LeadershipStore, Lease, claimed, decode, encode, released
from workerpool.stores import firestore as docs


class FirestoreLeadership(LeadershipStore):
    """A claim is one preconditioned read-decide-write of the name's document: two claimers
    racing, one write fails its precondition and decides again on what the other wrote."""

    def __init__(
        self, project: str, collection: str, decisions: str, *, timeout: float = 5.0
    ) -> None:
        """Leases in ``collection``, the last decisions in ``decisions``."""
        self._docs = docs.Documents(project, collection, timeout=timeout, label="leadership")
        self._decisions = docs.Documents(project, decisions, timeout=timeout, label="leadership")

    def claim(self, name: str, holder: str, now: float, ttl: float) -> Lease:
        def decide(data: dict[str, Any] | None) -> tuple[Lease, docs.DocChange]:
            lease, changed = claimed(_lease(data), holder, now, ttl)
            return lease, _document(name, lease) if changed else None

        return self._docs.mutate(name, decide)

    def release(self, name: str, holder: str) -> None:
        def decide(data: dict[str, Any] | None) -> tuple[None, docs.DocChange]:
            lease = released(_lease(data), holder)
            return None, None if lease is None else _document(name, lease)

        self._docs.mutate(name, decide)

    def note(self, name: str, noted: Noted) -> None:
        def decide(data: dict[str, Any] | None) -> tuple[None, docs.DocChange]:
            entries = appended(None if data is None else data["entries"], noted)
            return None, {"name": name, "entries": entries}

        self._decisions.mutate(name, decide)

    def decisions(self, name: str) -> list[Noted]:
        return self._decisions.mutate(
            name, lambda data: (read(None if data is None else data["entries"]), None)
        )

    def close(self) -> None:
        self._docs.close()
        self._decisions.close()


def _lease(data: dict[str, Any] | None) -> Lease | None:
    return None if data is None else decode(data["lease"])


def _document(name: str, lease: Lease) -> dict[str, Any]:
    return {"name": name, "lease": encode(lease)}
