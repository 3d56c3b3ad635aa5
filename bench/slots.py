"""``python -m bench.slots``: what a concurrency slot costs, and how many grants one key takes.

Measured: the CPU and latency of one slot acquire + release on SQLite and on the
Firestore emulator, and the acquisitions per second one key sustains. Two measurements per
backend, side by side in one run:

* ``pair``: one caller, a free key: acquire then release, repeated; median latency and the
  process's CPU per pair.
* ``key``: ``--holders`` callers (threads, each with a store handle of its own, as replicas
  have) take slots of one key of limit ``--limit``, hold each for 1 ms and give it back, as
  fast as they can, for ``--seconds``; grants per second, and the most held at once (never
  more than the limit).

* ``bulk``: one key of limit 20 leased per run against leased in bulk (``"20/bulk"``): 4
  replicas, 8 callers each (each replica's runs in threads, a ``ShareManager`` per replica in
  bulk, a store handle per caller per run), each run holding its slot 1 ms, for
  ``--seconds``; runs per second, and writes of the key's records per run, counted by the
  store (an SQLite trigger; on SQLite only).

The Firestore emulator is started here (it needs the gcloud CLI); ``--backends sqlite`` skips it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.results import Grid, Section, Stamp, command_line, emit
from workerpool.slots import Granted, Limits, SlotStore, SqliteSlots
from workerpool.slots.shares import ShareManager, ShareUse
from workerpool.stores import StoreError
from workerpool.testing.emulator import LocalEmulator
from workerpool.testing.fakes import slot_run
from workerpool.worker.timers import Timers

ABOUT = [
    "One slot acquire + release on SQLite and on the Firestore emulator, one caller on a free "
    "key: the median latency and the process's CPU per pair. Then callers (threads, each with "
    "a store handle of its own, as replicas have) take slots of one key, hold each for 1 ms and "
    "give it back as fast as they can: grants per second, and the most held at once (never "
    "more than the limit). The last row divides Firestore's figures by SQLite's, both measured "
    "in this run.",
]
KEY = "bench-key"
TTL = 60.0


class Holding:
    """How many callers hold a slot now, the most at once, and how many held one in all."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.now = self.peak = self.count = 0

    @contextmanager
    def one(self) -> Iterator[None]:
        with self._lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
            self.count += 1
        try:
            yield
        finally:
            with self._lock:
                self.now -= 1


def pair(store: SlotStore, count: int) -> tuple[float, float]:
    """Median seconds and CPU seconds per acquire + release on a free key."""
    latencies = []
    cpu = time.process_time()
    for i in range(count):
        started = time.perf_counter()
        store.acquire(KEY + "-pair", f"h{i}", 1, TTL)
        store.release_many([(KEY + "-pair", f"h{i}")], held_for=0.0)
        latencies.append(time.perf_counter() - started)
    return statistics.median(latencies), (time.process_time() - cpu) / count


def one_key(
    open_store: Callable[[], SlotStore], holders: int, limit: int, seconds: float
) -> tuple[float, int]:
    """Grants per second and the most slots held at once, ``holders`` callers on one key."""
    stores = [open_store() for _ in range(holders)]
    held = Holding()
    stop = time.monotonic() + seconds

    def caller(index: int) -> None:
        store = stores[index]
        n = 0
        while time.monotonic() < stop:
            holder = f"c{index}-{n}"  # a caller keeps its place in line until it is served
            try:
                granted = isinstance(store.acquire(KEY, holder, limit, TTL, wait=True), Granted)
            except StoreError:  # a store too busy to answer in time: ask again, as runs do
                granted = False
            if not granted:
                time.sleep(store.poll_every / 2)
                continue
            n += 1
            with held.one():
                time.sleep(0.001)  # held: other callers' grants overlap it, if the store allows
            with contextlib.suppress(StoreError):  # (the slot lapses after the TTL)
                store.release_many([(KEY, holder)], held_for=0.0)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(holders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for store in stores:
        store.close()
    return held.count / seconds, held.peak


class Writes:
    """The writes of slot records by the stores it ``wrap``s: counted by the store itself
    on SQLite (a trigger in the file at ``path``), and on Firestore as the decisions that
    changed a document (a transaction tried again counts twice: at most)."""

    def __init__(self, path: Path | None) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._decided = 0
        if path is not None:
            with sqlite3.connect(path) as conn:
                conn.executescript(_COUNTED)

    def wrap(self, store: SlotStore) -> SlotStore:
        if self._path is not None:
            return store
        deciding = store._deciding  # type: ignore[attr-defined]

        def counted(key: str, mutation: Any) -> Any:
            decide = deciding(key, mutation)

            def counting(data: Any) -> Any:
                result, change = decide(data)
                if change is not None:
                    with self._lock:
                        self._decided += 1
                return result, change

            return counting

        store._deciding = counted  # type: ignore[attr-defined]
        return store

    def count(self) -> int:
        if self._path is None:
            with self._lock:
                return self._decided
        with sqlite3.connect(self._path) as conn:
            return int(conn.execute("SELECT count(*) FROM slot_writes").fetchone()[0])


_COUNTED = """
CREATE TABLE IF NOT EXISTS slots (key TEXT PRIMARY KEY, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS slot_writes (key TEXT NOT NULL);
CREATE TRIGGER IF NOT EXISTS slot_written AFTER INSERT ON slots BEGIN
    INSERT INTO slot_writes VALUES (NEW.key);
END;
"""


def bulk_key(
    open_store: Callable[[], SlotStore], replicas: int, callers: int, limit: int, seconds: float
) -> tuple[float, int]:
    """Runs per second and the most held at once: ``replicas`` share managers, each with
    ``callers`` threads taking slots of one key leased in bulk."""
    timers = Timers()
    timers.start()
    stores = [open_store() for _ in range(replicas)]
    limits = Limits({KEY: limit}, [KEY])
    managers = [ShareManager(store, f"r{i}", limits, timers, ttl=TTL)
                for i, store in enumerate(stores)]  # fmt: skip
    held = Holding()
    stop = time.monotonic() + seconds

    def caller(manager: ShareManager, index: int) -> None:
        n = 0
        while time.monotonic() < stop:
            use = manager.take(KEY, slot_run(f"c{index}-{n}", key=KEY), 5.0, park=False)
            n += 1
            if not isinstance(use, ShareUse):
                continue
            with held.one():
                time.sleep(0.001)
            manager.give(use)

    for manager in managers:
        manager.start()
    threads = [threading.Thread(target=caller, args=(m, i * callers + j))
               for i, m in enumerate(managers) for j in range(callers)]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for manager, store in zip(managers, stores, strict=True):
        manager.close(5.0)
        store.close()
    timers.close(1.0)
    return held.count / seconds, held.peak


def bulk_against_per_run(
    name: str, open_store: Callable[[], SlotStore], path: Path | None, seconds: float
) -> list[list[str]]:
    """The ``bulk`` table's rows, per run and in bulk, on one backend."""
    replicas, callers, limit = 4, 8, 20
    rows = []
    for mode in ("per run", "bulk"):
        writes = Writes(path)
        before = writes.count()

        def counted() -> SlotStore:
            return writes.wrap(open_store())  # noqa: B023 (called before the next mode)

        if mode == "bulk":
            rate, peak = bulk_key(counted, replicas, callers, limit, seconds)
        else:
            rate, peak = one_key(counted, replicas * callers, limit, seconds)
        per_run = (writes.count() - before) / max(1.0, rate * seconds)
        rows.append([f"{mode} ({name})", f"{rate:,.0f}", f"{per_run:.4f}", str(peak)])
    return rows


Space = tuple[Callable[[], SlotStore], Path | None]


@contextmanager
def backend(name: str) -> Iterator[Callable[[], Space]]:
    """Gives a fresh space of the backend for each call: how to open a store in it, and its
    SQLite file (None: a Firestore collection)."""
    if name == "sqlite":
        with tempfile.TemporaryDirectory() as directory:

            def file() -> Space:
                path = Path(directory) / f"slots-{uuid.uuid4().hex[:8]}.db"
                return (lambda: SqliteSlots(path)), path

            yield file
        return
    with LocalEmulator(kind="firestore", project="workerpool-bench") as emulator:
        os.environ[emulator.env_var] = emulator.host
        from workerpool.slots.firestore import FirestoreSlots

        def collection() -> Space:
            name = f"bench-{uuid.uuid4().hex[:8]}"
            return (lambda: FirestoreSlots("workerpool-bench", name)), None

        try:
            yield collection
        finally:
            del os.environ[emulator.env_var]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="sqlite,firestore")
    parser.add_argument("--pairs", type=int, default=300)
    parser.add_argument("--holders", type=int, default=4)
    parser.add_argument("--limit", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    stamp = Stamp()
    grid = Grid(
        "",
        "",
        ["backend", "acquire+release, median ms", "CPU per pair, ms",
         f"grants/s on one key ({args.holders} callers, limit {args.limit})", "most held at once"],
    )  # fmt: skip
    bulk = Grid(
        "Bulk against per-run leases",
        "",
        ["one key of 20, 4 replicas x 8 callers, 1 ms runs", "runs/s", "writes/run", "most held"],
    )
    figures = {}
    for name in args.backends.split(","):
        with backend(name) as space:
            open_store, _ = space()
            store = open_store()
            latency, cpu = pair(store, args.pairs)
            store.close()
            rate, peak = one_key(open_store, args.holders, args.limit, args.seconds)
            # A fresh file or collection: its writes are the bulk table's only.
            bulk.rows += bulk_against_per_run(name, *space(), args.seconds)
        figures[name] = (latency, cpu, rate)
        grid.rows.append([name, f"{latency * 1000:.2f}", f"{cpu * 1000:.2f}", f"{rate:,.0f}",
                          str(peak)])  # fmt: skip
    if {"sqlite", "firestore"} <= figures.keys():
        ratios = (
            f"{f / q:.2f}" for f, q in zip(figures["firestore"], figures["sqlite"], strict=True)
        )
        grid.rows.append(["firestore / sqlite", *ratios, ""])
    command = command_line("python -m bench.slots", argv)
    emit(Section("slots", "Concurrency slots: what one key costs", command, ABOUT, [grid, bulk]),
         stamp, args.json)  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
