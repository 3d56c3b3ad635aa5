"""``python -m bench.periodic``: periodic jobs at scale, many schedules on a fleet of workers.

Each size (``--schedules``, e.g. 100 and 1,000 schedules of ``every = "10s"``) runs on
``--workers`` real ``workerpool run`` processes (3) sharing an SQLite store, on the Pub/Sub
emulator started here, for ``--seconds`` of ticks. From the jobs' own ledger: whether every
tick in the window ran exactly once, and how late each started after its tick (p50, p99).
From the store: the round trips to it per tick, where a round trip is one SQL statement the
workers' periodic marks ran on the shared file (counted by SQLite's trace callback on their
connections, in the worker processes; the idempotency claims of the jobs are not counted).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from bench.results import Grid, Section, Stamp, command_line, emit
from workerpool.schedule import parse_not_before
from workerpool.testing.emulator import LocalEmulator
from workerpool.testing.pubsub import PubSubResources

ABOUT = [
    'Schedules of `every = "10s"` on 3 real `workerpool run` processes sharing an SQLite '
    "store, on the Pub/Sub emulator: every tick of the window must run exactly once (by the "
    "jobs' own ledger), and each run's start is measured from its tick. A round trip is one "
    "SQL statement the workers' periodic marks ran on the shared file (SQLite's trace callback "
    "on their connections); the jobs' idempotency claims are not counted. All the schedules "
    "tick at the same instant, so a tick is a burst of as many jobs as there are schedules. "
    "The last row divides the largest size's figures by the smallest's, in this run.",
]
SCHEDULE = """
[[schedules]]
name = "s{index:04d}"
job = "demo.sleep"
every = "10s"
payload = {{ seconds = 0 }}
"""
EVERY = 10.0
PREFIX = "periodic:"


def counted_worker(counts: Path, argv: list[str]) -> None:
    """Run ``workerpool ARGV`` in this process, counting the statements of its periodic marks
    in ``counts`` (rewritten every half second: a killed worker loses half a second)."""
    from workerpool.cli import main as cli
    from workerpool.periodic import sqlite as marks

    statements = [0]
    opened = marks.SqliteMarks.__init__

    def counting(self: marks.SqliteMarks, *args: object, **kwargs: object) -> None:
        opened(self, *args, **kwargs)  # type: ignore[arg-type]
        self._conn.set_trace_callback(lambda sql: statements.__setitem__(0, statements[0] + 1))

    marks.SqliteMarks.__init__ = counting  # type: ignore[method-assign]

    def dump() -> None:
        while True:
            counts.write_text(json.dumps({"statements": statements[0]}))
            time.sleep(0.5)

    threading.Thread(target=dump, daemon=True).start()
    cli(args=argv, prog_name="workerpool")


def statements(directory: Path) -> int:
    total = 0
    for path in directory.glob("counts-*.json"):
        try:
            total += json.loads(path.read_text())["statements"]
        except (ValueError, KeyError):  # caught mid-write: read again
            time.sleep(0.05)
            total += json.loads(path.read_text())["statements"]
    return total


def ledger(path: Path) -> list[dict[str, object]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Fleet:
    """``workers`` counted worker processes on one subscription and one SQLite store."""

    def __init__(self, env: PubSubResources, directory: Path, count: int) -> None:
        config = directory / "workerpool.toml"
        self.directory = directory
        self.ledger = directory / "ledger.jsonl"
        environment = {**os.environ, "PUBSUB_EMULATOR_HOST": env.host,
                       "WORKERPOOL_DEMO_LEDGER": str(self.ledger),
                       "WORKERPOOL_DEMO_LEDGER_STARTS": "1"}  # fmt: skip
        self.processes = []
        for i in range(count):
            args = [
                "run", "--config", str(config), "--project", env.project,
                "--subscription", env.subscription, "--idempotency-store",
                f"sqlite:///{directory / 'fleet.db'}", "--claim-ttl", "60",
            ]  # fmt: skip
            command = [sys.executable, "-m", "bench.periodic", "--counted-worker",
                       str(directory / f"counts-{i}.json"), *args]  # fmt: skip
            with open(directory / f"worker-{i}.log", "wb") as out:
                self.processes.append(subprocess.Popen(
                    command, env=environment, stdout=out, stderr=subprocess.STDOUT,
                    cwd=Path(__file__).resolve().parent.parent,
                ))  # fmt: skip

    def stop(self) -> None:
        stop(self.processes, 30)


def stop(processes: list[subprocess.Popen[bytes]], timeout: float) -> None:
    """SIGTERM each process that still runs, then wait for each (SIGKILL past ``timeout``)."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def started(path: Path) -> dict[str, list[float]]:
    """The start times of each job id's runs, by the ledger."""
    runs: dict[str, list[float]] = {}
    for event in ledger(path):
        if event["outcome"] == "start" and str(event["job_id"]).startswith(PREFIX):
            runs.setdefault(str(event["job_id"]), []).append(float(event["start"]))  # type: ignore[arg-type]
    return runs


def measure(env: PubSubResources, schedules: int, seconds: float) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="bench-periodic-") as name:
        directory = Path(name)
        (directory / "workerpool.toml").write_text(
            '[worker]\njobs = ["workerpool_jobs.demo"]\n'
            + "".join(SCHEDULE.format(index=i) for i in range(schedules))
        )
        fleet = Fleet(env, directory, 3)
        try:
            # The window: whole ticks after every worker counted its start-up.
            time.sleep(15)
            begin = (time.time() // EVERY + 1) * EVERY
            # Counted from just before a tick to just before the tick after the window's last:
            # each window holds as many bursts as ticks, whatever a burst leaves to the next.
            time.sleep(max(0.0, begin - time.time() - 0.5))
            before = statements(directory)
            ticks = [begin + EVERY * i for i in range(int(seconds // EVERY))]
            time.sleep(max(0.0, ticks[-1] + EVERY - 0.5 - time.time()))
            after = statements(directory)
            expected = {(f"s{i:04d}", t) for i in range(schedules) for t in ticks}
            deadline = time.time() + 120
            while time.time() < deadline:
                runs = _runs(fleet.ledger, ticks)
                if expected <= runs.keys():
                    break
                time.sleep(1)
        finally:
            fleet.stop()
        runs = _runs(fleet.ledger, ticks)
    late = sorted(start - tick for (_, tick), starts in runs.items() for start in starts[:1])
    counts = Counter(len(starts) for key, starts in runs.items() if key in expected)
    return {
        "schedules": schedules,
        "ticks": len(expected),
        "once": counts.get(1, 0),
        "twice": sum(n for k, n in counts.items() if k > 1),
        "missed": len(expected - runs.keys()),
        "p50": statistics.median(late) if late else float("nan"),
        "p99": statistics.quantiles(late, n=100, method="inclusive")[98] if late else float("nan"),
        "round_trips": (after - before) / len(expected),
    }


def _runs(path: Path, ticks: list[float]) -> dict[tuple[str, float], list[float]]:
    """The runs' start times by (schedule, tick), for the ticks of the window."""
    window = set(ticks)
    runs: dict[tuple[str, float], list[float]] = {}
    for job_id, starts in started(path).items():
        schedule, when = job_id[len(PREFIX) :].split(":", 1)
        tick = parse_not_before(when)
        if tick in window:
            runs[schedule, tick] = starts
    return runs


def main(argv: list[str]) -> None:
    if argv[:1] == ["--counted-worker"]:
        counted_worker(Path(argv[1]), argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", default="100,1000")
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    stamp = Stamp()
    grid = Grid(
        "", "",
        ["schedules x ticks (SQLite, 3 workers)", "ran once", "twice", "missed",
         "start lateness p50, s", "p99, s", "store round trips per tick"],
    )  # fmt: skip
    figures = []
    with LocalEmulator(kind="pubsub", project="workerpool-bench") as emulator:
        os.environ[emulator.env_var] = emulator.host
        for size in (int(n) for n in args.schedules.split(",")):
            env = PubSubResources(emulator.project, emulator.host)
            env.provision(retry_policy=False)
            f = measure(env, size, args.seconds)
            figures.append(f)
            grid.rows.append([
                f"{size:,} x {int(f['ticks']) // size}", f"{int(f['once']):,}",
                str(int(f["twice"])), str(int(f["missed"])), f"{f['p50']:.2f}",
                f"{f['p99']:.2f}", f"{f['round_trips']:.2f}",
            ])  # fmt: skip
            print(grid.rows[-1], flush=True)
    if len(figures) > 1:
        small, large = figures[0], figures[-1]
        grid.rows.append([
            f"{int(large['schedules']):,} / {int(small['schedules']):,}", "", "", "",
            f"{large['p50'] / small['p50']:.2f}", f"{large['p99'] / small['p99']:.2f}",
            f"{large['round_trips'] / small['round_trips']:.2f}",
        ])  # fmt: skip
    load = os.getloadavg()
    notes = [f"Load average (1, 5, 15 min) at the end: {load[0]:.1f}, {load[1]:.1f}, "
             f"{load[2]:.1f} on {len(os.sched_getaffinity(0))} CPUs."]  # fmt: skip
    command = command_line("python -m bench.periodic", argv)
    emit(Section("periodic", "Periodic jobs: many schedules on three workers", command, ABOUT,
                 [grid], notes), stamp, args.json)  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
