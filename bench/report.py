"""The scenarios' tables, targets and plots: printed, as a section of BENCHMARKS.md
(``--json``), or as a markdown report of one run (``--out``), where the hand-written notes below
the notes marker are kept.
"""

from __future__ import annotations

import importlib.metadata
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench.results import Grid, Section, commit, grid_markdown, machine
from bench.scenarios import ASYNC_N, COST_N, Context, Row, Table
from workerpool.config import Settings

NOTES_MARKER = "<!-- notes: written by hand below this line; `python -m bench` keeps them -->"
LIBRARIES = (
    "google-cloud-pubsub",
    "grpcio",
    "gcloud-aio-pubsub",
    "aiohttp",
    "opentelemetry-sdk",
)
IMPL_TEXT = {
    "workerpool": "`workerpool run` with its defaults: SQLite idempotency store, metrics "
    "(Prometheus reader), JSON job log lines to a file, tracing sampled off, and the default "
    "prefetch (N // 4, at least 2; passed explicitly, so a baseline revision runs with it too)",
    "workerpool-bare": "`workerpool run` with the idempotency store off, OpenTelemetry disabled "
    "and `--log-level warning`",
    "workerpool-store": "bare, with only the SQLite idempotency store on",
    "workerpool-telemetry": "bare, with only tracing (sampled off) and metrics on",
    "workerpool-logs": "bare, with only the job log lines on (`--log-level info`)",
    "workerpool-async": "workerpool, the job an `async def` on the pool's event loop",
    "workerpool-async-bare": "workerpool-bare, the job an `async def` on the pool's event loop",
    "plain": "google-cloud-pubsub `subscribe()`, `FlowControl(max_messages=N)`, a "
    "`ThreadScheduler` of N threads; the callback runs the job, then `ack()`",
    "aio": "gcloud-aio-pubsub `subscribe()`: one producer, `max_messages_per_producer=N`, "
    "N tasks per consumer, `ack_window=0.05`; the handler awaits the job (its sleep is "
    "`asyncio.sleep`); stopped by cancelling the task",
}
BASELINES = ("plain", "aio")


def fmt(value: float) -> str:
    if math.isnan(value):
        return "n/a"
    if value == int(value):
        return f"{int(value):,}"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}" if abs(value) >= 0.1 or value == 0 else f"{value:.3f}"


def cell(row: Row, impl: str) -> str:
    values = row.values.get(impl)
    if not values:
        return "-"
    median = row.median(impl)
    assert median is not None
    text = fmt(median)
    if len(values) > 1:
        text += f" ({fmt(min(values))}-{fmt(max(values))})"
    if impl in row.notes:
        text += f" [{'; '.join(row.notes[impl])}]"
    return text


def ratio(row: Row, impl: str, baseline: str) -> str:
    a, b = row.median(impl), row.median(baseline)
    if a is None or b is None or not row.better or not row.compare:
        return ""
    if b == 0:
        return "n/a" if a else "1"
    return f"{a / b:.2f}"


def _order(impl: str) -> tuple[int, str]:
    name, _, ref = impl.partition("@")
    return (list(IMPL_TEXT).index(name) if name in IMPL_TEXT else len(IMPL_TEXT), ref)


def table_grid(table: Table) -> Grid:
    present = {impl for row in table.rows for impl in row.values}
    impls = sorted(present, key=_order)
    # What workerpool is compared with: the other libraries, then everything off, then each
    # implementation against the baseline revision's run of it (after / before).
    pairs = [("workerpool", b) for b in (*BASELINES, "workerpool-bare") if b in present]
    pairs = pairs if "workerpool" in present else []
    pairs += [
        (i, old) for i in impls if (old := next((o for o in impls if o.startswith(i + "@")), None))
    ]
    header = ["figure", *impls, *(f"{a} / {b}" for a, b in pairs)]
    grid = Grid(table.scenario, table.description, header)
    for row in table.rows:
        label = row.label + (f", {row.unit}" if row.unit else "")
        if row.better:
            label += f" ({row.better} is better)"
        cells = [cell(row, i) for i in impls] + [ratio(row, a, b) for a, b in pairs]
        grid.rows.append([label, *cells])
    return grid


def table_markdown(table: Table) -> list[str]:
    return grid_markdown(table_grid(table), level=2)


def find(ctx: Context, scenario: str, label: str) -> Row | None:
    for table in ctx.tables:
        if table.scenario == scenario:
            for row in table.rows:
                if row.label.startswith(label):
                    return row
    return None


def targets(ctx: Context) -> list[str]:
    return grid_markdown(targets_grid(ctx), level=2)


def targets_grid(ctx: Context) -> Grid:
    """The targets against what was measured: a miss is a finding, shown as such."""
    grid = Grid("Targets", "", ["target", "measured (workerpool)", "met"])

    def add(target: str, measured: str, met: bool | None) -> None:
        verdict = "n/a" if met is None else "yes" if met else "**no**"
        grid.rows.append([target, measured, verdict])

    for n in ctx.plan.throughput_counts:
        row = find(ctx, f"1. Throughput, N = {n}", "throughput")
        if row and row.median("workerpool") and row.median("plain"):
            r = ratio(row, "workerpool", "plain")
            aio = ratio(row, "workerpool", "aio")
            add(
                f"throughput / plain >= 1.0, N = {n}", f"{r} (/ aio: {aio or 'n/a'})", float(r) >= 1
            )
    drain = f"3. Drain, N = {ctx.plan.drain_n}"
    held = find(ctx, drain, "messages held")
    if held and held.values.get("workerpool"):
        limit = ctx.plan.drain_n + Settings(max_outstanding=ctx.plan.drain_n).held_beyond_n
        most = max(held.values["workerpool"])
        add(f"held <= N + prefetch = {limit}", f"at most {fmt(most)}", most <= limit)
    for n in ctx.plan.util_backlogs:
        peak = find(ctx, f"2. Slot utilisation, N = {n}", "highest")
        if peak and peak.values.get("workerpool"):
            seen = sorted(set(peak.values["workerpool"]))
            add(f"highest running == N = {n}", ", ".join(fmt(v) for v in seen), seen == [n])
        mean = find(ctx, f"2. Slot utilisation, N = {n}", "mean running")
        if n >= 8 and mean and mean.values.get("workerpool"):
            low = min(mean.values["workerpool"])
            add(f"mean utilisation >= 0.97, N = {n}", f"lowest run {fmt(low)}", low >= 0.97)
    _defaults_targets(ctx, add)
    _async_targets(ctx, add)
    _cost_targets(ctx, add)
    over = find(ctx, drain, "exit after the signal minus")
    if over and over.values.get("workerpool"):
        most = max(over.values["workerpool"])
        add("exit <= longest remaining job + 1 s", f"+{fmt(most)} s at most", most <= 1)
    every = find(ctx, drain, "every unstarted")
    if every and every.values.get("workerpool"):
        most = max(every.values["workerpool"])
        add("unstarted redelivered within 1 s", f"{fmt(most)} s at most", most <= 1)
    growth = find(ctx, f"4. Soak, N = {ctx.plan.soak_n}", "growth")
    if growth and growth.values.get("workerpool"):
        value = max(growth.values["workerpool"])
        add("soak RSS growth 50 % -> 100 % < 10 %", f"{fmt(value)} %", value < 10)
    return grid


def _defaults_targets(ctx: Context, add: Any) -> None:
    """The defaults at the speed of bare: CPU, and throughput beside bare and the plain client."""
    for n in ctx.plan.throughput_counts:
        row = find(ctx, f"1. Throughput, N = {n}", "throughput")
        if row and row.median("workerpool") and row.median("workerpool-bare"):
            r = ratio(row, "workerpool", "workerpool-bare")
            if n == 100:
                add("throughput / bare >= 0.5, N = 100", r, float(r) >= 0.5)
        cpu = find(ctx, f"1. Throughput, N = {n}", "CPU per 1,000")
        if n == 100 and cpu and (value := cpu.median("workerpool")) is not None:
            bare = cpu.median("workerpool-bare")
            plain = cpu.median("plain")
            beside = (
                f"{fmt(value)} s (bare {fmt(bare or math.nan)}, plain {fmt(plain or math.nan)})"
            )
            add("CPU per 1,000 no-op jobs <= 0.20 s, N = 100", beside, value <= 0.20)


def _async_targets(ctx: Context, add: Any) -> None:
    """Async jobs: bare beside gcloud-aio-pubsub, the defaults beside the plain client, and
    the slots kept busy by 50 ms ``asyncio.sleep`` jobs (only when async ones were run)."""
    for n in ctx.plan.throughput_counts:
        row = find(ctx, f"1. Throughput, N = {n}", "throughput")
        if row is None:
            continue
        if n == 100 and row.median("workerpool-async-bare") and row.median("aio"):
            r = ratio(row, "workerpool-async-bare", "aio")
            add("async bare / aio >= 1.0, N = 100", r, float(r) >= 1)
        if n >= 10 and row.median("workerpool-async") and row.median("plain"):
            r = ratio(row, "workerpool-async", "plain")
            add(f"async defaults / plain >= 1.0, N = {n}", r, float(r) >= 1)
    mean = find(ctx, "2. Slot utilisation, N = 64", "mean running")
    for impl in ("workerpool-async", "workerpool-async-bare"):
        if mean and mean.values.get(impl):
            low = min(mean.values[impl])
            add(f"{impl} mean utilisation >= 0.97, N = 64", f"lowest run {fmt(low)}", low >= 0.97)


def _cost_targets(ctx: Context, add: Any) -> None:
    """What a job costs with the defaults, beside the plain client (the cost scenario)."""
    cost = f"7. Cost per job, N = {COST_N}"
    cpu = find(ctx, cost, "no-op jobs: CPU")
    if cpu and cpu.median("workerpool") and cpu.median("plain"):
        r = ratio(cpu, "workerpool", "plain")
        add(f"CPU per no-op job, defaults / plain <= 1.3, N = {COST_N}", r, float(r) <= 1.3)
    held = find(ctx, cost, "GIL-holding jobs: throughput")
    if held and held.median("workerpool") and held.median("plain"):
        r = ratio(held, "workerpool", "plain")
        add(f"GIL-holding jobs/s, defaults / plain >= 1.0, N = {COST_N}", r, float(r) >= 1)
    mean = find(ctx, f"7. Async slots, N = {ASYNC_N}", "mean running")
    if mean and (busy := mean.median("workerpool-async")) is not None:
        add(f"async slots busy with the defaults >= 0.97, N = {ASYNC_N}", fmt(busy), busy >= 0.97)


def versions() -> Iterable[str]:
    for name in LIBRARIES:
        try:
            yield f"{name} {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            yield f"{name} (not installed)"


def method(ctx: Context) -> list[str]:
    """How the figures were measured: the libraries, what a cell is, the implementations."""
    run = {impl.partition("@")[0] for t in ctx.tables for row in t.rows for impl in row.values}
    return [
        f"- libraries: {', '.join(versions())}",
        f"- each cell: the median of {ctx.plan.runs} runs (min-max) unless the scenario says "
        "otherwise; implementations run in turn, the order rotating each run; a ratio is of "
        "medians",
        *(f"- differs from the scenario's own size: {text}" for text in ctx.plan.deviations),
        "",
        "Implementations (each a process of its own, on one local Pub/Sub emulator; every job "
        "records its own start and end):",
        "",
        *(f"- **{impl}**: {text}" for impl, text in IMPL_TEXT.items() if impl in run),
        *(
            [f"- **IMPL@{ctx.baseline}**: IMPL run by the workerpool of revision {ctx.baseline}"]
            if ctx.baseline
            else []
        ),
        "",
    ]


# A section's title by its name (its results file's stem): the cost scenarios are a runner of
# their own in the report, for their before and after.
TITLES = {
    "pubsub": "workerpool against the plain client and gcloud-aio-pubsub, on the emulator",
    "cost": "What a job costs: the defaults against the plain client, before and after",
}


# What a section beside the first one says of its implementations: the same, run the same way.
BESIDE_PUBSUB = [
    "- implementations: as in [the first section](#pubsub); IMPL@REF is IMPL run by the "
    "workerpool of revision REF, in the same run (the before of the figures)",
    "",
]


def section(ctx: Context, command: str, plots: list[Path], root: Path, name: str) -> Section:
    """The run as a section of BENCHMARKS.md (``python -m bench --json``)."""
    return Section(
        name=name,
        title=TITLES.get(name, TITLES["pubsub"]),
        command=command,
        about=method(ctx) if name == "pubsub" else method(ctx)[:2] + BESIDE_PUBSUB,
        grids=[targets_grid(ctx), *map(table_grid, ctx.tables)],
        notes=["Runs that lost or repeated jobs: " + ("; ".join(ctx.anomalies) or "none.")],
        plots=[str(p.resolve().relative_to(root)) for p in plots],
    )


def markdown(ctx: Context, header: dict[str, str], plots: list[Path], out: Path) -> str:
    lines = [
        "# Benchmarks: workerpool against the plain google-cloud-pubsub subscriber",
        "",
        *(f"- {key}: {value}" for key, value in header.items()),
        f"- machine: {machine()}; workerpool at commit {commit()}",
        *method(ctx),
        *targets(ctx),
    ]
    for table in ctx.tables:
        lines += table_markdown(table)
    if plots:
        lines += ["## Plots", ""]
        lines += [f"![{p.stem}]({p.relative_to(out.parent)})" for p in plots]
        lines.append("")
    lines += ["## Runs that lost or repeated jobs", ""]
    lines += [f"- {a}" for a in ctx.anomalies] or ["None."]
    return "\n".join([*lines, ""])


def write(ctx: Context, header: dict[str, str], out: Path, plot_dir: Path) -> None:
    kept = ""
    if out.exists() and NOTES_MARKER in (old := out.read_text()):
        kept = old.split(NOTES_MARKER, 1)[1]
    plots = draw(ctx, plot_dir)
    out.write_text(markdown(ctx, header, plots, out) + "\n" + NOTES_MARKER + (kept or "\n"))


def draw(ctx: Context, plot_dir: Path) -> list[Path]:
    """PNG plots with matplotlib (the ``bench`` extra); none, said aloud, without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plots")
        return []
    plot_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    if ctx.running_n8:
        impls = [i for i in IMPL_TEXT if i in ctx.running_n8]
        fig, grid = plt.subplots(
            len(impls), 1, figsize=(8, 1.4 * len(impls) + 1), sharex=True, squeeze=False
        )
        axes = grid[:, 0]
        for ax, impl in zip(axes, impls, strict=True):
            samples = ctx.running_n8[impl]
            ax.step([t for t, _ in samples], [r for _, r in samples], where="post", linewidth=0.6)
            ax.set_ylim(0, 9)
            ax.set_ylabel(impl, rotation=0, ha="right")
        axes[-1].set_xlabel("seconds since the first job started")
        axes[0].set_title("Jobs running, N = 8, 50 ms jobs (last run, sampled every 10 ms)")
        paths.append(_save(fig, plot_dir / "running-n8.png"))
    by_n = {
        n: row
        for n in ctx.plan.throughput_counts
        if (row := find(ctx, f"1. Throughput, N = {n}", "throughput"))
    }
    if by_n:
        fig, ax = plt.subplots(figsize=(8, 3.5))
        impls = [i for i in IMPL_TEXT if any(i in row.values for row in by_n.values())]
        width = 0.8 / len(impls)
        for k, impl in enumerate(impls):
            xs, medians, low, high = [], [], [], []
            for x, row in enumerate(by_n.values()):
                values = row.values.get(impl, [])
                if values:
                    median = row.median(impl) or 0.0
                    xs.append(x + k * width)
                    medians.append(median)
                    low.append(median - min(values))
                    high.append(max(values) - median)
            ax.bar(xs, medians, width, yerr=[low, high], label=impl, capsize=2)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(by_n))])
        ax.set_xticklabels([f"N = {n}" for n in by_n])
        ax.set(ylabel="no-op jobs per second")
        ax.set_title("Throughput by N (median, min-max)")
        ax.legend()
        paths.append(_save(fig, plot_dir / "throughput.png"))
    return paths


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path
