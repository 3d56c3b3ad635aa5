"""The runs' table, the simulator's targets and the plot."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.autoscale.fleet import Outcome, Setup
from bench.autoscale.oracle import Oracle
from bench.autoscale.traces import Trace
from bench.results import Grid, grid_markdown


@dataclass(frozen=True)
class Runs:
    """One trace's runs: the oracle (with its always-on fleet) and each scaler's outcome."""

    trace: Trace
    oracle: Oracle
    outcomes: dict[str, Outcome]  # by scaler name: always-on first, then in the order they ran


def _seconds(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def table(runs: list[Runs]) -> Grid:
    header = ["trace", "scaler", "instance-seconds", "x oracle", "p95 wait, s", "max wait, s",
              "jobs killed by scale-in", "idle cost, instance-s", "most replicas",
              "most probes of a message"]  # fmt: skip
    return Grid("Runs", "", header, [row for each in runs for row in _rows(each)])


def _rows(runs: Runs) -> list[list[str]]:
    bound = runs.oracle.instance_seconds
    name = runs.trace.name
    rows = [
        [name, f"oracle (lower bound; {runs.oracle.replicas} replicas)", f"{bound:,.0f}", "1.00",
         "-", "-", "0", "0", str(runs.oracle.replicas), "-"]
    ]  # fmt: skip
    for scaler, out in runs.outcomes.items():
        rows.append(
            [name, scaler, f"{out.instance_seconds:,.0f}", f"{out.instance_seconds / bound:.2f}",
             _seconds(out.p95_wait), _seconds(out.waits[-1]), str(out.killed),
             f"{out.idle_cost:,.0f}", str(out.peak), str(out.most_probed)]
        )  # fmt: skip
    return rows


def targets(runs: list[Runs], ours: list[str], setup: Setup) -> list[str]:
    return grid_markdown(targets_grid(runs, ours, setup))


def targets_grid(runs: list[Runs], ours: list[str], setup: Setup) -> Grid:
    """The simulator's targets, met or not, for each scaler named in ``ours``."""
    month = next(r for r in runs if r.trace.name == "month-end")
    rows: list[tuple[str, list[tuple[str, bool]]]] = []

    def row(what: str, figure: Callable[[Runs, Outcome], tuple[str, bool]], each: Runs) -> None:
        rows.append((what, [figure(each, each.outcomes[name]) for name in ours]))

    row("month-end: instance-seconds <= 1.2 x oracle", _cost, month)
    row(f"month-end: p95 wait <= cold start + 30 s = {setup.sla:g} s", _p95(setup.sla), month)
    for each in runs:
        row(f"{each.trace.name}: jobs killed by scale-in = 0", _killed, each)
    for each in runs:
        row(f"{each.trace.name}: idle cost = 0", _idle, each)
    grid = Grid("Targets", "", ["target", *(cell for name in ours for cell in (name, "met"))])
    for what, figures in rows:
        cells = (cell for value, met in figures for cell in (value, "yes" if met else "**no**"))
        grid.rows.append([what, *cells])
    return grid


def _cost(runs: Runs, out: Outcome) -> tuple[str, bool]:
    ratio = out.instance_seconds / runs.oracle.instance_seconds
    return f"{ratio:.2f} x", ratio <= 1.2


def _p95(sla: float) -> Callable[[Runs, Outcome], tuple[str, bool]]:
    return lambda _, out: (f"{out.p95_wait:.1f} s", out.p95_wait <= sla)


def _killed(_: Runs, out: Outcome) -> tuple[str, bool]:
    return str(out.killed), not out.killed


def _idle(_: Runs, out: Outcome) -> tuple[str, bool]:
    return f"{out.idle_cost:,.0f} instance-s", not out.idle_cost


def setup_lines(setup: Setup, traces: list[Trace]) -> list[str]:
    """What the runs assume, and the traces."""
    lines = [
        f"- replicas: {setup.slots} slots each (`--max-outstanding`), prefetch {setup.prefetch}, "
        f"cold start {setup.cold_start:g} s, at most {setup.max_replicas}; "
        f"ack deadline {setup.ack_deadline:g} s",
        f"- SLA, every trace and scaler: p95 wait (publish to the start of the run that "
        f"finishes) <= cold start + {setup.sla_slack:g} s = {setup.sla:g} s",
        f"- idle cost: instance-seconds billed while no job waits or runs, from "
        f"{setup.idle_grace:g} s after the last run ended until the next publish",
    ]
    lines += [f"- {t.name}: {t.about} ({len(t.arrivals):,} jobs)" for t in traces]
    return lines


def plot(runs: list[Runs], path: Path, shown: int) -> Path | None:
    """Replicas billed and messages waiting over time, per trace, for the first ``shown``
    scalers; None, said aloud, without matplotlib (the ``bench`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot")
        return None
    fig, grid = plt.subplots(2, len(runs), figsize=(5 * len(runs), 6), squeeze=False)
    for column, each in enumerate(runs):
        scale, unit = (3600.0, "h") if each.trace.zoom > 2 * 3600 else (60.0, "min")
        for name, out in list(each.outcomes.items())[:shown]:
            times = [t / scale for t, _, _ in out.timeline]
            grid[0][column].step(times, [n for _, n, _ in out.timeline], where="post", label=name)
            grid[1][column].step(times, [w for _, _, w in out.timeline], where="post")
        for row, title in enumerate((f"{each.trace.name}: replicas billed", "messages waiting")):
            _label(grid[row][column], title, unit if row else None, each.trace.zoom / scale)
        grid[1][column].set_yscale("symlog")
    grid[0][0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _label(ax: Any, title: str, unit: str | None, until: float) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlim(0, until)
    if unit is not None:
        ax.set_xlabel(f"time, {unit}")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
