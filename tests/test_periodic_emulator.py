"""Periodic jobs with real worker processes on the Pub/Sub emulator, sharing an SQLite store:
each tick of a 1-second schedule runs once across three workers, through kill -9, and after
the whole fleet was down, as its catch_up says."""

from __future__ import annotations

import itertools
import signal
import sqlite3
import statistics
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.support import (
    WorkerProcess,
    http_get,
    ledger_events,
    shared_store,
    spawn_worker,
    wait_for,
)  # fmt: skip
from tests.support import worker_processes as processes
from workerpool.cli import main
from workerpool.schedule import parse_not_before
from workerpool.testing.emulator import free_port
from workerpool.testing.pubsub import PubSubResources

SCHEDULE = """
[[schedules]]
name = "{name}"
job = "demo.sleep"
{when}
payload = {{ seconds = {seconds} }}
catch_up = "{catch_up}"
overlap = "{overlap}"
"""


def _config(
    tmp_path: Path,
    schedules: list[tuple[str, str, str]],
    seconds: float = 0.05,
    overlap: str = "allow",
) -> Path:
    config = tmp_path / "workerpool.toml"
    text = '[worker]\njobs = ["workerpool_jobs.demo"]\n' + "".join(
        SCHEDULE.format(name=n, when=w, catch_up=c, seconds=seconds, overlap=overlap)
        for n, w, c in schedules
    )
    config.write_text(text)
    return config


def _spawn(
    env: PubSubResources,
    tmp_path: Path,
    config: Path,
    ports: list[int],
    store: tuple[str, dict[str, str]] | None = None,
    *args: str,
) -> list[WorkerProcess]:
    """Workers sharing ``store`` (its URL and the environment that reaches it; default an
    SQLite file of the test's), each with ``args`` too."""
    ledger = tmp_path / "ledger.jsonl"
    url, extra_env = store or (f"sqlite:///{tmp_path / 'fleet.db'}", {})
    started = [
        spawn_worker(
            env, ledger, "--config", str(config), "--claim-ttl", "10",
            "--metrics-port", str(port), *args, store=url, extra_env=extra_env,
        )
        for port in ports
    ]  # fmt: skip
    assert wait_for(lambda: all(w.ready() for w in started), timeout=90)
    return started


def _command(tmp_path: Path, config: Path, *args: str) -> str:
    """``workerpool schedule ARGS`` on the fleet's store, in this process; its output."""
    store = f"sqlite:///{tmp_path / 'fleet.db'}"
    result = CliRunner().invoke(
        main, ["schedule", *args, "--config", str(config), "--idempotency-store", store]
    )
    assert result.exit_code == 0, result.output
    return result.output


def _ran(tmp_path: Path, name: str) -> Counter[float]:
    """How many times each tick of ``name`` ran to the end, by the jobs' own ledger."""
    prefix = f"periodic:{name}:"
    return Counter(
        parse_not_before(e["job_id"][len(prefix) :])
        for e in ledger_events(tmp_path / "ledger.jsonl", "done")
        if e["job_id"].startswith(prefix)
    )


def _lateness(tmp_path: Path, name: str, start: float, end: float) -> list[float]:
    """Seconds from each tick in [start, end] to its job's start."""
    prefix = f"periodic:{name}:"
    late = []
    for e in ledger_events(tmp_path / "ledger.jsonl", "done"):
        if e["job_id"].startswith(prefix):
            tick = parse_not_before(e["job_id"][len(prefix) :])
            if start <= tick <= end:
                late.append(e["start"] - tick)
    return late


def _published(ports: list[int], name: str) -> int:
    """The ticks of ``name`` the workers serving /metrics on ``ports`` published (the count
    of their lateness histogram)."""
    return _summed(ports, "workerpool_periodic_lateness_seconds_count{", f'schedule="{name}"')


def _counted(ports: list[int], name: str, outcome: str) -> int:
    """The ticks of ``name`` the workers serving /metrics on ``ports`` counted ``outcome``."""
    return _summed(
        ports, "workerpool_periodic_ticks_total{", f'schedule="{name}"', f'outcome="{outcome}"'
    )


def _summed(ports: list[int], metric: str, *labels: str) -> int:
    """The sum over the workers of the samples of ``metric`` with all of ``labels``."""
    texts = [http_get(f"http://127.0.0.1:{port}/metrics")[1] for port in ports]
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for text in texts
        for line in text.splitlines()
        if line.startswith(metric) and all(label in line for label in labels)
    )


def _marked(tmp_path: Path, name: str) -> int:
    with sqlite3.connect(tmp_path / "fleet.db") as db:
        query = "SELECT COUNT(*) FROM periodic_ticks WHERE schedule = ?"
        return int(db.execute(query, (name,)).fetchone()[0])


def _runs(tmp_path: Path, name: str) -> list[tuple[float, float, float, int]]:
    """(start, end, tick, pid of the worker) of each run of ``name`` that ended, by start."""
    prefix = f"periodic:{name}:"
    return sorted(
        (e["start"], e["end"], parse_not_before(e["job_id"][len(prefix) :]), e["pid"])
        for e in ledger_events(tmp_path / "ledger.jsonl", "done")
        if e["job_id"].startswith(prefix)
    )


def _overlapping(tmp_path: Path, runs: list[tuple[float, float, float, int]]) -> str:
    """Each pair of ``runs`` in which the later started before the earlier ended: by how
    much, their ticks and workers, what the workers logged of those ticks, and the marks
    of the ticks from the first to the second ((tick, marked or taken over at, state))."""
    lines = []
    for earlier, later in itertools.pairwise(runs):
        if later[0] < earlier[1]:
            lines.append(
                f"tick {earlier[2]:.0f} ran {earlier[0]:.3f}-{earlier[1]:.3f} (pid {earlier[3]}), "
                f"tick {later[2]:.0f} {later[0]:.3f}-{later[1]:.3f} (pid {later[3]}): "
                f"{earlier[1] - later[0]:.3f} s at once"
            )
            ticks = [f"{t:.1f}" for t in (earlier[2], later[2])] + [
                datetime.fromtimestamp(t, UTC).isoformat() for t in (earlier[2], later[2])
            ]
            for log in sorted(tmp_path.glob("worker-*.log")):
                lines += [f"  {log.name}: {line}" for line in log.read_text().splitlines()
                          if "periodic" in line and any(t in line for t in ticks)]  # fmt: skip
            with sqlite3.connect(tmp_path / "fleet.db") as db:
                query = "SELECT tick, marked_at, published FROM periodic_ticks "
                query += "WHERE tick BETWEEN ? AND ? ORDER BY tick"
                span = sorted((earlier[2], later[2]))
                lines += [f"  mark {row}" for row in db.execute(query, span)]
    return "\n".join(lines)


def _fired_and_skipped(
    env: PubSubResources, tmp_path: Path, config: Path, name: str, count: int, seconds: float,
    *args: str,
) -> tuple[int, int]:  # fmt: skip
    """Run ``count`` workers (each with ``args``) for ``seconds``: the ticks of ``name`` they
    counted fired and skipped."""
    with processes() as workers:
        ports = [free_port() for _ in range(count)]
        workers.extend(_spawn(env, tmp_path, config, ports, None, *args))
        time.sleep(seconds)
        return _counted(ports, name, "fired"), _counted(ports, name, "skipped")


def _p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def test_each_tick_runs_once_across_three_workers_and_two_killed(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    pubsub_resources.provision(retry_policy=False)
    names = ("every-second", "cron-seconds")
    config = _config(
        tmp_path,
        [(names[0], 'every = "1s"', "all"), (names[1], 'cron = "* * * * * *"', "all")],
    )
    with processes() as workers:
        # Given three workers sharing an SQLite store, and two schedules ticking every second
        ports = [free_port() for _ in range(3)]
        workers.extend(_spawn(pubsub_resources, tmp_path, config, ports))
        begin = time.time()
        time.sleep(20)
        # (each tick marked so far was published by one worker: the marks are counted first)
        marked = {name: _marked(tmp_path, name) for name in names}
        published = {name: _published(ports, name) for name in names}
        # When two of them are killed with SIGKILL 20 s in, and started again 5 s later
        killed_at = time.time()
        for worker in workers[:2]:
            worker.process.send_signal(signal.SIGKILL)
            worker.wait(10)
        time.sleep(5)
        workers.extend(_spawn(pubsub_resources, tmp_path, config, [free_port(), free_port()]))
        time.sleep(15)  # a window of 40 s: 20 s, the kill, 5 s down, 15 s
        end = time.time()
        # (the ticks up to the end have run, or will within a claim's life)
        for name in names:
            expected = {float(t) for t in range(int(begin) + 1, int(end) + 1)}
            assert wait_for(lambda n=name, x=expected: x <= set(_ran(tmp_path, n)), 30)
    # Then every tick in the window ran, and none twice; each was published once
    for name in names:
        assert marked[name] - 2 <= published[name] <= marked[name], (marked, published)
        ran = _ran(tmp_path, name)
        window = {t: n for t, n in ran.items() if begin < t <= end}
        assert set(window) == {float(t) for t in range(int(begin) + 1, int(end) + 1)}, name
        assert set(window.values()) == {1}, [t for t, n in window.items() if n > 1]
        # And before the kill, they started within a second of their tick (p99)
        steady = _lateness(tmp_path, name, begin + 1, killed_at - 1)
        whole = _lateness(tmp_path, name, begin, end)
        print(
            f"{name}: {len(window)} ticks; start lateness before the kill p50 "
            f"{statistics.median(steady):.3f} s, p99 {_p99(steady):.3f} s, max "
            f"{max(steady):.3f} s; over the whole window p99 {_p99(whole):.3f} s; "
            f"{published[name]} published of {marked[name]} marked at 20 s"
        )
        assert min(steady) >= 0 and _p99(steady) <= 1.0


def test_after_the_whole_fleet_was_down_catch_up_decides(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    pubsub_resources.provision(retry_policy=False)
    modes = ("all", "latest", "none")
    config = _config(tmp_path, [(m, 'every = "1s"', m) for m in modes])
    with processes() as workers:
        # Given three workers firing three 1-second schedules
        workers.extend(_spawn(pubsub_resources, tmp_path, config, [free_port() for _ in "abc"]))
        time.sleep(8)
        # When all of them stop, and three start again 10 s later
        for worker in workers:
            worker.process.send_signal(signal.SIGTERM)
        for worker in workers:
            assert worker.wait(60) == 0
        stopped = time.time()
        time.sleep(10)
        restarted = time.time()
        ports = [free_port() for _ in "abc"]
        workers.extend(_spawn(pubsub_resources, tmp_path, config, ports))
        # (the ticks up to a cutoff after they are up have run; a later one may still be on
        # its way at the end)
        cutoff = time.time() + 3
        assert wait_for(lambda: all(max(_ran(tmp_path, m)) > cutoff + 2 for m in modes), 30)
        counted = {m: _counted(ports, m, "missed") for m in modes}
    ran = {m: Counter({t: n for t, n in _ran(tmp_path, m).items() if t <= cutoff}) for m in modes}
    for mode in modes:
        assert set(ran[mode].values()) == {1}, mode  # none ran twice
    # Then "all" ran each tick since the first, the missed ones too
    first, last = min(ran["all"]), max(ran["all"])
    assert set(ran["all"]) == {float(t) for t in range(int(first), int(last) + 1)}
    # "latest" the last tick missed only: one more than "none", just before its first tick
    # after the restart (the first worker up fires both from the same moment)
    after = {
        m: sorted(t for t in ran[m] if t > max(t for t in ran[m] if t <= stopped)) for m in modes
    }
    assert after["none"][0] > restarted, (after["none"][:3], restarted)
    assert after["latest"] == [after["none"][0] - 1, *after["none"]], (after, stopped)
    assert after["latest"][0] > stopped + 8
    missed = int(after["none"][0] - max(t for t in ran["none"] if t <= stopped)) - 1
    # And the ticks left out were counted missed, once: all but the latest with "latest";
    # with "none", all but those of the last 5 s before the first worker started
    assert counted["all"] == 0 and counted["latest"] == missed - 1, (counted, missed)
    assert missed - 7 <= counted["none"] <= missed - 3, (counted, missed)
    print(f"{missed} ticks missed while down: all ran {missed}, latest 1, none 0; "
          f"counted missed: {counted}")  # fmt: skip


def test_a_schedule_naming_no_registered_job_stops_the_worker(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    pubsub_resources.provision(retry_policy=False)
    config = _config(tmp_path, [("nightly", 'cron = "0 2 * * *"', "latest")])
    config.write_text(config.read_text().replace("demo.sleep", "demo.slep"))
    with processes() as workers:
        # Given a schedule whose job is misspelt, when a worker starts, then exit 2, one line
        ledger = tmp_path / "ledger.jsonl"
        workers.append(spawn_worker(pubsub_resources, ledger, "--config", str(config)))
        assert workers[0].wait(60) == 2
        errors = [line for line in workers[0].output().splitlines() if "error" in line]
        assert errors == [
            "workerpool: error: schedule 'nightly': no job 'demo.slep' is registered"
        ], workers[0].output()


@pytest.mark.parametrize("overlap", ["skip", "buffer_one"])
def test_overlap_runs_no_tick_while_the_previous_one_runs(
    pubsub_resources: PubSubResources, tmp_path: Path, overlap: str
) -> None:
    pubsub_resources.provision(retry_policy=False)
    config = _config(tmp_path, [("slow", 'every = "1s"', "none")], seconds=2.5, overlap=overlap)
    # Given three workers and a 1-second schedule whose job takes 2.5 s, when it runs 15 s
    fired, skipped = _fired_and_skipped(pubsub_resources, tmp_path, config, "slow", 3, 15)
    # Then no run started before the one before it ended
    runs = _runs(tmp_path, "slow")
    assert len(runs) >= 3, runs
    pairs = list(itertools.pairwise(runs))
    assert all(later[0] >= earlier[1] for earlier, later in pairs), _overlapping(tmp_path, runs)
    gaps = [later[0] - earlier[1] for earlier, later in pairs]
    waited = []
    if overlap == "skip":
        # And each run is of a tick that fell after the one before it ended
        assert all(later[2] > earlier[1] for earlier, later in pairs), runs
        assert fired in (len(runs), len(runs) + 1) and 13 <= fired + skipped <= 16
    else:
        # And runs of ticks that fell before the one before it ended: kept waiting, each
        # started once that one ended (the workers look every second). (The one before runs
        # from its mark, not from its start here: on a loaded machine a run started 1.2 s
        # after its tick, and the next tick, due before that start, rightly waited.)
        waited = [(e, la) for e, la in pairs if la[2] < e[1]]
        assert waited, runs
        assert max(la[0] - e[1] for e, la in waited) < 2.5, waited
        assert len(runs) <= fired <= len(runs) + 2 and 12 <= fired + skipped <= 16
    print(f"overlap {overlap}: {len(runs)} runs of 2.5 s in 15 s of 1-second ticks; counted "
          f"{fired} fired, {skipped} skipped; from one run's end to the next's start "
          f"{min(gaps):.2f}-{max(gaps):.2f} s; {len(waited)} of a tick that waited")  # fmt: skip


@pytest.mark.parametrize("overlap", ["skip", "buffer_one"])
def test_overlap_counts_a_tick_published_and_not_claimed_yet_as_running(
    pubsub_resources: PubSubResources, tmp_path: Path, overlap: str
) -> None:
    # Given two workers of one slot each (nothing held beyond it), both busy with a 6 s job
    pubsub_resources.provision(retry_policy=False)
    for n in range(2):
        pubsub_resources.publish("demo.sleep", {"seconds": 6}, job_id=f"busy-{n}")
    config = _config(tmp_path, [("queued", 'every = "1s"', "none")], seconds=1.5, overlap=overlap)
    # When a 1-second schedule of 1.5 s jobs fires for 16 s: its first tick's job waits in the
    # queue, claimed by no worker, until one is free
    fired, skipped = _fired_and_skipped(pubsub_resources, tmp_path, config, "queued", 2, 16,
                                        "--max-outstanding", "1", "--prefetch", "0")  # fmt: skip
    runs = _runs(tmp_path, "queued")
    busy = [
        e for e in ledger_events(tmp_path / "ledger.jsonl", "done") if e["job_id"][:5] == "busy-"
    ]
    print(f"overlap {overlap}: {len(runs)} runs; {fired} fired, {skipped} skipped; the first "
          f"run of a tick {runs[0][0] - runs[0][2]:.1f} s after it; busy until "
          f"{max(e['end'] for e in busy) - runs[0][2]:.1f} s after it")  # fmt: skip
    # Then no two runs of the schedule overlap (before, the ticks published while the first
    # waited ran side by side once the workers were free)
    assert len(runs) >= 3, runs
    assert all(later[0] >= earlier[1] for earlier, later in itertools.pairwise(runs)), _overlapping(
        tmp_path, runs
    )
    # And the ticks that fell while the first waited unclaimed were skipped, and counted
    assert runs[0][0] - runs[0][2] >= 3, runs  # it did wait
    assert skipped >= 3 and fired <= len(runs) + 2, (fired, skipped)


def test_pause_stops_a_running_fleet_firing_and_resume_restarts_it(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    pubsub_resources.provision(retry_policy=False)
    config = _config(tmp_path, [("tick", 'every = "1s"', "all")])
    with processes() as workers:
        # Given two workers firing a 1-second schedule (catch_up "all")
        workers.extend(_spawn(pubsub_resources, tmp_path, config, [free_port() for _ in "ab"]))
        time.sleep(4)
        # When it is paused for 6 s, then resumed (a pause stops firing within one tick of
        # the command's return: the command itself takes seconds to start on a busy machine)
        asked_at = time.time()
        _command(tmp_path, config, "pause", "tick")
        paused_at = time.time() + 1.0
        time.sleep(6)
        resumed_at = time.time()
        _command(tmp_path, config, "resume", "tick")
        time.sleep(5)
        end = time.time()
        assert wait_for(lambda: max(_ran(tmp_path, "tick")) >= int(end), 30)
    ran = _ran(tmp_path, "tick")
    # Then no tick fired while it was paused (from the first after the pause), nor after
    # the resume did any of those, whatever its catch_up
    assert [t for t in ran if paused_at < t < resumed_at] == [], (paused_at, resumed_at)
    # And each tick before the pause and after the resume ran, once
    before = [t for t in ran if t <= paused_at]
    assert set(before) >= {float(t) for t in range(int(asked_at) - 2, int(asked_at) + 1)}
    assert set(ran) >= {float(t) for t in range(int(resumed_at) + 1, int(end) + 1)}
    assert set(ran.values()) == {1}
    print(f"paused {resumed_at - paused_at:.1f} s: {len(before)} ticks before, "
          f"{len([t for t in ran if t > resumed_at])} after, none between")  # fmt: skip


def test_trigger_runs_once_and_backfill_each_tick_once_with_three_workers(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    pubsub_resources.provision(retry_policy=False)
    config = _config(tmp_path, [("hourly", 'every = "1h"', "none")])
    with processes() as workers:
        # Given three workers and an hourly schedule
        workers.extend(_spawn(pubsub_resources, tmp_path, config, [free_port() for _ in "abc"]))
        # When it is triggered once, and its last ten ticks are backfilled
        said = _command(tmp_path, config, "trigger", "hourly")
        triggered = said.split()[2]
        hour = int(time.time()) // 3600 * 3600
        span = [datetime.fromtimestamp(t, UTC).isoformat() for t in (hour - 36000, hour - 3600)]
        backfill = ["backfill", "hourly", "--from", span[0], "--to", span[1]]
        assert _command(tmp_path, config, *backfill) == (
            "hourly: 10 tick(s) to fire, 0 fired already\n"
        )
        ticks = {float(t) for t in range(hour - 36000, hour, 3600)}
        assert wait_for(lambda: set(_ran(tmp_path, "hourly")) >= ticks, 30)
        # (and backfilled again, once those ran)
        assert _command(tmp_path, config, *backfill) == (
            "hourly: 0 tick(s) to fire, 10 fired already\n"
        )
        time.sleep(5)  # (a worker looks for marks to publish every second)
    done = [e["job_id"] for e in ledger_events(tmp_path / "ledger.jsonl", "done")]
    # Then the triggered run ran once, under its own job id
    assert done.count(triggered) == 1 and triggered.startswith("periodic:hourly:"), said
    # And each backfilled tick ran once, the second backfill adding none
    ran = _ran(tmp_path, "hourly")
    assert {t: ran[t] for t in ticks} == {t: 1 for t in ticks}
    assert len(done) == 11, done


def test_each_tick_runs_once_across_three_workers_on_firestore(
    pubsub_resources: PubSubResources, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    pubsub_resources.provision(retry_policy=False)
    config = _config(tmp_path, [("on-firestore", 'every = "1s"', "all")])
    store = shared_store("firestore", request, tmp_path, warm=True)
    with processes() as workers:
        # Given three workers sharing a Firestore store, and a schedule ticking every second
        ports = [free_port() for _ in "abc"]
        workers.extend(_spawn(pubsub_resources, tmp_path, config, ports, store))
        # When it runs for half a minute
        begin = time.time()
        time.sleep(30)
        end = time.time()
        expected = {float(t) for t in range(int(begin) + 1, int(end) + 1)}
        assert wait_for(lambda: expected <= set(_ran(tmp_path, "on-firestore")), 30)
        # Read together, while the fleet still fires: a tick published just before the count
        # may not have run yet
        ran_then = _ran(tmp_path, "on-firestore")
        published = _published(ports, "on-firestore")
    # Then every tick in the window ran, once, and started within a second of its tick
    ran = _ran(tmp_path, "on-firestore")
    assert {t: ran[t] for t in expected} == {t: 1 for t in expected}
    late = _lateness(tmp_path, "on-firestore", begin + 1, end)
    assert min(late) >= 0 and _p99(late) <= 1.0, late
    # And each tick was published by one worker (up to the last two, maybe still on their way)
    assert 0 <= published - len(ran_then) <= 2, (published, len(ran_then))
    p50, p99 = statistics.median(late), _p99(late)
    print(f"on Firestore: {len(expected)} ticks, each ran once; start lateness p50 {p50:.3f} s, "
          f"p99 {p99:.3f} s; {published} published")  # fmt: skip
