"""Counts a worker process's writes of the slot store's Firestore documents: ``--jobs
tests.store_writes`` with ``WORKERPOOL_TEST_SLOT_WRITES`` naming an SQLite file, which gets a
row in ``slot_writes`` (key, epoch seconds) for every write the emulator accepted, as
``tests.support.count_slot_writes`` has SQLite's own store count them (``slot_writes`` reads
both). Writes refused by their precondition (a lost race, tried again) are not counted: the
document was not written.

Importing this module does it: the worker imports ``--jobs`` modules before it builds its
stores.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from typing import Any

from workerpool.stores import firestore

ENV = "WORKERPOOL_TEST_SLOT_WRITES"
_SLOTS_LABEL = "slot store"  # the label workerpool.slots.firestore gives its documents


def _install(path: str) -> None:
    real = firestore.Documents._write
    lock = threading.Lock()
    conn = sqlite3.connect(path, timeout=30, check_same_thread=False)
    conn.execute("CREATE TABLE IF NOT EXISTS slot_writes (key TEXT NOT NULL, at REAL NOT NULL)")
    conn.commit()

    def counted_write(
        self: firestore.Documents, ref: Any, state: Any, change: Any, deadline: float
    ) -> None:
        real(self, ref, state, change, deadline)  # raises on a lost race: nothing written
        if change is None or self._label != _SLOTS_LABEL:
            return
        with lock:
            conn.execute("INSERT INTO slot_writes VALUES (?, ?)", (change["key"], time.time()))
            conn.commit()

    firestore.Documents._write = counted_write  # type: ignore[method-assign]


if os.environ.get(ENV):
    _install(os.environ[ENV])
