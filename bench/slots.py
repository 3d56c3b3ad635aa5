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

The Firestore emulator is started here (it needs the gcloud CLI); ``--backends sqlite`` skips it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.results import Grid, Section, Stamp, command_line, emit
from workerpool.slots import Granted, SlotStore, SqliteSlots
from workerpool.testing.emulator import LocalEmulator

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
    lock = threading.Lock()
    held = peak = grants = 0
    stop = time.monotonic() + seconds

    def caller(index: int) -> None:
        nonlocal held, peak, grants
        store = stores[index]
        n = 0
        while time.monotonic() < stop:
            holder = f"c{index}-{n}"  # a caller keeps its place in line until it is served
            if not isinstance(store.acquire(KEY, holder, limit, TTL, wait=True), Granted):
                time.sleep(store.poll_every / 2)
                continue
            n += 1
            with lock:
                held += 1
                peak = max(peak, held)
                grants += 1
            time.sleep(0.001)  # held: other callers' grants overlap it, if the store allows
            with lock:
                held -= 1
            store.release_many([(KEY, holder)], held_for=0.0)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(holders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for store in stores:
        store.close()
    return grants / seconds, peak


@contextmanager
def backend(name: str) -> Iterator[Callable[[], SlotStore]]:
    if name == "sqlite":
        with tempfile.TemporaryDirectory() as directory:
            path = Path(directory) / "slots.db"
            yield lambda: SqliteSlots(path)
        return
    with LocalEmulator(kind="firestore", project="workerpool-bench") as emulator:
        os.environ[emulator.env_var] = emulator.host
        from workerpool.slots.firestore import FirestoreSlots

        collection = f"bench-{uuid.uuid4().hex[:8]}"
        try:
            yield lambda: FirestoreSlots("workerpool-bench", collection)
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
    figures = {}
    for name in args.backends.split(","):
        with backend(name) as open_store:
            store = open_store()
            latency, cpu = pair(store, args.pairs)
            store.close()
            rate, peak = one_key(open_store, args.holders, args.limit, args.seconds)
        figures[name] = (latency, cpu, rate)
        grid.rows.append([name, f"{latency * 1000:.2f}", f"{cpu * 1000:.2f}", f"{rate:,.0f}",
                          str(peak)])  # fmt: skip
    if {"sqlite", "firestore"} <= figures.keys():
        ratios = (
            f"{f / q:.2f}" for f, q in zip(figures["firestore"], figures["sqlite"], strict=True)
        )
        grid.rows.append(["firestore / sqlite", *ratios, ""])
    command = command_line("python -m bench.slots", argv)
    emit(Section("slots", "Concurrency slots: what one key costs", command, ABOUT, [grid]),
         stamp, args.json)  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
