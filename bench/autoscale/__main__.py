"""``python -m bench.autoscale``: replay the workload traces through workerpool's autoscaler,
a KEDA-like scaler and always-on, against the oracle, and print the tables (``--json``: also
write the results for BENCHMARKS.md, and bench/plots/autoscale.png).

These are model results (bench/autoscale/fleet.py says what is modelled), the same on any
machine: the traces are seeded and nothing depends on a clock.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from bench.autoscale.fleet import Scaler, Setup, simulate
from bench.autoscale.oracle import oracle
from bench.autoscale.report import Runs, plot, setup_lines, table, targets_grid
from bench.autoscale.scalers import KedaLike, Ours
from bench.autoscale.traces import traces
from bench.results import Section, Stamp, command_line, emit
from workerpool.autoscale.policy import Policy

ROOT = Path(__file__).resolve().parent.parent.parent
PLOT = ROOT / "bench" / "plots" / "autoscale.png"
SCALERS = """\
- **oracle**: a lower bound on what any scaler that knows the trace bills and meets the SLA, \
jobs run in publish order as in every run here: work / slots + k x cold start, k the fewest \
always-on replicas that meet the SLA (a search; bench/autoscale/oracle.py says why no \
schedule bills less). Its p95 is not a run's: it is no schedule, only a bound.
- **always-on (k)**: those k replicas, serving from before the first job to the end: the \
cheapest always-on fleet that meets the SLA at the trace's peak.
- **KEDA-like**: every 30 s, Cloud Monitoring's backlog (as lagged as ours), active above 0, \
one replica per {per_replica:g} unacked messages (KEDA's default is 10; {per_replica:g} is the \
target ours aims at), scale-in only to the highest count of the last 300 s, and a scale-in \
stops pods mid-run (starting ones first, then the newest): each run lost comes back after \
the ack deadline.
- **workerpool (W s window)**: `Autoscaler.step()` every 1 s (`--interval`), reading beats \
written every 2 s; while the fleet is at zero, a probe of up to {probe_limit:,} messages \
({max_replicas} replicas x {slots} slots), given back at once, and not repeated while the \
replicas it woke start; Cloud Monitoring's backlog every 30 s, less what the fleet has taken \
since the point was taken; `decide()` with a W s window and a {target:.0%} target; a \
scale-in drains (starting replicas first, then the least busy by their beats), billed until \
the last run ends. The policy's default window is {window:g} s; 0 s is shown beside it.
- **workerpool, no Monitoring**: the same where Monitoring cannot be read (the emulator, or \
no permission).
"""


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.autoscale", description=__doc__)
    parser.add_argument("--json", type=Path, help="also write the results here, and the plot")
    parser.add_argument(
        "--scale-down-delay", type=float, default=Policy().scale_down_delay,
        help="our policy's stabilisation window, seconds",
    )  # fmt: skip
    args = parser.parse_args(argv)
    stamp, setup, workloads = Stamp(), Setup(), traces()
    policy = Policy(scale_down_delay=args.scale_down_delay, max_replicas=setup.max_replicas)
    windows = sorted({policy.scale_down_delay, 0.0}, reverse=True)
    ours = [Ours(replace(policy, scale_down_delay=w)) for w in windows]
    scalers: list[Scaler] = [KedaLike(), *ours, Ours(policy, monitoring=False)]
    runs = []
    for trace in workloads:
        found = oracle(trace, setup)
        outcomes = {f"always-on ({found.replicas})": found.always_on}
        outcomes |= {s.name: simulate(trace, s, setup) for s in scalers}
        runs.append(Runs(trace, found, outcomes))
    about = [
        f"Model results, not measurements (numpy {np.__version__}, seeded traces: the same on "
        "any machine). workerpool's own autoscaler (its loop, signal reader and policy) runs "
        "against a model of the fleet and of what it reads (bench/autoscale/fleet.py says what "
        "is modelled); x oracle is instance-seconds over the oracle's, in the same run.",
        "",
        *setup_lines(setup, workloads),
        "",
        *SCALERS.format(
            window=Policy().scale_down_delay,
            target=policy.target_utilisation,
            per_replica=KedaLike().per_replica,
            probe_limit=policy.max_replicas * setup.slots,
            max_replicas=policy.max_replicas,
            slots=setup.slots,
        ).splitlines(),
        "",
    ]
    command = command_line("python -m bench.autoscale", argv)
    grids = [table(runs), targets_grid(runs, [o.name for o in ours], setup)]
    drawn = plot(runs, PLOT, shown=4) if args.json else None
    plots = [str(drawn.relative_to(ROOT))] if drawn else []
    title = "Autoscaling, in simulation"
    emit(Section("autoscale", title, command, about, grids, plots=plots), stamp, args.json)


if __name__ == "__main__":
    main(sys.argv[1:])
