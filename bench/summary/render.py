"""BENCHMARKS.md from the sections' results: a header saying where, when and with what settings
they were measured, an overview, then each section with its tables and how to reproduce it.

The report's commit is the one its newest section was measured at; a section measured at
another is carried over from an earlier run, and says so: its figures stand, but they were not
measured beside the others.
"""

from __future__ import annotations

from bench.results import Grid, Section, grid_markdown

SETTINGS = (
    "the short settings of `python -m bench.summary` (each section's command below): backlogs "
    "and durations a quarter of each runner's defaults or less, so that every runner fits in "
    "about 20 minutes of a shared 2-core machine. Every ratio is of figures measured side by "
    "side in one run of one runner; no figure is compared across sections. The machine was "
    "shared with other work while these ran (each section gives the load average at its start "
    "and end): a cell's min-max shows how far its runs spread, and a ratio of cells that "
    "spread widely is a rough one; `python -m bench` with its full sizes narrows them."
)


def render(sections: list[Section], generated: str, machine: str) -> str:
    commit = max(sections, key=lambda s: s.measured).commit if sections else "none"
    carried = [s for s in sections if s.commit != commit]
    lines = [
        "# Benchmarks",
        "",
        "<!-- written by `python -m bench.summary` (`make bench-report`) from bench/results/; "
        "edits here are lost on the next run -->",
        f"- generated: {generated}; measured at commit {commit} on {machine}; a section measured "
        "at an earlier commit says so (carried over: not re-run for this report)",
        f"- settings: {SETTINGS}",
        "",
        *grid_markdown(overview(sections), level=2),
    ]
    for section in sections:
        lines += body(section, carried=section in carried)
    return "\n".join(lines).rstrip("\n") + "\n"


def overview(sections: list[Section]) -> Grid:
    grid = Grid(
        "Sections",
        "Where each section's figures come from: the commit, when, the load average (1 minute) "
        "when its run began and ended, and how long it took.",
        ["section", "commit", "measured", "load", "took"],
    )
    for s in sections:
        took = f"{s.seconds / 60:.1f} min" if s.seconds >= 60 else f"{s.seconds:.0f} s"
        grid.rows.append([f"[{s.title}](#{s.name})", s.commit, s.measured, s.load, took])
    return grid


def body(section: Section, carried: bool) -> list[str]:
    # The anchor shares the heading's line, the carried-over notice the command's paragraph,
    # and that paragraph the about's when it ends in one (not a list): every line counts in a
    # report kept under 350.
    about = "\n".join(section.about).rstrip("\n")  # one blank line after it, not two
    carried_note = (
        f"**Carried over** from commit {section.commit} ({section.measured}): not re-run "
        "for this report. "
        if carried
        else ""
    )
    reproduce = f"{carried_note}How to reproduce: `{section.command}` ({section.machine})."
    last = about.rsplit("\n", 1)[-1]
    if last and not last.startswith(("- ", "|", "#")):
        paragraphs = [f"{about} {reproduce}", ""]
    else:
        paragraphs = [about, "", reproduce, ""]
    lines = [f'## {section.title} <a id="{section.name}"></a>', "", *paragraphs]
    for grid in section.grids:
        lines += grid_markdown(grid)
    lines += [*section.notes, ""] if section.notes else []
    lines += [f"![{path}]({path})" for path in section.plots]
    return [*lines, ""] if section.plots else lines
