"""``python -m bench.ordering``: ordered against unordered, at N = 100, in one run.

Cases on one emulator, each with a fresh topic and subscription and one consumer process
running jobs that sleep: ``workerpool run`` unordered, ordered with 1,000 keys, ordered with
10 keys (the same jobs, published with keys); then the plain client's ``subscribe()``
unordered and ordered with 1,000 keys, the same case without workerpool. For each: jobs per
second from the first start to the last end, and the slots' utilisation over that span (mean
running / N), from the jobs' own records; then each ordered case as a ratio of the unordered
one of its consumer. The cases run in turn, ``--runs`` times, and each figure is the median of
its runs: on a shared machine one run's ratio swung from 0.42 to 1.34. With 10 keys at most 10
jobs can run at once: its utilisation is bounded by 10 / N.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
    plain: bool = False  # the plain client's subscribe(), not workerpool


@dataclass(frozen=True)
class Result:
    case: Case
    jobs_per_second: float
    utilisation: float


CASES = (
    Case("unordered", 0),
    Case("ordered, 1,000 keys", 1000),
    Case("ordered, 10 keys", 10),
    Case("plain client, unordered", 0, plain=True),
    Case("plain client, ordered, 1,000 keys", 1000, plain=True),
)


def run_case(host: str, case: Case, jobs: int, n: int, seconds: float, work: Path) -> Result:
    env = PubSubResources(PROJECT, host)
    env.provision(ordered=case.keys > 0)
    messages = [
        JobMessage(
            "demo.sleep",
            {"seconds": seconds},
            f"j-{i}",  # RUN-INDEX, as bench.consumer reads them
            ordering_key=f"key-{i % case.keys}" if case.keys else "",
        )
        for i in range(jobs)
    ]
    for _ in publish_many(env.publisher, env.topic_path, messages):
        pass
    work = Path(tempfile.mkdtemp(dir=work))
    if case.plain:
        return _result(case, _plain(env, jobs, n, seconds, work), jobs, n)
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
    return _result(case, [(r["start"], r["end"]) for r in runs], jobs, n)


def _plain(
    env: PubSubResources, jobs: int, n: int, seconds: float, work: Path
) -> list[tuple[float, float]]:
    """Every run's (start, end) by the plain client's ``subscribe()`` (bench.consumer)."""
    report = work / "plain.json"
    command = [
        sys.executable, "-m", "bench.consumer", "plain", "--project", PROJECT,
        "--subscription", env.subscription, "--n", str(n), "--expect", str(jobs),
        "--seconds", str(seconds), "--report", str(report), "--intervals", "--prefetch", "0",
    ]  # fmt: skip
    with open(work / "plain.log", "wb") as out:
        subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=600, check=True)
    return [(start, end) for _, start, end in json.loads(report.read_text())["intervals"]]


def _result(case: Case, runs: list[tuple[float, float]], jobs: int, n: int) -> Result:
    begin, end = min(start for start, _ in runs), max(end for _, end in runs)
    busy = sum(end - start for start, end in runs)
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
    "One `workerpool run` process at N slots runs the same `demo.sleep` jobs, each time on a "
    "fresh topic and subscription of one emulator: unordered, then ordered with 1,000 keys, "
    "then ordered with 10 keys; then the plain client's `subscribe()` (flow control N, N "
    "threads) runs the same jobs unordered and ordered with 1,000 keys. Jobs per second from "
    "the first start to the last end, and the slots' utilisation over that span (mean running "
    "/ N), from the jobs' own records. The cases run in turn, the whole round 3 times: each "
    "cell is the median of its case's runs (min-max); a ratio is of the medians' utilisation, "
    "to the unordered case of the same consumer, and beside it each run's own ratio, in the "
    "order they ran. With 10 keys at most 10 jobs run at once, so its utilisation is bounded "
    "by 10 / N (its ratio is not, where the unordered case keeps fewer than N busy).",
]


def grid(rounds: list[list[Result]], n: int, jobs: int, seconds: float) -> Grid:
    """A row per number of keys: workerpool's figures, then the plain client's beside them."""
    at = {(r.case.keys, r.case.plain): i for i, r in enumerate(rounds[0])}
    table = Grid(
        "",
        "",
        [f"N = {n}, {jobs:,} jobs of {seconds * 1000:.0f} ms", "jobs/s", "utilisation",
         "ratio", "ratio, each run", "plain client: utilisation", "ratio", "ratio, each run"],
    )  # fmt: skip
    for (keys, plain), i in at.items():
        if plain:
            continue
        rate = statistics.median(run[i].jobs_per_second for run in rounds)
        other = at.get((keys, True))
        table.rows.append([
            rounds[0][i].case.name, f"{rate:,.0f}", *_figures(rounds, i, at[0, False]),
            *(_figures(rounds, other, at[0, True]) if other is not None else ["", "", ""]),
        ])  # fmt: skip
    return table


def _figures(rounds: list[list[Result]], i: int, base: int) -> list[str]:
    """Case ``i``'s median utilisation (min-max), its ratio of medians to case ``base``'s,
    and each run's own ratio, in the order they ran."""
    own = [run[i].utilisation for run in rounds]
    ref = [run[base].utilisation for run in rounds]
    ratio = statistics.median(own) / statistics.median(ref)
    each = ", ".join(f"{o / b:.2f}" for o, b in zip(own, ref, strict=True))
    return [f"{statistics.median(own):.2f} ({min(own):.2f}-{max(own):.2f})", f"{ratio:.2f}", each]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=4000)
    parser.add_argument("--n", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=0.05, help="each job's sleep")
    parser.add_argument("--runs", type=int, default=3, help="rounds of every case")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    stamp = Stamp()
    rounds = []
    with LocalEmulator("pubsub", project=PROJECT) as emulator, tempfile.TemporaryDirectory() as d:
        os.environ["PUBSUB_EMULATOR_HOST"] = emulator.host  # for this process's clients too
        for _ in range(args.runs):
            rounds.append([
                run_case(emulator.host, case, args.jobs, args.n, args.seconds, Path(d))
                for case in CASES
            ])  # fmt: skip
            print("  ".join(f"{r.case.name}: {r.utilisation:.2f}" for r in rounds[-1]), flush=True)
    title = "Ordered subscriptions against unordered"
    command = command_line("python -m bench.ordering", argv)
    table = grid(rounds, args.n, args.jobs, args.seconds)
    emit(Section("ordering", title, command, ABOUT, [table]), stamp, args.json)


if __name__ == "__main__":
    main(sys.argv[1:])
