"""The benchmark runner's own parts: each consumer on the emulator, the report, the helpers."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.consumer import IMPLS
from bench.harness import Bench, Consumer
from bench.ratelimit_accuracy import busiest
from bench.report import draw, markdown, targets
from bench.scenarios import QUICK, Context, rotations
from tests.conftest import PROJECT


def test_rotations_change_who_goes_first() -> None:
    order = list(rotations(("a", "b", "c"), 4))
    assert [impl for run, impl in order if run == 0] == ["a", "b", "c"]
    assert [impl for run, impl in order if run == 1] == ["b", "c", "a"]
    assert [impl for run, impl in order if run == 3] == ["a", "b", "c"]


def test_busiest_window_counts_events_less_than_a_window_apart() -> None:
    assert busiest([0.0, 0.05, 0.099, 0.1, 0.5], 0.1) == 3
    assert busiest([0.0, 0.2, 0.4], 0.1) == 1
    assert busiest([], 0.1) == 0


@pytest.fixture
def bench(emulator_host: str, tmp_path: Path) -> Bench:
    return Bench(PROJECT, tmp_path)


@pytest.mark.parametrize("impl", IMPLS)
def test_each_consumer_runs_the_backlog_within_its_bound_and_reports(
    bench: Bench, impl: str
) -> None:
    with bench.resources("t") as res:
        ids = bench.publish(res, 30)
        consumer = Consumer(
            bench, impl, res, n=4, expect=30, seconds=0.02, sample_ms=10, intervals=True
        )
        report = consumer.wait(120)
        left = bench.pull(res, timeout=2.0)
    assert sorted(job for job, _, _ in report["intervals"]) == sorted(ids)
    assert report["finished"] == 30 and report["duplicates"] == 0
    assert 1 <= report["peak"] <= 4
    assert max(running for _, running in report["samples"]) <= 4
    assert report["cpu_done"] >= report["cpu_first"] > 0
    assert set(report["rss_kib_at"]) == {"10", "50", "100"}
    assert not left, "a consumer exited with messages it had not acked"


def test_report_says_which_targets_were_missed(tmp_path: Path, bench: Bench) -> None:
    ctx = Context(bench, QUICK, print)
    throughput = ctx.table("1. Throughput, N = 10", "d")
    rate = throughput.row("throughput", "msg/s", "higher")
    for impl, value in (("workerpool", 900.0), ("plain", 1000.0), ("aio", 450.0)):
        rate.add(impl, value)
    peak = ctx.table("2. Slot utilisation, N = 8", "d").row("highest", "jobs", "")
    peak.add("workerpool", 8)
    lines = "\n".join(targets(ctx))
    assert "| throughput / plain >= 1.0, N = 10 | 0.90 (/ aio: 2.00) | **no** |" in lines
    assert "| highest running == N = 8 | 8 | yes |" in lines
    ctx.running_n8 = {"workerpool": [(0.0, 0), (0.01, 8), (0.5, 0)]}
    plots = draw(ctx, tmp_path / "plots")
    assert [p.name for p in plots] == ["running-n8.png", "throughput.png"]
    assert all(p.stat().st_size > 1000 for p in plots)
    text = markdown(ctx, {"date": "today"}, plots, tmp_path / "BENCHMARKS.md")
    assert "| throughput, msg/s (higher is better) | 900 | 1,000 | 450 | 0.90 | 2.00 |" in text
    assert "![running-n8](plots/running-n8.png)" in text
