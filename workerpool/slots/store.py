"""The slot store interface, its result types, and the rules every backend shares.

A key (``bigquery-exports``, ``partner:acme``) has one record: its holders, each with an
expiry and a fencing token, and the next token to hand out. A slot is a lease: ``acquire``
grants one while fewer than ``limit`` live holders exist, ``renew_many`` extends live ones,
``release_many`` gives them up, and a holder that stops renewing (it died) drops out once its
lease expires. Backends only provide an atomic read-modify-write of records (``_mutate_many``);
the decisions live here, once, so every backend behaves the same.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from workerpool.stores import guarded

T = TypeVar("T")


@dataclass(frozen=True)
class Holding:
    until: float  # the store's clock (wall time): the lease lapses then unless renewed
    token: int


@dataclass(frozen=True)
class Table:
    """A key's record. ``next_token`` only grows: a token names one grant, ever."""

    holders: dict[str, Holding] = field(default_factory=dict)
    next_token: int = 1

    def live(self, now: float) -> dict[str, Holding]:
        return {h: holding for h, holding in self.holders.items() if holding.until > now}


@dataclass(frozen=True)
class Granted:
    """The caller holds a slot of ``key``; ``token`` grows with every grant of that key, so a
    downstream system can refuse a holder whose lease was taken over (a fencing token)."""

    key: str
    holder: str
    token: int


@dataclass(frozen=True)
class Full:
    """Every slot of the key is held; the first lease lapses at ``free_at`` unless renewed."""

    holders: int
    free_at: float


# Given a key's record (None if it has none) and the time, what to return and the record to
# write (None: leave it as it is).
TableMutation = Callable[[Table | None, float], tuple[T, Table | None]]


class SlotStore(ABC):
    """Every method may raise ``StoreError`` (``StoreUnavailable`` when trying again later
    may help), and nothing else."""

    def __init__(self, *, clock: Callable[[], float]) -> None:
        self._clock = clock

    @abstractmethod
    def _mutate_many(self, items: Sequence[tuple[str, TableMutation[T]]]) -> list[T]:
        """Atomically, per key: read its record, call the mutation with it and the time,
        write what it returns; a backend may do them all in one round trip."""

    @abstractmethod
    def close(self) -> None:
        """Release connections; the store must not be used afterwards."""

    def acquire(self, key: str, holder: str, limit: int, ttl: float) -> Granted | Full:
        """A slot for ``holder`` if fewer than ``limit`` live holders have one. Asking again
        as a live holder (a reply lost on the way) renews and returns the same grant."""

        def mutation(table: Table | None, now: float) -> tuple[Granted | Full, Table | None]:
            table = table or Table()
            live = table.live(now)
            mine = live.get(holder)
            if mine is not None:
                live[holder] = Holding(now + ttl, mine.token)
                return Granted(key, holder, mine.token), Table(live, table.next_token)
            if len(live) >= limit:
                return Full(len(live), min(h.until for h in live.values())), None
            live[holder] = Holding(now + ttl, table.next_token)
            return Granted(key, holder, table.next_token), Table(live, table.next_token + 1)

        return self._guarded(lambda: self._mutate_many([(key, mutation)])[0])

    def renew_many(self, leases: Sequence[tuple[str, str]], ttl: float) -> list[bool]:
        """Extend ``(key, holder)`` leases; for each, True if it was still live. A lapsed one
        is not revived, even when nobody took its place yet: another holder may have been
        granted a slot while it did not count."""

        def renewal(holder: str) -> TableMutation[bool]:
            def mutation(table: Table | None, now: float) -> tuple[bool, Table | None]:
                mine = None if table is None else table.live(now).get(holder)
                if table is None or mine is None:
                    return False, None
                holders = {**table.holders, holder: Holding(now + ttl, mine.token)}
                return True, Table(holders, table.next_token)

            return mutation

        return self._guarded(
            lambda: self._mutate_many([(key, renewal(holder)) for key, holder in leases])
        )

    def release_many(self, leases: Sequence[tuple[str, str]]) -> None:
        def releasing(holder: str) -> TableMutation[None]:
            def mutation(table: Table | None, now: float) -> tuple[None, Table | None]:
                if table is None or holder not in table.holders:
                    return None, None
                live = table.live(now)
                live.pop(holder, None)
                return None, Table(live, table.next_token)

            return mutation

        self._guarded(
            lambda: self._mutate_many([(key, releasing(holder)) for key, holder in leases])
        )

    def holders(self, key: str) -> dict[str, Holding]:
        """The live holders of ``key`` (for ``workerpool status``)."""

        def reading(table: Table | None, now: float) -> tuple[dict[str, Holding], None]:
            return ({} if table is None else table.live(now)), None

        return self._guarded(lambda: self._mutate_many([(key, reading)])[0])

    def _guarded(self, call: Callable[[], T]) -> T:
        return guarded(self, call)
