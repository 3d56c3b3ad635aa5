"""BENCHMARKS.md as the bench writes it: rendered from the runners' JSON results, short, and
free of a diary's dated sessions."""

from __future__ import annotations

import re
from pathlib import Path

from bench.results import command_line, load
from bench.summary.__main__ import main as summary
from bench.summary.render import render

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = Path(__file__).parent / "bench_results"
MOST_LINES = 350


def test_the_report_renders_each_section_from_its_results(tmp_path: Path) -> None:
    # Given the results of two runners, one measured at an earlier commit than the other
    out = tmp_path / "BENCHMARKS.md"
    # When the report is written from them, running nothing
    assert summary(["--render", "--results", str(FIXTURE), "--out", str(out)]) == 0
    text = out.read_text()
    # Then each section has its tables, its command and where its figures come from
    assert "| throughput, msg/s (higher is better) | 2,400 (2,300-2,500) | 1,900 " in text
    assert "| firestore / sqlite | 22.75 |" in text
    assert "How to reproduce: `python -m bench --short --scenarios throughput`" in text
    assert "| [workerpool against the plain client](#pubsub) | abc1234 | " in text
    assert "6.2 -> 7.9" in text and "![bench/plots/throughput.png]" in text
    assert "- settings: the short settings of `python -m bench.summary`" in text
    assert len(text.splitlines()) <= MOST_LINES


def test_a_section_measured_at_another_commit_is_marked_carried_over() -> None:
    sections = [load(FIXTURE / "pubsub.json"), load(FIXTURE / "slots.json")]
    # The newer section's commit is the report's; the older one was not re-run.
    text = render(sections, "today", "2 CPUs")
    carried = text.split("## Concurrency slots", 1)[1]
    assert "**Carried over** from commit 0ld0000 (2026-11-30 10:20 UTC)" in carried
    assert "(#slots) | 0ld0000 | 2026-11-30 10:20 UTC |" in text  # and the sections table says
    assert "Carried over** from commit abc1234" not in text


def test_a_section_names_its_command_without_where_it_wrote_the_results() -> None:
    argv = ["--short", "--json", "/tmp/x.json", "--plots", "p", "--json=y"]
    assert command_line("python -m bench", argv) == "python -m bench --short --plots p"


def test_benchmarks_md_is_a_short_report_without_dated_sessions() -> None:
    lines = (ROOT / "BENCHMARKS.md").read_text().splitlines()
    assert len(lines) <= MOST_LINES
    # A diary's entries: lines naming a numbered session, or headings that carry a date.
    dated = re.compile(r"\bsession \d+|^#+ .*\d{4}-\d{2}-\d{2}", re.IGNORECASE)
    assert [line for line in lines if dated.search(line)] == []
    assert lines[0] == "# Benchmarks"
    assert "written by `python -m bench.summary`" in lines[2]
