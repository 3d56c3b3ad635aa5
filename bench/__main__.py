"""``python -m bench``: workerpool against the plain google-cloud-pubsub subscriber and
gcloud-aio-pubsub, side by side, on a Pub/Sub emulator of its own.

The full run takes about 25 minutes on 2 cores, ``--quick`` under 2. Both print the tables;
``--json`` writes the results for BENCHMARKS.md (``python -m bench.summary`` runs this and
writes the report), ``--out`` a markdown report of this run alone.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from bench.consumer import IMPLS
from bench.harness import Bench, Collector, Consumer
from bench.report import draw, section, table_markdown, targets, write
from bench.results import Stamp, command_line, save
from bench.scenarios import FULL, QUICK, SCENARIOS, SHORT, Context
from workerpool.testing import pubsub_emulator

ROOT = Path(__file__).resolve().parent.parent
WARM_UP = 2_000  # messages through the emulator first, so its JIT is warm for every run


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--quick", action="store_true", help="small sizes, one run each")
    sizes.add_argument("--short", action="store_true", help="BENCHMARKS.md's sizes, 3 runs each")
    parser.add_argument("--runs", type=int, help="runs per implementation (default 3, quick 1)")
    parser.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--out", type=Path, help="a markdown report of this run")
    parser.add_argument("--json", type=Path, help="the results, for python -m bench.summary")
    parser.add_argument("--plots", type=Path, help="draw the plots into this folder (--json)")
    parser.add_argument(
        "--impls",
        nargs="+",
        choices=IMPLS,
        help="the implementations to compare (default: the plan's; e.g. add workerpool-async)",
    )
    parser.add_argument("--project", default="workerpool-bench")
    parser.add_argument(
        "--baseline",
        default="",
        metavar="REF",
        help="also run the workerpool of this git revision beside this one (before/after)",
    )
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    # SIGTERM unwinds like Ctrl-C, so the emulator and the consumers are stopped, not orphaned.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    plan = QUICK if args.quick else SHORT if args.short else FULL
    if args.runs is not None:
        if args.runs < 1:
            raise SystemExit("--runs must be at least 1")
        plan = type(plan)(**{**vars(plan), "runs": args.runs})
    if args.impls:
        plan = type(plan)(**{**vars(plan), "impls": args.impls, "impls_and_bare": args.impls})
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    began, t0, stamp = dt.datetime.now(dt.UTC), time.monotonic(), Stamp()

    def log(text: str) -> None:
        print(f"[{time.monotonic() - t0:5.0f} s] {text}", flush=True)

    with pubsub_emulator(args.project) as (host, how):
        os.environ["PUBSUB_EMULATOR_HOST"] = host
        log(f"Pub/Sub emulator: {how}")
        bench = Bench(args.project, Path(tempfile.mkdtemp(prefix="workerpool-bench-")))
        ctx = Context(bench, plan, log, baseline=args.baseline)
        try:
            with bench.resources("warm") as res:
                ids = set(bench.publish(res, WARM_UP))
                warm = Collector(bench, res)
                warm.wait_for(ids, time.monotonic() + 30)
                warm.stop()
            for name in args.scenarios:
                log(f"scenario {name}")
                try:
                    SCENARIOS[name](ctx)
                except (RuntimeError, KeyError, TypeError, ZeroDivisionError) as exc:
                    # One stuck or failed consumer: say so in the report, keep the rest.
                    ctx.anomalies.append(f"scenario {name} stopped: {type(exc).__name__}: {exc}")
                    log(f"scenario {name} stopped: {exc}")
        finally:
            Consumer.kill_all()
            bench.close()
    for table in ctx.tables:
        print("\n".join(table_markdown(table)))
    print("\n".join(targets(ctx)))
    took = time.monotonic() - t0
    command = command_line("python -m bench", argv)
    if args.out is not None:
        header = {
            "date": began.strftime("%Y-%m-%d %H:%M UTC"),
            "command": f"`{command}` ({took / 60:.0f} minutes), emulator: {how}",
        }
        write(ctx, header, args.out, args.out.parent / "bench" / "plots")
        log(f"written {args.out}")
    if args.json is not None:
        plots = draw(ctx, args.plots) if args.plots else []
        save(stamp.apply(section(ctx, command, plots, ROOT, args.json.stem)), args.json)
        log(f"written {args.json}")
    log(f"done in {took:.0f} s; consumer logs and reports in {bench.workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
