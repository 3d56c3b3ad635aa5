"""The project's own test helpers: real worker processes and their ledgers, polling, HTTP
probes (fresh Pub/Sub resources and in-process workers are the test kit's:
``workerpool.testing.pubsub``, through the pytest plugin's fixtures)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import pytest
from google.api_core import exceptions as gexc

from workerpool.slots import SlotStore
from workerpool.slots.allocation import ShareAsk
from workerpool.slots.keys import Limits
from workerpool.slots.sharding import Sharding
from workerpool.testing.emulator import free_port
from workerpool.testing.pubsub import PubSubResources


def http_get(url: str) -> tuple[int, str]:
    """(status, body) of a GET; (0, "") when nothing listens."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""  # not listening (yet, or any more)


def metric(port: int, series: str) -> float | None:
    """The value of ``series`` (a name and its labels as Prometheus writes them, e.g.
    ``workerpool_pool_held{pool="default"}``) on the worker serving /metrics on ``port``;
    None if it does not answer or has no such series."""
    _, text = http_get(f"http://127.0.0.1:{port}/metrics")
    prefix = f"{series} "
    values = [line[len(prefix) :] for line in text.splitlines() if line.startswith(prefix)]
    return float(values[0]) if values else None


def held_messages(port: int, pool: str) -> int:
    """The messages the worker serving /metrics on ``port`` holds now for ``pool`` (its
    ``workerpool.pool.held`` gauge; 0 if it does not answer)."""
    return int(metric(port, f'workerpool_pool_held{{pool="{pool}"}}') or 0)


def wait_for(predicate: Any, timeout: float, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` passes; return its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def shared_store(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path, *, warm: bool = False
) -> tuple[str, dict[str, str]]:
    """The URL of a store the worker processes of a test share ("sqlite": a file of the
    test's; "firestore": a collection of its own on the session's emulator, ``warm`` for a
    test that measures time), and the environment a process needs to reach it."""
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'fleet.db'}", {}
    from tests.conftest import FIRESTORE_PROJECT

    emulator = request.getfixturevalue("warm_firestore" if warm else "firestore_emulator")
    collection = f"fleet-{uuid.uuid4().hex[:10]}"
    return f"firestore://{FIRESTORE_PROJECT}/{collection}", {emulator.env_var: emulator.host}


def worker_command(env: PubSubResources, ledger: Path, *args: str, store: str = "") -> list[str]:
    """A ``workerpool run`` command on ``env``'s subscription, running workerpool_jobs.demo.
    Workers of one test share an SQLite idempotency store beside the ledger unless ``store``
    names another."""
    store = store or f"sqlite:///{ledger.parent / 'claims.db'}"
    return [
        sys.executable, "-m", "workerpool", "run",
        "--project", env.project,
        "--subscription", env.subscription,
        "--jobs", "workerpool_jobs.demo",
        "--min-backoff", "1",
        "--idempotency-store", store,
        *args,
    ]  # fmt: skip


@dataclass
class WorkerProcess:
    """A real worker process whose output goes to a file (a pipe nobody reads could fill up)."""

    process: subprocess.Popen[bytes]
    log: Path
    launched: float  # time.time() just before the process was started

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def ready(self) -> bool:
        """The worker has started its puller (the launcher logs "pulling" then)."""
        return " pulling " in self.output()

    def alive(self) -> bool:
        return self.process.poll() is None

    def signal(self, signum: int) -> float:
        """Send ``signum``; return the monotonic time it was sent."""
        self.process.send_signal(signum)
        return time.monotonic()

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout)

    def kill(self) -> None:
        """SIGKILL the process if it still runs, and reap it."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)


def spawn_worker(
    env: PubSubResources,
    ledger: Path,
    *args: str,
    store: str = "",
    extra_env: dict[str, str] | None = None,
    starts: bool = True,
) -> WorkerProcess:
    """Like ``start_worker``, but the output goes to a log file beside the ledger, ``extra_env``
    is added to the environment, and (``starts``) workerpool_jobs.demo also writes "start"
    ledger lines."""
    log = ledger.parent / f"worker-{uuid.uuid4().hex[:8]}.log"
    environment = {
        **os.environ,
        "PUBSUB_EMULATOR_HOST": env.host,
        "WORKERPOOL_DEMO_LEDGER": str(ledger),
        "WORKERPOOL_DEMO_LEDGER_STARTS": "1" if starts else "0",
        **(extra_env or {}),
    }
    launched = time.time()
    with open(log, "wb") as out:
        process = subprocess.Popen(
            worker_command(env, ledger, *args, store=store),
            env=environment,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return WorkerProcess(process, log, launched)


@contextlib.contextmanager
def worker_processes() -> Iterator[list[WorkerProcess]]:
    """Collects the workers a test spawns; any still alive at the end is SIGKILLed."""
    workers: list[WorkerProcess] = []
    try:
        yield workers
    finally:
        for worker in workers:
            with contextlib.suppress(Exception):
                worker.kill()


def catches_signal(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (SigCgt in /proc/PID/status); True
    for a process gone already (the wait for it says how it ended)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    [mask] = [line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")]
    return bool(int(mask, 16) >> (signum - 1) & 1)


def runs_workerpool(pid: int) -> bool:
    """Whether ``pid`` has become ``python -m workerpool``: until its exec, the forked child
    still has this process's command line and signal handlers."""
    try:
        return b"-m\0workerpool\0" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return True


def read_ledger(path: Path) -> list[dict[str, Any]]:
    """The ledger workerpool_jobs.demo writes; for one still being written, a last line without
    its newline yet is left out rather than parsed half-written."""
    if not path.exists():
        return []
    text = path.read_text()
    complete = text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]


def ledger_events(path: Path, outcome: str, pid: int | None = None) -> list[dict[str, Any]]:
    """Ledger lines with ``outcome`` ("start", "done", "cancelled", ...), of ``pid`` if given."""
    return [
        r for r in read_ledger(path) if r["outcome"] == outcome and (pid is None or r["pid"] == pid)
    ]


class _Closable(Protocol):
    def close(self) -> None: ...


S = TypeVar("S", bound=_Closable)


@contextlib.contextmanager
def store_handles(
    kind: str,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    *,
    memory: Callable[[], S],
    sqlite: Callable[[], S],
    firestore: Callable[[str], S],
) -> Iterator[Callable[[], S]]:
    """A function that opens handles on one backing store of ``kind`` ("memory", "sqlite" or
    "firestore", on the session's emulator, in a collection of its own), as several workers
    would; every handle is closed afterwards."""
    if kind == "memory":
        shared = memory()
        factory: Callable[[], S] = lambda: shared  # noqa: E731
    elif kind == "sqlite":
        factory = sqlite
    else:
        emulator = request.getfixturevalue("firestore_emulator")
        monkeypatch.setenv(emulator.env_var, emulator.host)  # undone after the test
        collection = f"test-{uuid.uuid4().hex[:12]}"
        factory = lambda: firestore(collection)  # noqa: E731
    opened: list[S] = []

    def make() -> S:
        opened.append(factory())
        return opened[-1]

    try:
        yield make
    finally:
        for store in opened:
            store.close()


def book(store: SlotStore, key: str, job_id: str, limit: int) -> float:
    """Defer ``job_id`` on ``key`` as a worker does (its come-back time, then its booking
    written) and return when it was told to come back."""
    booking = store.come_back(key, job_id, limit)
    store.book_many([(key, job_id, booking)])
    return booking.at


def pull_once(env: PubSubResources, max_messages: int = 100) -> list[Any]:
    """One pull from ``env``'s subscription, nothing acked: the received messages (none if
    the pull timed out)."""
    try:
        response = env.subscriber.pull(
            request={"subscription": env.subscription_path, "max_messages": max_messages},
            timeout=3,
        )
    except gexc.DeadlineExceeded:
        return []
    return list(response.received_messages)


def child_pids(pid: int) -> set[int]:
    """The pids of ``pid``'s live child processes (zombies left out)."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        state, parent = stat[stat.rindex(")") + 2 :].split()[:2]
        if int(parent) == pid and state != "Z":
            found.add(int(entry))
    return found


def overlap(intervals: list[tuple[float, float]], until: float | None = None) -> tuple[int, float]:
    """The most intervals open at once, and the time-weighted mean of how many were open
    between the first start and ``until`` (default: the last end)."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    until = events[-1][0] if until is None else until
    open_now = peak = 0
    area = 0.0
    last = events[0][0]
    for when, change in events:
        area += open_now * (max(last, min(when, until)) - last)
        open_now += change
        peak = max(peak, open_now)
        last = max(last, min(when, until))
    return peak, area / (until - events[0][0])


_COUNTED = """
CREATE TABLE IF NOT EXISTS slots (key TEXT PRIMARY KEY, record TEXT NOT NULL);
CREATE TABLE slot_writes (key TEXT NOT NULL, at REAL NOT NULL);
CREATE TRIGGER slot_written AFTER INSERT ON slots BEGIN
    INSERT INTO slot_writes VALUES (NEW.key, (julianday('now') - 2440587.5) * 86400.0);
END;
"""


def count_slot_writes(path: Path) -> None:
    """Every write of a key's record in the SQLite store at ``path`` (an insert, or the insert
    of an INSERT OR REPLACE) leaves a row in ``slot_writes``, by the store itself, whatever
    process wrote it."""
    with sqlite3.connect(path) as conn:
        conn.executescript(_COUNTED)


def slot_writes(path: Path) -> list[tuple[str, float]]:
    """The writes ``count_slot_writes`` counted: (key, epoch seconds) each."""
    with sqlite3.connect(path) as conn:
        rows = conn.execute("SELECT key, at FROM slot_writes ORDER BY at").fetchall()
    return [(str(key), float(at)) for key, at in rows]


def start_bulk_workers(
    workers: list[WorkerProcess],
    envs: list[PubSubResources],
    ledger: Path,
    limit: int,
    store: str,
    extra_env: dict[str, str],
    *args: str,
    shards: int = 1,
) -> None:
    """A worker process (N = 16) on each of ``envs`` running workerpool_jobs.demo_slots with
    its key "demo-slots" of ``limit`` slots leased in bulk (its record split into ``shards``,
    and ``args``, more options), added to ``workers``; returns when all are ready."""
    entry = f"demo-slots={limit}/bulk" + (f"/{shards}" if shards > 1 else "")
    for env in envs:
        workers.append(
            spawn_worker(
                env, ledger, "--jobs", "workerpool_jobs.demo_slots",
                "--concurrency", entry, "--concurrency", "tenant:*=1",
                "--max-outstanding", "16", *args, store=store, extra_env=extra_env,
            )
        )  # fmt: skip
    ready = wait_for(lambda: all(w.ready() for w in workers), timeout=60)
    assert ready, workers[0].output()[-2000:]


def run_to_the_end(
    workers: list[WorkerProcess], ledger: Path, count: int, timeout: float
) -> list[int]:
    """Once ``count`` jobs are done in ``ledger`` (asserted within ``timeout`` seconds), the
    workers stopped with SIGTERM: their exit codes."""
    finished = wait_for(lambda: len(ledger_events(ledger, "done")) >= count, timeout=timeout)
    assert finished, f"{len(ledger_events(ledger, 'done'))} of {count} done"
    for worker in workers:
        worker.signal(signal.SIGTERM)
    return [worker.wait(30) for worker in workers]


def subscriptions_of_their_own(
    stack: contextlib.ExitStack, first: PubSubResources, count: int
) -> list[PubSubResources]:
    """``first`` and ``count - 1`` more subscriptions on its emulator, each with a topic of its
    own, provisioned without a retry policy; the new ones closed with ``stack``."""
    subs = [first] + [PubSubResources(first.project, first.host) for _ in range(count - 1)]
    for sub in subs[1:]:
        stack.callback(sub.close)
    for sub in subs:
        sub.provision(retry_policy=False)
    return subs


@contextlib.contextmanager
def dashboard_process(
    config: Path, log: Path, *args: str, env: dict[str, str] | None = None
) -> Iterator[str]:
    """A ``workerpool dashboard --config CONFIG ARGS`` process on a free port (``env`` added
    to the environment), its output in ``log``: its URL, once it answers."""
    port = free_port()
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "workerpool", "dashboard", "--config", str(config),
             "--bind", f"127.0.0.1:{port}", *args],
            env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_for(lambda: http_get(url + "/keys")[0] == 200, 30), log.read_text()
        yield url
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(10)


def split_key_in_use(store: SlotStore, key: str, wants: dict[str, int]) -> None:
    """Replicas of ``key`` (20 slots leased in bulk, in 2 shards) that ran rounds and a
    rebalance (the first: the limit split evenly), then a round each into their parts."""
    limits = Limits({key: 20}, {key}, {key: 2})
    sides = {r: Sharding(store, r, limits, period=0.0) for r in wants}
    for _ in range(2):
        for replica, want in wants.items():
            sides[replica].lease([ShareAsk(key, replica, 20, want, want)], 60)
            sides[replica].keep_balanced({key: (0, want)})
