"""A benchmark's results as JSON: the one shape every runner of bench/ writes with ``--json``,
and that ``python -m bench.summary`` turns into BENCHMARKS.md.

A section is what one runner measured in one run: its tables (cells already formatted, ratios
included, so the report shows what the runner printed), what the figures mean, the command
that measured them, and where and when: the commit, the machine and its load.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class Grid:
    """One table: a heading (may be empty), what its figures mean, its header and rows."""

    heading: str
    about: str
    header: list[str]
    rows: list[list[str]] = field(default_factory=list)


@dataclass
class Section:
    name: str  # the results file's stem, and the section's anchor
    title: str
    command: str  # the command that measured these figures (how to reproduce them)
    about: list[str]  # markdown lines: what is measured and how
    grids: list[Grid]
    notes: list[str] = field(default_factory=list)  # markdown lines after the tables
    plots: list[str] = field(default_factory=list)  # image paths, relative to the repository
    commit: str = ""
    measured: str = ""  # when, UTC
    machine: str = ""
    load: str = ""  # the 1-minute load average when the run started and when it ended
    seconds: float = 0.0  # how long the run took


def grid_markdown(grid: Grid, level: int = 3) -> list[str]:
    # A table with both a heading and a text opens with them on one line, in bold: the report
    # is kept short enough to read whole (under 350 lines).
    if grid.heading and grid.about:
        lines = [f"**{grid.heading}.** {grid.about}", ""]
    else:
        lines = [f"{'#' * level} {grid.heading}"] if grid.heading else []
        lines += [grid.about, ""] if grid.about else []
    return [
        *lines,
        "| " + " | ".join(grid.header) + " |",
        "|" + " --- |" * len(grid.header),
        *("| " + " | ".join(row) + " |" for row in grid.rows),
        "",
    ]


def emit(section: Section, stamp: Stamp, path: Path | None) -> None:
    """Print the section's tables; with a path, save the section there too (``--json``)."""
    for grid in section.grids:
        print("\n".join(grid_markdown(grid)))
    if path is not None:
        save(stamp.apply(section), path)


def command_line(program: str, argv: list[str]) -> str:
    """The command line that measured a section, less where it wrote its results."""
    shown = [program]
    for arg, before in zip(argv, ["", *argv], strict=False):
        if arg != "--json" and before != "--json" and not arg.startswith("--json="):
            shown.append(arg)
    return " ".join(shown)


def save(section: Section, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(section), indent=1, ensure_ascii=False) + "\n")


def load(path: Path) -> Section:
    data = json.loads(path.read_text())
    data["grids"] = [Grid(**grid) for grid in data["grids"]]
    return Section(**data)


class Stamp:
    """Where and when a run measured: start it before the run, ``apply`` it after."""

    def __init__(self) -> None:
        self.began = dt.datetime.now(dt.UTC)
        self.load_before = os.getloadavg()[0]

    def apply(self, section: Section) -> Section:
        took = dt.datetime.now(dt.UTC) - self.began
        section.commit = commit()
        section.measured = self.began.strftime("%Y-%m-%d %H:%M UTC")
        section.machine = machine()
        section.load = f"{self.load_before:.1f} -> {os.getloadavg()[0]:.1f}"
        section.seconds = round(took.total_seconds(), 1)
        return section


def machine() -> str:
    model = ""
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    cpus = len(os.sched_getaffinity(0))
    system = f"{platform.system()} {platform.release()}"
    return f"{cpus} CPUs ({model}), {system}, Python {platform.python_version()}"


def commit() -> str:
    result = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).parent,
    )
    return result.stdout.strip() or "unknown"
