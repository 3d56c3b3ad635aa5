"""``python -m bench.summary`` (``make bench-report``): run each benchmark of bench/ with the
report's short settings, each writing its results to bench/results/NAME.json, then write
BENCHMARKS.md from every result there.

``--only NAME ...`` runs those alone: the others' results are kept, and the report marks them
carried over from the commit that measured them. ``--render`` runs nothing and rewrites the
report from the results as they are. A runner that fails is reported, and its earlier
results, if any, are carried over.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import subprocess
import sys
from pathlib import Path

from bench.results import load, machine
from bench.summary.render import render

ROOT = Path(__file__).resolve().parent.parent.parent
# Each runner with the report's settings, in the report's order: sizes a quarter of each
# runner's defaults or less, so the whole fits in about 20 minutes of a shared 2-core machine.
# Ordering keeps its defaults (about a minute): with fewer jobs the unordered case is still
# ramping up when it ends, and its ratios say more about the start than about ordering.
PUBSUB_SCENARIOS = ["throughput", "utilisation", "drain", "soak", "rate"]
RUNS: dict[str, list[str]] = {
    "pubsub": ["bench", "--short", "--plots", "bench/plots", "--scenarios", *PUBSUB_SCENARIOS],
    # What a job costs, against the commit before the work on it (its figures are "before").
    "cost": ["bench", "--short", "--scenarios", "cost", "parts", "--baseline", "debc876"],
    "autoscale": ["bench.autoscale"],
    "slots": ["bench.slots", "--seconds", "3", "--pairs", "200"],
    "slot_shards": ["bench.slot_shards"],
    "ordering": ["bench.ordering"],
    "batches": ["bench.batches", "--children", "2000", "--seconds", "2"],
    "http_delivery": ["bench.http_delivery", "--count", "2000"],
    # Periodic: beside the last revision that published a burst of ticks one by one.
    "periodic": [
        "bench.periodic",
        "--schedules",
        "100,1000",
        "--seconds",
        "30",
        "--baseline",
        "debc876",
    ],
    "dashboard": ["bench.dashboard"],  # the sizes the dashboard must render under a second at
}


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.summary", description=__doc__)
    parser.add_argument("--only", nargs="+", choices=list(RUNS), default=list(RUNS))
    parser.add_argument("--render", action="store_true", help="run nothing, only write")
    parser.add_argument("--out", type=Path, default=ROOT / "BENCHMARKS.md")
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    return parser.parse_args(argv)


def run(name: str, results: Path) -> bool:
    module, *args = RUNS[name]
    command = [sys.executable, "-m", module, *args, "--json", str(results / f"{name}.json")]
    print(f"{dt.datetime.now(dt.UTC):%H:%M:%S} running {' '.join(command[1:])}", flush=True)
    # The runner's own tables go to our output as it prints them.
    return subprocess.run(command, cwd=ROOT, check=False).returncode == 0


def main(argv: list[str]) -> int:
    args = parse(argv)
    failed = [] if args.render else [name for name in args.only if not run(name, args.results)]
    found = {path.stem: path for path in args.results.glob("*.json")}
    order = [name for name in RUNS if name in found] + sorted(found.keys() - RUNS.keys())
    sections = [load(found[name]) for name in order]
    generated = f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M UTC}"
    args.out.write_text(render(sections, generated, machine()))
    print(f"wrote {args.out} from {len(sections)} results; failed: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main(sys.argv[1:]))
