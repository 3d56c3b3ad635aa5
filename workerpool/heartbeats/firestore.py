"""Heartbeats of a fleet on many hosts: one Firestore document per replica."""

from __future__ import annotations

from workerpool.heartbeats.store import FORGET_AFTER, Beat, HeartbeatStore, decode, encode
from workerpool.stores import firestore as docs


class FirestoreHeartbeats(HeartbeatStore):
    """A replica writes only its own document, blindly (one round trip per beat; nobody else
    changes it, so there is no race to decide); the autoscaler reads a subscription's beats
    with one query on an equality filter, which needs no composite index."""

    def __init__(self, project: str, collection: str, *, timeout: float = 5.0) -> None:
        self._docs = docs.Documents(project, collection, timeout=timeout, label="heartbeats")

    def beat(self, beat: Beat) -> None:
        self._docs.put(
            beat.replica,
            {"subscription": beat.subscription, "until": beat.until, "beat": encode(beat)},
        )

    def gone(self, replica: str) -> None:
        self._docs.remove(replica)

    def live(self, subscription: str, now: float) -> list[Beat]:
        found = self._docs.matching("subscription", subscription)
        stale = [doc_id for doc_id, data in found if data["until"] < now - FORGET_AFTER]
        if stale:
            self._docs.remove_ids(stale)
        beats = [decode(data["beat"]) for _, data in found if data["until"] > now]
        return sorted(beats, key=lambda b: b.replica)

    def close(self) -> None:
        self._docs.close()
