"""The runs' table, the simulator's targets, the plot, and their section of BENCHMARKS.md."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.autoscale.fleet import Outcome, Setup
from bench.autoscale.oracle import Oracle
from bench.autoscale.traces import Trace

BEGIN = "<!-- bench.autoscale: begin (written by `python -m bench.autoscale`) -->"
END = "<!-- bench.autoscale: end -->"


@dataclass(frozen=True)
class Runs:
    """One trace's runs: the oracle (with its always-on fleet) and each scaler's outcome."""

    trace: Trace
    oracle: Oracle
    outcomes: dict[str, Outcome]  # by scaler name: always-on first, then in the order they ran


def _seconds(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def table(runs: list[Runs]) -> list[str]:
    lines = [
        "| trace | scaler | instance-seconds | x oracle | p95 wait, s | max wait, s "
        "| jobs killed by scale-in | idle cost, instance-s | most replicas "
        "| most probes of a message |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *(line for each in runs for line in _rows(each)),
    ]
    return lines


def _rows(runs: Runs) -> list[str]:
    bound = runs.oracle.instance_seconds
    rows = [
        f"| {runs.trace.name} | oracle (lower bound; {runs.oracle.replicas} replicas) "
        f"| {bound:,.0f} | 1.00 | - | - | 0 | 0 | {runs.oracle.replicas} | - |"
    ]
    for name, out in runs.outcomes.items():
        rows.append(
            f"| {runs.trace.name} | {name} | {out.instance_seconds:,.0f} "
            f"| {out.instance_seconds / bound:.2f} | {_seconds(out.p95_wait)} "
            f"| {_seconds(out.waits[-1])} | {out.killed} | {out.idle_cost:,.0f} | {out.peak} "
            f"| {out.most_probed} |"
        )
    return rows


def targets(runs: list[Runs], ours: list[str], setup: Setup) -> list[str]:
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
    lines = [
        "| target | " + " | ".join(f"{name} | met" for name in ours) + " |",
        "| --- |" + " --- | --- |" * len(ours),
    ]
    for what, figures in rows:
        cells = " | ".join(f"{value} | {'yes' if met else '**no**'}" for value, met in figures)
        lines.append(f"| {what} | {cells} |")
    return lines


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


def section(body: list[str]) -> str:
    return "\n".join([BEGIN, *body, END]) + "\n"


def write_section(path: Path, text: str) -> None:
    """Put ``text`` in place of the section between the markers, or at the end."""
    current = path.read_text() if path.exists() else ""
    if BEGIN in current and END in current:
        before, rest = current.split(BEGIN, 1)
        after = rest.split(END, 1)[1].removeprefix("\n")
        path.write_text(before + text + after)
    else:
        path.write_text(current.rstrip("\n") + "\n\n" + text)


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
