"""One holder at a time: a lease record per name (an autoscaler's subscription), with a TTL and a
fencing token, in the store the fleet shares.

A claim renews the lease its holder holds, takes one that lapsed (or was never taken) with the
next token, and leaves anyone else's alone. The token grows by one with each new holder, so a
holder that was paused past its TTL and taken over learns it from the token it gets back, and
acts on nothing decided under the old one.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass

from workerpool.leadership.decisions import Noted
from workerpool.stores import known_fields


@dataclass(frozen=True)
class Lease:
    """Who holds ``name`` until ``until`` (wall time), under which fencing ``token``."""

    holder: str
    token: int
    until: float


def encode(lease: Lease) -> str:
    return json.dumps(asdict(lease))


def decode(text: str) -> Lease:
    return known_fields(Lease, json.loads(text))


def claimed(held: Lease | None, holder: str, now: float, ttl: float) -> tuple[Lease, bool]:
    """The lease after ``holder`` claims it at ``now`` for ``ttl`` seconds, and whether it
    changed (to be written)."""
    if held is not None and held.until > now and held.holder != holder:
        return held, False  # someone else's, and live
    if held is not None and held.holder == holder and held.until > now:
        return Lease(holder, held.token, now + ttl), True  # renewed: the same term
    return Lease(holder, (held.token if held else 0) + 1, now + ttl), True  # a new term


def released(held: Lease | None, holder: str) -> Lease | None:
    """The lease after ``holder`` gives it up: lapsed now, its token kept (the next term's
    token must still be higher); None if it was not ``holder``'s (nothing to write)."""
    if held is None or held.holder != holder:
        return None
    return Lease(holder, held.token, 0.0)


class LeadershipStore(ABC):
    """Every method may raise ``StoreError``, and nothing else."""

    @abstractmethod
    def claim(self, name: str, holder: str, now: float, ttl: float) -> Lease:
        """Renew or take ``name``'s lease for ``holder`` if it can, atomically; return the
        lease as it stands after (someone else's if they hold it)."""

    @abstractmethod
    def release(self, name: str, holder: str) -> None:
        """``holder`` stops: its lease lapses at once, so a standby need not wait its TTL."""

    @abstractmethod
    def note(self, name: str, noted: Noted) -> None:
        """Add a decision to ``name``'s last ones (its holder's, written while it leads)."""

    @abstractmethod
    def decisions(self, name: str) -> list[Noted]:
        """``name``'s last decisions, newest first."""

    @abstractmethod
    def close(self) -> None:
        """Release connections; the store must not be used afterwards."""
