"""The benchmark runner's own parts: each consumer on the emulator, the report, the helpers."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import pytest

from bench.consumer import IMPLS, ledger_lines
from bench.harness import Bench, Consumer
from bench.ratelimit_accuracy import busiest
from bench.report import draw, markdown, targets
from bench.scenarios import ASYNC_N, COST_N, FULL, Context, held, rotations
from workerpool.pytest_plugin import PROJECT


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
def bench(pubsub_emulator: str, tmp_path: Path) -> Bench:
    return Bench(PROJECT, tmp_path)


def test_every_consumer_runs_its_backlog_within_its_bound_and_acks_it(bench: Bench) -> None:
    # All four at once, each on its own subscription, so the ack deadline is waited out once.
    ack_deadline = 10
    with contextlib.ExitStack() as stack:
        runs = {}
        for impl in IMPLS:
            res = stack.enter_context(bench.resources("t", ack_deadline=ack_deadline))
            ids = bench.publish(res, 30)
            consumer = Consumer(
                bench, impl, res, n=4, expect=30, seconds=0.02, sample_ms=10, intervals=True
            )
            runs[impl] = (res, ids, consumer)
        reports = {impl: consumer.wait(120) for impl, (_, _, consumer) in runs.items()}
        # An unacked message comes back once its deadline passes; none may. (A lease extended
        # just before exit would hide one for longer: workerpool's own tests check its acks.)
        last_exit = max(c.exited_at for _, _, c in runs.values())
        time.sleep(max(0.0, last_exit + ack_deadline + 1 - time.monotonic()))
        left = {impl: bench.pull(res, timeout=2.0) for impl, (res, _, _) in runs.items()}
    for impl, report in reports.items():
        ids = runs[impl][1]
        assert sorted(job for job, _, _ in report["intervals"]) == sorted(ids), impl
        assert sorted(job for job, _ in report["starts"]) == sorted(ids), impl
        assert report["finished"] == 30 and report["duplicates"] == 0, impl
        assert 1 <= report["peak"] <= 4, impl
        assert report["samples"], impl
        assert report["cpu_done"] >= report["cpu_first"] > 0, impl
        assert set(report["rss_kib_at"]) == {"10", "50", "100"}, impl
        assert not left[impl], f"{impl} exited with messages it had not acked"


def test_held_counts_what_neither_finished_nor_could_be_pulled() -> None:
    # 10 messages; a, b ran from 0 s (a finished at 0.2 s); the probe at 0.5 s pulled c-h;
    # i started at 1 s, after the probe: it was pullable then, so the worker held b and j.
    starts = [("a", 0.0), ("b", 0.0), ("i", 1.0)]
    pullable = {"c", "d", "e", "f", "g", "h", "i"}
    assert held(10, starts, [0.2], pullable, probe=0.5) == 10 - 1 - 7


def test_report_says_which_targets_were_missed(tmp_path: Path, bench: Bench) -> None:
    ctx = Context(bench, FULL, print)
    throughput = ctx.table("1. Throughput, N = 10", "d")
    rate = throughput.row("throughput", "msg/s", "higher")
    for impl, value in (("workerpool", 900.0), ("plain", 1000.0), ("aio", 450.0)):
        rate.add(impl, value)
    peak = ctx.table("2. Slot utilisation, N = 8", "d").row("highest", "jobs", "")
    peak.add("workerpool", 8)
    lines = "\n".join(targets(ctx))
    assert "| throughput / plain >= 1.0, N = 10 | 0.90 (/ aio: 2.00) | **no** |" in lines
    assert "N = 1 |" not in lines and "N = 100 |" not in lines  # not measured: not claimed
    assert "| highest running == N = 8 | 8 | yes |" in lines
    ctx.running_n8 = {"workerpool": [(0.0, 0), (0.01, 8), (0.5, 0)]}
    plots = draw(ctx, tmp_path / "plots")
    assert [p.name for p in plots] == ["running-n8.png", "throughput.png"]
    assert all(p.stat().st_size > 1000 for p in plots)
    text = markdown(ctx, {"date": "today"}, plots, tmp_path / "BENCHMARKS.md")
    assert "| throughput, msg/s (higher is better) | 900 | 1,000 | 450 | 0.90 | 2.00 |" in text
    assert "![running-n8](plots/running-n8.png)" in text


def test_cost_targets_hold_the_defaults_to_the_plain_client(bench: Bench) -> None:
    ctx = Context(bench, FULL, print)
    cost = ctx.table(f"7. Cost per job, N = {COST_N}", "d")
    cpu = cost.row("no-op jobs: CPU per 1,000 jobs", "s", "lower")
    held = cost.row("GIL-holding jobs: throughput", "msg/s", "higher")
    for impl, seconds, rate in (("workerpool", 0.091, 1900.0), ("plain", 0.07, 2000.0)):
        cpu.add(impl, seconds)
        held.add(impl, rate)
    busy = ctx.table(f"7. Async slots, N = {ASYNC_N}", "d").row("mean running", "", "higher")
    busy.add("workerpool-async", 0.975)
    lines = "\n".join(targets(ctx))
    assert "| CPU per no-op job, defaults / plain <= 1.3, N = 100 | 1.30 | yes |" in lines
    assert "| GIL-holding jobs/s, defaults / plain >= 1.0, N = 100 | 0.95 | **no** |" in lines
    assert "| async slots busy with the defaults >= 0.97, N = 64 | 0.97 | yes |" in lines


def test_the_gil_holding_job_appends_a_json_line_per_event(tmp_path: Path) -> None:
    write = ledger_lines(tmp_path / "ledger.jsonl")
    write("run-1", "start")
    write("run-1", "end")
    lines = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert [(line["job_id"], line["event"]) for line in lines] == [
        ("run-1", "start"),
        ("run-1", "end"),
    ]
