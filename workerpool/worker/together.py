"""Calls one message at a time that are cheaper made together, for a thread that settles many
messages in a row (the completions thread settles a recorded batch at once).

``together(call, item)`` calls ``call([item])``; inside ``one_round()`` on the same thread it
only queues ``item``, and as the round ends ``call`` is made once with every item queued for
it, in order. A message that leaves the pool takes the pool's lock, which its slot threads and
its puller take too: one round of it a batch instead of one a message took 81-86 against 86-93
us of CPU a no-op job at N = 100 with the defaults, the completions thread's part 20-22
against 23-25 (four runs of each in turn, in process). The cancels' and the claims' books
are kept the same way, under locks the slot threads take at every run.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

_local = threading.local()


@contextmanager
def one_round() -> Iterator[None]:
    """Queue ``together``'s calls on this thread until the block ends (a round already open
    on it makes them as it ends instead)."""
    if getattr(_local, "queued", None) is not None:
        yield
        return
    queued: dict[Callable[[list[Any]], object], list[Any]] = {}
    _local.queued = queued
    try:
        yield
    finally:
        _local.queued = None
        for call, items in queued.items():
            try:
                call(items)
            except Exception:  # a bug: the other calls of the round are made all the same
                log.exception("%s of %d items failed", getattr(call, "__qualname__", call),
                              len(items))  # fmt: skip


def together(call: Callable[[list[T]], object], item: T) -> None:
    """``call([item])``, or, in a round open on this thread, ``item`` queued for the one call of
    ``call`` the round makes as it ends (a bound method or a function: equal ones share it)."""
    queued: dict[Callable[[list[Any]], object], list[Any]] | None = getattr(_local, "queued", None)
    if queued is None:
        call([item])
        return
    items = queued.get(call)
    if items is None:
        queued[call] = [item]
    else:
        items.append(item)
