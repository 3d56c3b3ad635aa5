"""``python -m bench.ordering``: ordered against unordered, at N = 100, in one run.

Three cases on one emulator, each with a fresh topic and subscription and one ``workerpool
run`` process running ``demo.sleep`` jobs: unordered, ordered with 1,000 keys, ordered with 10
keys (the same jobs, published with keys). For each: jobs per second from the first start to
the last end, and the slots' utilisation over that span (mean running / N), from the jobs' own
ledger; then each ordered case as a ratio of the unordered one. The machine may be shared, so
compare the ratios, not the rates. With 10 keys at most 10 jobs can run at once: its
utilisation is bounded by 10 / N.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.results import Grid, Section, Stamp, command_line, emit
from workerpool.publishing import JobMessage, publish_many
from workerpool.testing.emulator import LocalEmulator
from workerpool.testing.pubsub import PubSubResources

PROJECT = "bench-ordering"


@dataclass(frozen=True)
class Case:
    name: str
    keys: int  # 0: no ordering key, on an unordered subscription


@dataclass(frozen=True)
class Result:
    case: Case
    jobs_per_second: float
    utilisation: float


CASES = (Case("unordered", 0), Case("ordered, 1,000 keys", 1000), Case("ordered, 10 keys", 10))


def run_case(host: str, case: Case, jobs: int, n: int, seconds: float, work: Path) -> Result:
    env = PubSubResources(PROJECT, host)
    env.provision(ordered=case.keys > 0)
    messages = [
        JobMessage(
            "demo.sleep",
            {"seconds": seconds},
            f"j{i}",
            ordering_key=f"key-{i % case.keys}" if case.keys else "",
        )
        for i in range(jobs)
    ]
    for _ in publish_many(env.publisher, env.topic_path, messages):
        pass
    ledger = work / f"{case.keys}.jsonl"
    command = [
        sys.executable, "-m", "workerpool", "run", "--project", PROJECT,
        "--subscription", env.subscription, "--jobs", "workerpool_jobs.demo",
        "--max-outstanding", str(n),
        "--idempotency-store", f"sqlite:///{work / f'{case.keys}.db'}",
    ]  # fmt: skip
    environment = {
        **os.environ,
        "PUBSUB_EMULATOR_HOST": host,
        "WORKERPOOL_DEMO_LEDGER": str(ledger),
    }
    with open(work / f"{case.keys}.log", "wb") as out:
        worker = subprocess.Popen(command, env=environment, stdout=out, stderr=subprocess.STDOUT)
    try:
        runs = _wait_for_done(ledger, jobs, timeout=600)
    finally:
        worker.terminate()
        worker.wait(60)
    begin, end = min(r["start"] for r in runs), max(r["end"] for r in runs)
    busy = sum(r["end"] - r["start"] for r in runs)
    return Result(case, jobs / (end - begin), busy / ((end - begin) * n))


def _wait_for_done(ledger: Path, jobs: int, timeout: float) -> list[dict[str, float]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = ledger.read_text().splitlines() if ledger.exists() else []
        runs = [run for run in map(json.loads, lines) if run["outcome"] == "done"]
        if len({run["job_id"] for run in runs}) >= jobs:
            return runs
        time.sleep(0.5)
    raise TimeoutError(f"{ledger}: not every job done in {timeout:.0f}s")


ABOUT = [
    "One `workerpool run` process at N slots runs the same `demo.sleep` jobs three times, each "
    "on a fresh topic and subscription of one emulator: unordered, then ordered with 1,000 "
    "keys, then ordered with 10 keys. Jobs per second from the first start to the last end, "
    "and the slots' utilisation over that span (mean running / N), from the jobs' own ledger; "
    "the ratios are to the unordered case of the same run. With 10 keys at most 10 jobs run "
    "at once, so its utilisation is bounded by 10 / N (its ratio is not, where the unordered "
    "case keeps fewer than N busy).",
]


def grid(results: list[Result], n: int, jobs: int, seconds: float) -> Grid:
    base = results[0]
    table = Grid(
        "",
        "",
        [f"N = {n}, {jobs:,} jobs of {seconds * 1000:.0f} ms", "jobs/s", "utilisation",
         "jobs/s ratio", "utilisation ratio"],
    )  # fmt: skip
    for r in results:
        table.rows.append([
            r.case.name, f"{r.jobs_per_second:,.0f}", f"{r.utilisation:.2f}",
            f"{r.jobs_per_second / base.jobs_per_second:.2f}",
            f"{r.utilisation / base.utilisation:.2f}",
        ])  # fmt: skip
    return table


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=4000)
    parser.add_argument("--n", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=0.05, help="each job's sleep")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    stamp = Stamp()
    with LocalEmulator("pubsub", project=PROJECT) as emulator, tempfile.TemporaryDirectory() as d:
        os.environ["PUBSUB_EMULATOR_HOST"] = emulator.host  # for this process's clients too
        results = [
            run_case(emulator.host, case, args.jobs, args.n, args.seconds, Path(d))
            for case in CASES
        ]
    title = "Ordered subscriptions against unordered"
    command = command_line("python -m bench.ordering", argv)
    table = grid(results, args.n, args.jobs, args.seconds)
    emit(Section("ordering", title, command, ABOUT, [table]), stamp, args.json)


if __name__ == "__main__":
    main(sys.argv[1:])
