"""``python -m bench.periodic``: periodic jobs at scale, many schedules on a fleet of workers.

Each size (``--schedules``, e.g. 100 and 1,000 schedules of ``every = "10s"``) runs on
``--workers`` real ``workerpool run`` processes (3) sharing an SQLite store, on the Pub/Sub
emulator started here, for ``--seconds`` of ticks. From the jobs' own ledger: whether every
tick in the window ran exactly once, and how late each started after its tick (p50, p99).
From the store: the round trips to it per tick, where a round trip is one SQL statement the
workers' periodic marks ran on the shared file (counted by SQLite's trace callback on their
connections, in the worker processes; the idempotency claims of the jobs are not counted).
``--baseline REF`` runs each size again with the workers of git revision REF (this bench,
its workerpool), after this revision's, in the same run.
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

from bench.harness import ROOT, revision_tree
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
    "Columns marked @REF: the workers of revision REF, run right after this revision's at each "
    "size; ran once, twice and missed give this revision's / REF's. The last row divides the "
    "largest size's figures by the smallest's, in this run.",
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
    """``workers`` counted worker processes on one subscription and one SQLite store, running
    the workerpool of ``tree`` (a directory that holds it and ``bench``)."""

    def __init__(self, env: PubSubResources, directory: Path, count: int, tree: Path) -> None:
        config = directory / "workerpool.toml"
        self.directory = directory
        self.ledger = directory / "ledger.jsonl"
        environment = {**os.environ, "PUBSUB_EMULATOR_HOST": env.host,
                       "WORKERPOOL_DEMO_LEDGER": str(self.ledger),
                       "WORKERPOOL_DEMO_LEDGER_STARTS": "1",
                       "PYTHONPATH": str(tree)}  # fmt: skip
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
                # (run from the tree: ``-m`` puts the working directory first on the path)
                self.processes.append(subprocess.Popen(
                    command, env=environment, stdout=out, stderr=subprocess.STDOUT, cwd=tree,
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


def measure(env: PubSubResources, schedules: int, seconds: float, tree: Path) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="bench-periodic-") as name:
        directory = Path(name)
        (directory / "workerpool.toml").write_text(
            '[worker]\njobs = ["workerpool_jobs.demo"]\n'
            + "".join(SCHEDULE.format(index=i) for i in range(schedules))
        )
        fleet = Fleet(env, directory, 3, tree)
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
    parser.add_argument("--baseline", help="also run each size with this git revision's workers")
    args = parser.parse_args(argv)
    stamp = Stamp()
    refs = ["", args.baseline] if args.baseline else [""]
    figures: dict[str, list[dict[str, float]]] = {ref: [] for ref in refs}
    with LocalEmulator(kind="pubsub", project="workerpool-bench") as emulator, \
            tempfile.TemporaryDirectory(prefix="bench-periodic-trees-") as trees:  # fmt: skip
        os.environ[emulator.env_var] = emulator.host
        revisions = {ref: revision_tree(Path(trees), ref) if ref else ROOT for ref in refs}
        for size in (int(n) for n in args.schedules.split(",")):
            for ref, tree in revisions.items():
                env = PubSubResources(emulator.project, emulator.host)
                env.provision(retry_policy=False)
                figures[ref].append(measure(env, size, args.seconds, tree))
                print(ref or "this revision", figures[ref][-1], flush=True)
    load = os.getloadavg()
    notes = [f"Load average (1, 5, 15 min) at the end: {load[0]:.1f}, {load[1]:.1f}, "
             f"{load[2]:.1f} on {len(os.sched_getaffinity(0))} CPUs."]  # fmt: skip
    command = command_line("python -m bench.periodic", argv)
    emit(Section("periodic", "Periodic jobs: many schedules on three workers", command, ABOUT,
                 [table(figures, refs)], notes), stamp, args.json)  # fmt: skip


# The figures of a run shown for each revision, and the counts.
FIGURES = ("p50", "p99", "round_trips")
COUNTS = ("once", "twice", "missed")


def table(figures: dict[str, list[dict[str, float]]], refs: list[str]) -> Grid:
    """A row for each size: the counts of each revision in ``refs`` ("" this one) side by
    side, then this revision's figures, then each baseline's; then the ratios of the largest
    size's figures to the smallest's."""
    header = ["schedules x ticks (SQLite, 3 workers)", "ran once", "twice", "missed",
              "start lateness p50, s", "p99, s", "store round trips per tick"]  # fmt: skip
    for ref in refs[1:]:
        header += [f"p50 @{ref}", f"p99 @{ref}", f"round trips @{ref}"]
    grid = Grid("", "", header)
    for runs in zip(*(figures[ref] for ref in refs), strict=True):
        size = int(runs[0]["schedules"])
        grid.rows.append([
            f"{size:,} x {int(runs[0]['ticks']) // size}",
            *(" / ".join(f"{int(run[k]):,}" for run in runs) for k in COUNTS),
            *(f"{run[k]:.2f}" for run in runs for k in FIGURES),
        ])  # fmt: skip
    ours = figures[""]
    if len(ours) > 1:
        grid.rows.append([
            f"{int(ours[-1]['schedules']):,} / {int(ours[0]['schedules']):,}", "", "", "",
            *(f"{figures[ref][-1][k] / figures[ref][0][k]:.2f}" for ref in refs for k in FIGURES),
        ])  # fmt: skip
    return grid


if __name__ == "__main__":
    main(sys.argv[1:])
