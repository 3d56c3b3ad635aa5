"""``python -m bench.batches``: what a batch child and a delayed job cost the store (SQLite).

Issue 16 asks for the store round trips and CPU per batch child, the completion latency of a
10,000-child batch, and timer lateness at 100 and 1,000 timers/s. Measured at the store and
the firer, with a publisher that only records when it was called, so the figures are the
schedule's and the batch ledger's own; the Pub/Sub hop after them (a publish and a pull, tens
of milliseconds on the emulator) is the delayed-job test's to show, end to end.

* ``child``: ``--children`` children of one committed batch recorded done by ``--writers``
  threads, each with a store handle of its own (as worker processes have): store
  transactions and CPU per child, and children per second.
* ``completion``: from the start of the last child's write to its completion being handed to
  the firer's publisher.
* ``timers``: timers due at RATE per second for ``--seconds``, added ahead by one worker whose
  firer fires them (it knows their times) while a second firer reads them from the store:
  how late each was published, p50 / p99 / max.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from workerpool import constants as c
from workerpool.batches import BatchStore, Completion, SqliteBatches
from workerpool.batches.store import T, Transaction, deliver
from workerpool.schedule import Entry, SqliteSchedule
from workerpool.schedule.delays import Firer

TOPIC = "projects/bench/topics/jobs"


class Counted(SqliteBatches):
    """The SQLite batch store, counting its transactions (one round trip to the file each)."""

    transactions = 0
    _count_lock = threading.Lock()

    def _atomic(self, body: Callable[[Transaction], T]) -> T:
        with Counted._count_lock:
            Counted.transactions += 1
        return super()._atomic(body)


class Publisher:
    """Records when each job id was handed over; publishes nothing."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {}
        self.published = threading.Event()

    def publish(self, topic: str, data: bytes, **attributes: str) -> Future[str]:
        self.at[attributes[c.ATTR_JOB_ID]] = time.time()
        self.published.set()
        future: Future[str] = Future()
        future.set_result("m")
        return future


def children(path: Path, count: int, writers: int) -> tuple[float, float, float, float]:
    """Transactions and CPU seconds per child, children per second, completion latency."""
    job_ids = [f"child-{i}" for i in range(count)]
    setup = SqliteBatches(path)
    setup.create("b1", TOPIC, "bench.done", job_ids, deadline=time.time() + 3600)
    setup.commit("b1")
    setup.close()
    schedule, publisher = SqliteSchedule(path), Publisher()
    firer = Firer(schedule, TOPIC, publisher)
    firer.start()
    stores: list[BatchStore] = [Counted(path) for _ in range(writers)]
    finals: list[tuple[float, Completion]] = []
    Counted.transactions = 0

    def write(index: int) -> None:
        store = stores[index]
        for job_id in job_ids[index::writers]:
            started = time.time()
            completion = store.record("b1", job_id, True)
            if completion is not None:
                finals.append((started, completion))
                firer.expect(deliver(completion, store, schedule) or started)

    cpu, wall = time.process_time(), time.perf_counter()
    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    [(last_started, completion)] = finals
    publisher.published.wait(10)
    firer.stop(5)
    latency = publisher.at[completion.job_id] - last_started
    transactions = (Counted.transactions - 1) / count  # less the delivery's own
    for store in stores:
        store.close()
    schedule.close()
    return transactions, cpu / count, count / wall, latency


def timers(path: Path, rate: int, seconds: float) -> tuple[float, float, float]:
    """Lateness p50, p99 and max (seconds) of timers due at ``rate`` per second."""
    schedule, publisher = SqliteSchedule(path), Publisher()
    start = time.time() + 1.0
    dues = {f"t{rate}-{i}": start + i / rate for i in range(int(rate * seconds))}
    topic = f"{TOPIC}-{rate}"
    adder, reader = Firer(schedule, topic, publisher), Firer(SqliteSchedule(path), topic, publisher)
    for job_id, due in dues.items():
        schedule.add(Entry(topic, job_id, due, b"{}", {c.ATTR_JOB_ID: job_id}))
        adder.expect(due)
    adder.start()
    reader.start()
    deadline = time.monotonic() + seconds + 30
    while len(publisher.at) < len(dues) and time.monotonic() < deadline:
        time.sleep(0.05)
    adder.stop(5)
    reader.stop(5)
    schedule.close()
    late = sorted(publisher.at[j] - due for j, due in dues.items())
    return statistics.median(late), late[int(len(late) * 0.99) - 1], late[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--children", type=int, default=10_000)
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--rates", default="100,1000")
    parser.add_argument("--seconds", type=float, default=5.0)
    args: Any = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "store.db"
        per_child, cpu, rate, latency = children(path, args.children, args.writers)
        print(f"| batch of {args.children:,} children, {args.writers} writers, SQLite | figure |")
        print("| --- | --- |")
        print(f"| store transactions per child | {per_child:.2f} |")
        print(f"| CPU per child | {cpu * 1e6:.0f} us |")
        print(f"| children recorded per second | {rate:,.0f} |")
        print(f"| last child's write to its completion handed to the publisher | "
              f"{latency * 1000:.1f} ms |")  # fmt: skip
        print()
        print("| timers due per second | lateness p50 | p99 | max |")
        print("| --- | --- | --- | --- |")
        for each in (int(r) for r in args.rates.split(",")):
            p50, p99, worst = timers(path, each, args.seconds)
            print(
                f"| {each:,} | {p50 * 1000:.1f} ms | {p99 * 1000:.1f} ms | {worst * 1000:.1f} ms |"
            )


if __name__ == "__main__":
    main()
