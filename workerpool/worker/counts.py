"""Counts that many threads add to without a lock: each thread has its own, summed when read.

The slots count every message they settle; a shared counter behind a lock was one more lock
round trip per job, contended by dozens of slot threads. Read, it is a live mapping with a
``Counter``'s manners: a key never counted reads 0.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Hashable, Iterator, Mapping
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


class Counts(Mapping[K, int]):
    def __init__(self) -> None:
        self._local = threading.local()
        self._threads: list[dict[K, int]] = []
        self._lock = threading.Lock()  # only when a thread counts for the first time

    def add(self, key: K) -> None:
        mine: dict[K, int] | None = getattr(self._local, "counts", None)
        if mine is None:
            mine = self._local.counts = {}
            with self._lock:
                self._threads.append(mine)
        mine[key] = mine.get(key, 0) + 1  # only this thread writes it

    def totals(self) -> Counter[K]:
        with self._lock:
            threads = list(self._threads)
        total: Counter[K] = Counter()
        for counts in threads:
            total.update(dict(counts))  # dict() copies in one step: no torn read
        return total

    def __getitem__(self, key: K) -> int:
        with self._lock:
            threads = list(self._threads)
        return sum(counts.get(key, 0) for counts in threads)

    def __contains__(self, key: object) -> bool:
        return key in self.totals()

    def __iter__(self) -> Iterator[K]:
        return iter(self.totals())

    def __len__(self) -> int:
        return len(self.totals())

    def __repr__(self) -> str:
        return f"Counts({dict(self.totals())!r})"
