"""``python -m bench.batches``: what a batch child and a delayed job cost the store (SQLite, and
Firestore on its emulator).

Measured: the store round trips and CPU per batch child, the completion latency of a
10,000-child batch, and timer lateness at 100 and 1,000 timers/s. Measured at the store and
the firer, with a publisher that only records when it was called, so the figures are the
schedule's and the batch ledger's own; the Pub/Sub hop after them (a publish and a pull, tens
of milliseconds on the emulator) is the emulator tests' to show, end to end.

* ``child``: ``--children`` children of one committed batch recorded done by ``--writers``
  threads, each with a store handle of its own (as worker processes have): store round trips
  (SQLite: transactions; Firestore: calls to the service) and CPU per child, lost races per
  child (Firestore), and children per second. On Firestore once per ``--tallies`` figure: 1
  is every child rewriting one document, as a counter in the batch record would.
* ``completion``: from the start of the last child's write to its completion being handed to
  the firer's publisher.
* ``timers``: timers due at RATE per second for ``--seconds``, added ahead by one worker whose
  firer fires them (it knows their times) while a second firer reads them from the store:
  how late each was published, p50 / p99 / max, and the store round trips per timer.

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
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.results import Grid, Section, Stamp, command_line, emit
from workerpool import constants as c
from workerpool.batches import BatchStore, Completion, SqliteBatches
from workerpool.batches.store import deliver
from workerpool.schedule import Entry, ScheduleStore, SqliteSchedule
from workerpool.schedule.delays import Firer
from workerpool.testing.emulator import LocalEmulator

ABOUT = [
    "Measured at the store and the firer, with a publisher that only records when it was "
    "called, so the figures are the schedule's and the batch ledger's own (the Pub/Sub hop "
    "after them is the emulator tests' to show). Children: the children of one committed "
    "batch recorded done by writer threads, each with a store handle of its own; round trips "
    "(SQLite: transactions; Firestore: calls to the service), lost races (Firestore commits "
    "refused), CPU per child; the completion latency is from the start of the last child's "
    "write to its completion being handed to the publisher. On Firestore once per number of "
    "tallies: 1 is every child rewriting one document. Timers: timers due at a rate, added "
    "ahead by one worker whose firer fires them while a second firer reads them from the "
    "store; how late each was published, and the store round trips per timer.",
]
TOPIC = "projects/bench/topics/jobs"
PROJECT = "workerpool-bench"


class Meter:
    """Counts a store's round trips: each call of the methods it wraps is one."""

    def __init__(self) -> None:
        self.trips = 0
        self.lost = 0  # Firestore commits refused: a document changed since it was read
        self._lock = threading.Lock()

    def wrap(self, owner: Any, names: tuple[str, ...]) -> None:
        for name in names:
            setattr(owner, name, self._counting(getattr(owner, name)))

    def _counting(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.trips += 1
            try:
                return call(*args, **kwargs)
            except Exception as exc:
                if type(exc).__name__ in ("FailedPrecondition", "AlreadyExists", "NotFound"):
                    with self._lock:
                        self.lost += 1
                raise

        return counted

    def reset(self) -> None:
        self.trips = self.lost = 0


@dataclass
class Backend:
    name: str
    open_batches: Callable[[], BatchStore]
    open_schedule: Callable[[], ScheduleStore]
    metered: Callable[[Any, Meter], None]  # count a store handle's round trips


def _sqlite_metered(store: Any, meter: Meter) -> None:
    """One transaction (a batch store's ``_atomic``, a schedule's call) is one round trip to
    the file."""
    if isinstance(store, BatchStore):
        meter.wrap(store, ("_atomic",))
    else:
        meter.wrap(store, ("add", "claim_due", "fired"))


def _firestore_metered(store: Any, meter: Meter) -> None:
    """Every call to the service (the client library's own API object) is one."""
    api = store._firestore.client._firestore_api
    meter.wrap(api, ("batch_get_documents", "run_query", "commit"))


@contextmanager
def backend(name: str) -> Iterator[Backend]:
    if name == "sqlite":
        with tempfile.TemporaryDirectory() as directory:
            path = Path(directory) / "store.db"
            yield Backend(
                name, lambda: SqliteBatches(path), lambda: SqliteSchedule(path), _sqlite_metered
            )
        return
    with LocalEmulator(kind="firestore", project=PROJECT) as emulator:
        os.environ[emulator.env_var] = emulator.host
        from workerpool.batches.firestore import FirestoreBatches
        from workerpool.schedule.firestore import FirestoreSchedule

        collection = f"bench-{uuid.uuid4().hex[:8]}"
        try:
            yield Backend(
                name,
                lambda: FirestoreBatches(PROJECT, f"{collection}-batches"),
                lambda: FirestoreSchedule(PROJECT, f"{collection}-schedule"),
                _firestore_metered,
            )
        finally:
            del os.environ[emulator.env_var]


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


@dataclass
class ChildFigures:
    trips: float  # store round trips per child
    lost: float  # lost races per child
    cpu: float  # seconds per child
    rate: float  # children per second
    latency: float  # last child's write to its completion handed over, seconds


def children(used: Backend, count: int, writers: int) -> ChildFigures:
    job_ids = [f"child-{i}" for i in range(count)]
    batch_id = uuid.uuid4().hex
    setup = used.open_batches()
    setup.create(batch_id, TOPIC, "bench.done", job_ids, deadline=time.time() + 3600)
    setup.commit(batch_id)
    setup.close()
    schedule, publisher = used.open_schedule(), Publisher()
    firer = Firer(schedule, TOPIC, publisher)
    firer.start()
    meter = Meter()
    stores = [used.open_batches() for _ in range(writers)]
    for store in stores:
        used.metered(store, meter)
    finals: list[tuple[float, Completion]] = []

    def write(index: int) -> None:
        store = stores[index]
        for job_id in job_ids[index::writers]:
            started = time.time()
            completion = store.record(batch_id, job_id, True)
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
    trips = meter.trips - _trips_of_sent(used)  # less the delivery's own (``sent``)
    for store in stores:
        store.close()
    schedule.close()
    return ChildFigures(trips / count, meter.lost / count, cpu / count, count / wall, latency)


def _trips_of_sent(used: Backend) -> int:
    """The round trips of marking a completion sent: one transaction; a read and a write."""
    return 1 if used.name == "sqlite" else 2


def timers(used: Backend, rate: int, seconds: float) -> tuple[float, float, float, float]:
    """Lateness p50, p99 and max (seconds) of timers due at ``rate`` per second, and the
    store round trips per timer (adding, claiming, removing; both firers' idle reads too)."""
    meter = Meter()
    schedule, other, publisher = used.open_schedule(), used.open_schedule(), Publisher()
    used.metered(schedule, meter)
    used.metered(other, meter)
    start = time.time() + 1.0 + rate * seconds / 1000  # time to add them first
    dues = {f"t{rate}-{i}": start + i / rate for i in range(int(rate * seconds))}
    topic = f"{TOPIC}-{rate}-{uuid.uuid4().hex[:6]}"
    adder, reader = Firer(schedule, topic, publisher), Firer(other, topic, publisher)
    with ThreadPoolExecutor(8) as pool:  # adding many one by one is not what is measured
        list(
            pool.map(
                lambda job_id: schedule.add(Entry(topic, job_id, dues[job_id], b"{}", {
                    c.ATTR_JOB_ID: job_id})),
                dues,
            )
        )  # fmt: skip
    for due in dues.values():
        adder.expect(due)
    adder.start()
    reader.start()
    deadline = time.monotonic() + seconds + 60
    while len(publisher.at) < len(dues) and time.monotonic() < deadline:
        time.sleep(0.05)
    adder.stop(5)
    reader.stop(5)
    schedule.close()
    other.close()
    late = sorted(publisher.at[j] - due for j, due in dues.items())
    return (
        statistics.median(late),
        late[int(len(late) * 0.99) - 1],
        late[-1],
        meter.trips / len(dues),
    )


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="sqlite,firestore")
    parser.add_argument("--children", type=int, default=10_000)
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--tallies", default="32,1", help="Firestore: tallies per batch")
    parser.add_argument("--rates", default="100,1000")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args: Any = parser.parse_args(argv)
    stamp = Stamp()
    kids = Grid(
        f"A batch of {args.children:,} children, {args.writers} writers",
        "",
        ["backend", "round trips per child", "lost races per child", "CPU per child",
         "children/s", "last child's write to its completion handed over"],
    )  # fmt: skip
    timed = Grid(
        f"Timers, for {args.seconds:g} s",
        "",
        ["backend", "timers due per second", "lateness p50", "p99", "max",
         "round trips per timer"],
    )  # fmt: skip
    for name in args.backends.split(","):
        with backend(name) as used:
            for tallies in args.tallies.split(",") if name == "firestore" else [""]:
                label = (
                    f"{name}, {tallies} tall{'y' if tallies == '1' else 'ies'}" if tallies else name
                )
                if tallies:
                    from workerpool.batches import firestore

                    firestore.TALLIES = int(tallies)
                f = children(used, args.children, args.writers)
                kids.rows.append([label, f"{f.trips:.2f}", f"{f.lost:.3f}",
                                  f"{f.cpu * 1e6:,.0f} us", f"{f.rate:,.0f}",
                                  f"{f.latency * 1000:.1f} ms"])  # fmt: skip
            for each in (int(r) for r in args.rates.split(",")):
                p50, p99, worst, trips = timers(used, each, args.seconds)
                timed.rows.append([name, f"{each:,}", f"{p50 * 1000:.1f} ms",
                                   f"{p99 * 1000:.1f} ms", f"{worst * 1000:.1f} ms",
                                   f"{trips:.2f}"])  # fmt: skip
    command = command_line("python -m bench.batches", argv)
    title = "Batches and delayed jobs, at the store"
    emit(Section("batches", title, command, ABOUT, [kids, timed]), stamp, args.json)


if __name__ == "__main__":
    main(sys.argv[1:])
