"""The autoscaler's parts that are pure logic: what the signals say, which replicas a
scale-in drains, and the loop's decisions, with in-memory heartbeats and fakes."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from tests.fakes import FakeClock, make_beat
from tests.support import wait_for
from workerpool.autoscale import process
from workerpool.autoscale.actuator import Actuator, Beat, least_busy
from workerpool.autoscale.controller import Autoscaler
from workerpool.autoscale.policy import Policy
from workerpool.autoscale.process import ProcessActuator
from workerpool.autoscale.signals import SignalReader
from workerpool.heartbeats import HeartbeatStore, MemoryHeartbeats
from workerpool.ops.monitoring import Backlog
from workerpool.stores import StoreUnavailable

SUB = "projects/p/subscriptions/jobs"
NOW = 1000.0


class FakeProbe:
    def __init__(self, answer: int | None) -> None:
        self.answer = answer
        self.limits: list[int] = []

    def count(self, limit: int) -> int | None:
        self.limits.append(limit)
        return None if self.answer is None else min(self.answer, limit)


class FakeBacklog:
    def __init__(self, backlog: Backlog | None) -> None:
        self.backlog = backlog

    def read(self) -> Backlog | None:
        return self.backlog


def _reader(
    beats: Sequence[Beat] = (),
    probe: FakeProbe | None = None,
    backlog: Backlog | None = None,
    store: HeartbeatStore | None = None,
    clock: Callable[[], float] = lambda: NOW,
    monitoring: FakeBacklog | None = None,
    **options: Any,
) -> SignalReader:
    heartbeats = store or MemoryHeartbeats()
    for beat in beats:
        heartbeats.beat(beat)
    return SignalReader(
        SUB, heartbeats, probe=probe,  # type: ignore[arg-type]
        backlog=monitoring or FakeBacklog(backlog),  # type: ignore[arg-type]
        slots_per_replica=10, clock=clock, **options,
    )  # fmt: skip


def test_serving_replicas_beats_give_running_waiting_slots_and_rate_draining_ones_do_not() -> None:
    probe = FakeProbe(5)
    reader = _reader(
        [
            make_beat("a", running=4, waiting=2, completed=8.0, saturated=True),
            make_beat("b", running=2, waiting=0, completed=2.0),
            make_beat("leaving", running=3, waiting=0, draining=True),
            make_beat("dead", running=4, until=NOW - 1),
        ],
        probe,
    )
    seen = reader.read(current=2)
    s = seen.signals
    assert (s.current, s.slots_per_replica, s.in_flight, s.backlog) == (2, 4, 6, 2)
    assert s.service_rate == pytest.approx(10.0 / 6)  # jobs per second per busy slot
    assert [b.replica for b in seen.beats] == ["a", "b", "leaving"]
    assert probe.limits == []  # replicas serve: they see the backlog, a probe adds nothing


def test_the_probe_is_asked_only_at_zero_replicas_for_as_many_as_the_max_has_slots() -> None:
    # Given a fleet at zero (one replica still draining), up to 30 replicas of 10 slots
    probe = FakeProbe(2000)
    seen = _reader([make_beat("leaving", draining=True)], probe, max_replicas=30).read(0)
    # Then one probe asks for 300 messages (more would not change the count) and what it saw
    # waits
    assert probe.limits == [300] and seen.probed == 300 and seen.signals.backlog == 300
    # ... Pub/Sub's most per pull without a max; none seen: none waits
    empty = FakeProbe(0)
    assert _reader([], empty).read(0).signals.backlog == 0 and empty.limits == [1000]
    # ... and a failed probe says nothing rather than "none waits"
    assert _reader([], FakeProbe(None)).read(0).probed is None


def test_while_the_replicas_a_probe_woke_start_its_finding_stands_and_it_is_not_asked_again() -> (
    None
):
    # Given a probe that sees 100 messages at zero
    clock, probe, store = FakeClock(NOW), FakeProbe(100), MemoryHeartbeats()
    reader = _reader(probe=probe, store=store, clock=clock)
    assert reader.read(0).signals.backlog == 100
    # When 13 replicas are starting: no probe (each would be one more delivery of each
    # message), and the finding stands for them
    for _ in range(5):
        clock.advance(2)
        seen = reader.read(13)
        assert (seen.probed, seen.signals.backlog) == (None, 100)
    # ... the first replica's first beat, before its first pull, changes nothing
    store.beat(make_beat("a", at=clock.now, until=clock.now + 6))
    assert reader.read(13).signals.backlog == 100
    # ... what the replicas then take is no longer waiting: 4 running and 2 held of the 100
    clock.advance(2)
    store.beat(
        make_beat("a", running=4, waiting=2, saturated=True, at=clock.now, until=clock.now + 6)
    )
    assert reader.read(13).signals.backlog == 2 + 94
    # ... 50 settled since (a rate of 25 a second over the 2 s since its last beat)
    clock.advance(2)
    store.beat(
        make_beat("a", running=4, waiting=2, completed=25.0, at=clock.now, until=clock.now + 6)
    )
    assert reader.read(13).signals.backlog == 2 + 44
    assert probe.limits == [1000]  # asked once


def test_a_probes_finding_lapses_once_the_fleet_took_as_many_or_probe_hold_after_a_beat() -> None:
    clock, store = FakeClock(NOW), MemoryHeartbeats()
    reader = _reader(probe=FakeProbe(8), store=store, clock=clock, probe_hold=60)
    assert reader.read(0).signals.backlog == 8
    # Once the replicas took all 8 (and more), the beats alone say what waits
    clock.advance(12)
    store.beat(make_beat("a", running=4, waiting=2, at=clock.now, until=clock.now + 6))
    store.beat(make_beat("b", running=4, waiting=0, at=clock.now, until=clock.now + 6))
    assert reader.read(2).signals.backlog == 2
    store.gone("a")
    store.gone("b")
    assert reader.read(2).signals.backlog == 0  # not back: the finding is spent
    # A finding nobody takes stands while no replica beats (starting, or a crash loop that
    # leaves the fleet at zero between restarts: no second probe, no second delivery) ...
    probe, idle = FakeProbe(8), MemoryHeartbeats()
    late = _reader(probe=probe, store=idle, clock=clock, probe_hold=60)
    assert late.read(0).signals.backlog == 8
    clock.advance(600)
    assert [late.read(n).signals.backlog for n in (1, 0, 2)] == [8, 8, 8]
    assert probe.limits == [1000]
    # ... then for probe_hold seconds from the first beat, if the replicas take none of it
    idle.beat(make_beat("a", at=clock.now, until=clock.now + 100))
    assert late.read(1).signals.backlog == 8
    clock.advance(60)
    assert late.read(1).signals.backlog == 8
    clock.advance(1)
    assert late.read(1).signals.backlog == 0


def test_monitorings_backlog_adds_what_the_fleet_has_not_taken_since_the_point() -> None:
    clock, store = FakeClock(NOW), MemoryHeartbeats()
    monitoring = FakeBacklog(None)
    reader = _reader(store=store, clock=clock, monitoring=monitoring)
    # Given a replica running 4 and holding 2 at NOW, then settling 10 a second for 150 s
    store.beat(make_beat("a", running=4, waiting=2, at=NOW, until=NOW + 600))
    reader.read(1)
    clock.advance(150)
    store.beat(
        make_beat("a", running=4, waiting=2, completed=10.0, at=clock.now, until=clock.now + 6)
    )
    # When Monitoring's point taken at NOW says 5,000 unacked
    monitoring.backlog = Backlog(5000, 300.0, at=NOW)
    seen = reader.read(1).signals
    # Then it adds the 5,000 less the 6 held then and the 1,500 settled since: 3,494 waiting
    # besides the 2 held now, and its oldest message's age
    assert (seen.backlog, seen.oldest_age) == (2 + 3494, 300.0)
    # ... a point that the work done since accounts for adds nothing, nor does its age
    monitoring.backlog = Backlog(1200, 300.0, at=NOW)
    seen = reader.read(1).signals
    assert (seen.backlog, seen.oldest_age) == (2, None)


def test_a_monitoring_point_that_cannot_be_discounted_is_left_out() -> None:
    beats = [make_beat("a", running=4, waiting=2)]
    # no figure, no time, or taken before the reader watched: what was done since is unknown
    for backlog in (Backlog(None, None), Backlog(50, 1.0), Backlog(50, 1.0, at=NOW - 1)):
        assert _reader(beats, backlog=backlog).read(1).signals.backlog == 2
    # taken as the reader watched, it counts less what replicas held then
    assert _reader(beats, backlog=Backlog(50, 1.0, at=NOW)).read(1).signals.backlog == 2 + 44


def test_a_scale_in_takes_idle_replicas_first_then_the_least_busy_never_draining_ones() -> None:
    beats = [
        make_beat("busy", running=4),
        make_beat("holding", running=1, waiting=2),
        make_beat("light", running=1),
        make_beat("idle"),
        make_beat("leaving", draining=True),
    ]
    assert [b.replica for b in least_busy(beats, 3)] == ["idle", "light", "holding"]
    assert [b.replica for b in least_busy(beats, 9)] == ["idle", "light", "holding", "busy"]


def test_the_process_actuator_starts_replicas_and_drains_starting_ones_then_the_idle() -> None:
    # Given replicas that are sleeping processes (they stand for `workerpool run`)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    actuator = ProcessActuator([], command=sleeper)
    try:
        assert actuator.scale(3, []).startswith("started 3")
        assert actuator.current() == 3
        pids = [p.pid for p in actuator._serving]
        host = __import__("socket").gethostname()
        # When two have beaten (one busy, one idle) and the count goes down to 1
        beats = [
            make_beat("a", host=host, pid=pids[0], running=2),
            make_beat("b", host=host, pid=pids[1]),
        ]
        said = actuator.scale(1, beats)
        # Then the one still starting (no beat) and the idle one got SIGTERM; the busy one
        # serves on
        assert said == f"draining 2 (pids {pids[2]}, {pids[1]})"
        assert actuator.current() == 1 and actuator._serving[0].pid == pids[0]
        stopped = actuator._stopping
        assert all(p.wait(10) == -signal.SIGTERM for p in stopped)
    finally:
        actuator.close(timeout=10)
    assert actuator.current() == 0


@pytest.mark.slow  # 10-20 s: 36 replicas, each two interpreters, beside busy gRPC calls
def test_replicas_started_beside_busy_grpc_channels_all_start_and_die_with_their_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given gRPC calls going on in this process, as the autoscaler's probe makes them (here to
    # a port where nothing listens)
    from google.cloud import pubsub_v1

    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", "127.0.0.1:9")
    client = pubsub_v1.SubscriberClient()
    busy = threading.Event()

    def call() -> None:
        while not busy.is_set():
            with contextlib.suppress(Exception):
                client.pull(request={"subscription": SUB, "max_messages": 1}, timeout=0.1)

    callers = [threading.Thread(target=call) for _ in range(2)]
    for caller in callers:
        caller.start()
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    try:
        # When replicas are started, 3 at a time (36 in all), each from a thread that ends once
        # they run the command
        replicas = [p for _ in range(12) for p in _three_started_by_a_thread(sleeper)]
        # Then every one ran it (none was aborted: started from a fork that ran gRPC's fork
        # handlers, 13 % of them were), and got SIGTERM as its thread ended
        assert [p.wait(30) for p in replicas] == [-signal.SIGTERM] * 36
    finally:
        busy.set()
        for caller in callers:
            caller.join(10)
        client.close()


def test_a_replica_whose_starting_thread_has_ended_before_it_asks_for_the_signal_stops() -> None:
    # Given replicas started by a thread that ends at once, before they can ask for the
    # parent-death signal
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    actuator = ProcessActuator([], command=sleeper)
    starter = threading.Thread(target=actuator.scale, args=(3, []))
    starter.start()
    starter.join()
    # Then none of them runs on for good: each stops itself (1), or got the signal (-15)
    codes = [p.wait(30) for p in actuator._serving]
    assert len(codes) == 3 and set(codes) <= {1, -signal.SIGTERM}


def test_a_replica_whose_command_cannot_run_exits_127_with_one_line(
    capfd: pytest.CaptureFixture[str],
) -> None:
    # Given a worker command that does not exist
    actuator = ProcessActuator([], command=["/nonexistent/workerpool-worker", "run"])
    # When a replica is started
    actuator.scale(1, [])
    # Then it exits 127, as a shell's would, saying why in one line (not a traceback)
    assert [p.wait(30) for p in actuator._serving] == [127]
    assert capfd.readouterr().err.splitlines() == [
        "replica not started: /nonexistent/workerpool-worker: No such file or directory"
    ]


def test_a_replica_refused_the_parent_death_signal_starts_all_the_same_and_says_so() -> None:
    # Given a replica's first interpreter whose prctl is refused (as a seccomp filter would)
    refused = (
        "import ctypes\n"
        "class _Refusing:\n"
        "    def prctl(self, *args): return -1\n"
        "ctypes.CDLL = lambda *args, **kwargs: _Refusing()\n"
        "ctypes.get_errno = lambda: 1\n"
    )
    here = [str(os.getpid()), str(threading.get_native_id())]
    worker = [sys.executable, "-c", "print('worked')"]
    # When it starts the worker
    started = subprocess.run(
        [sys.executable, "-I", "-S", "-c", refused + process._DIE_WITH_PARENT, *here, *worker],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    # Then the worker ran, and the replica said it has no parent-death signal
    assert (started.returncode, started.stdout) == (0, "worked\n")
    assert started.stderr.splitlines() == [
        "replica started without the parent-death signal (Operation not permitted): it "
        "outlives the autoscaler if that crashes"
    ]


def _three_started_by_a_thread(argv: list[str]) -> list[subprocess.Popen[bytes]]:
    """Three replicas running ``argv``, started by a thread that ends once they run it."""
    actuator, end = ProcessActuator([], command=argv), threading.Event()
    starter = threading.Thread(target=lambda: (actuator.scale(3, []), end.wait(30)))
    starter.start()
    try:
        assert wait_for(lambda: len(actuator._serving) == 3, timeout=10, interval=0.001)
        started = actuator._serving
        running = wait_for(lambda: all(_runs(p, argv) for p in started), timeout=10)
        assert running, [(p.pid, p.poll()) for p in started]  # (an aborted one: -6)
    finally:
        end.set()
        starter.join()
    return started


def _runs(process: subprocess.Popen[bytes], argv: list[str]) -> bool:
    """Whether ``process`` has exec'd ``argv`` (False once it has exited)."""
    try:
        with open(f"/proc/{process.pid}/cmdline", "rb") as cmdline:
            return cmdline.read().split(b"\0")[:-1] == [a.encode() for a in argv]
    except OSError:
        return False


class FakeActuator(Actuator):
    name = "fake"

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas
        self.asked: list[tuple[int, list[str]]] = []

    def current(self) -> int:
        return self.replicas

    def scale(self, desired: int, beats: Sequence[Beat]) -> str:
        self.asked.append((desired, [b.replica for b in beats]))
        self.replicas = desired
        return f"now {desired}"


class FailingHeartbeats(MemoryHeartbeats):
    def live(self, subscription: str, now: float) -> list[Beat]:
        raise StoreUnavailable("store down")


def test_the_loop_scales_on_the_signals_and_keeps_the_count_when_they_are_missing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="workerpool.autoscale.controller")
    actuator = FakeActuator(1)
    beats = [make_beat("a", running=4, waiting=2)]
    scaler = Autoscaler(_reader(beats), actuator, Policy(), clock=lambda: NOW)
    # When a saturated replica beats: 6 slots of demand at 80 % of 4 is 2 replicas
    assert scaler.step().desired == 2
    assert actuator.asked == [(2, ["a"])]
    # ... when the store cannot be read: no change, whatever the policy's window says
    blind = Autoscaler(
        _reader(store=FailingHeartbeats()), actuator, Policy(), clock=lambda: NOW
    )  # fmt: skip
    assert blind.step().desired == 2 and len(actuator.asked) == 1
    # Each decision is one line with the signals, desired, actual and why; a repeat is not
    # logged again
    scaler.step()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("autoscale:")]
    assert lines[0] == (
        "autoscale: replicas 1, beating 1, draining 0, running 4, waiting 2; desired 2, "
        "actual 1: 6 slots of demand (4 running, 2 waiting, 0.0 for the arrival rate) at 80% "
        "of 4 per replica; now 2"
    )
    assert lines[1].startswith("autoscale: signals missing; desired 2, actual 2")
    assert len(lines) == 3  # the third: actual is 2 now, a new line


def test_process_actuator_children_are_real_processes() -> None:
    # The actuator's default command is this interpreter's `workerpool run`
    actuator = ProcessActuator(["--help"])
    assert actuator._argv[:4] == [sys.executable, "-m", "workerpool", "run"]
    out = subprocess.run(actuator._argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--heartbeat-interval" in out.stdout


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--actuator", "cloud-run"], "--actuator cloud-run needs --cloud-run-worker-pool"),
        (
            ["--actuator", "cloud-run", "--cloud-run-worker-pool", "workers"],
            "expected projects/PROJECT/locations/REGION/workerPools/NAME",
        ),
        (["--actuator", "kubernetes"], "--actuator kubernetes needs --kubernetes-deployment"),
        (
            ["--actuator", "kubernetes", "--kubernetes-deployment", "w", "--kubernetes-namespace",
             "jobs"],
            "no in-cluster configuration",
        ),
        (["--actuator", "keda", "--", "--jobs", "x"], "arguments after -- go to the process"),
        (["--idempotency-store", "none"], "the autoscaler reads the workers' heartbeats"),
        (["--idempotency-store", "memory://"], "the autoscaler reads the workers' heartbeats"),
        (["--target-utilization", "0.8", "--min", "3", "--max", "2"], "min_replicas"),
    ],
)  # fmt: skip
def test_a_mistake_in_the_autoscalers_settings_exits_2_with_one_line_before_connecting(
    args: list[str], says: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from click.testing import CliRunner

    from workerpool.cli import main

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", "127.0.0.1:1")  # nothing listens: never reached
    base = ["autoscale", "--project", "p", "--subscription", "s"]
    result = CliRunner().invoke(main, [*base, *args])
    assert result.exit_code == 2, result.output
    [line] = result.output.strip().splitlines()
    assert line.startswith("workerpool: error: ") and says in line, line


@pytest.mark.parametrize(
    ("worker_args", "slots"),
    [
        ((), 10),
        (("--jobs", "x", "--max-outstanding", "4"), 4),
        (("--max-outstanding=6",), 6),
        (("--max-outstanding", "4", "--max-outstanding", "8"), 8),
    ],
)
def test_the_slots_a_replica_will_have_come_from_the_workers_own_arguments(
    worker_args: tuple[str, ...], slots: int
) -> None:
    from workerpool.cli.autoscale import _max_outstanding
    from workerpool.config import Settings

    assert _max_outstanding(worker_args, Settings()) == slots


def _all_exited(actuator: ProcessActuator) -> bool:
    return all(p.poll() is not None for p in actuator._serving)


def test_replicas_exiting_before_a_beat_restart_after_a_doubling_capped_backoff() -> None:
    # Given replicas that exit at once (a bad deploy), a backoff of 1 s doubling to 4 s
    clock = FakeClock(0.0)
    exiting = [sys.executable, "-c", "raise SystemExit(3)"]
    actuator = ProcessActuator([], command=exiting, backoff=(1.0, 4.0), clock=clock)
    assert actuator.scale(2, []).startswith("started 2")
    said = []
    for delay in (1, 2, 4, 4):
        # When both have exited: their places wait for the backoff, counted as replicas
        assert wait_for(lambda: _all_exited(actuator), timeout=30)
        said.append(actuator.tend([]))
        assert actuator.current() == 2 and actuator.tend([]) == ""
        clock.advance(delay - 0.1)
        assert actuator.tend([]) == ""  # not due yet: nothing started
        clock.advance(0.1)
        assert actuator.tend([]).startswith("restarted 2")
    # Then the decision line says "crash loop" with the doubling, capped delay, and the
    # exits are counted; a scale-in drops waiting places before draining anyone
    assert [s.split(": restarting in ")[1] for s in said] == ["1 s", "2 s", "4 s", "4 s"]
    assert all(s.startswith("crash loop: pid ") for s in said)
    assert actuator.exits_at_start() == 8
    assert wait_for(lambda: _all_exited(actuator), timeout=30)
    actuator.tend([])
    assert actuator.scale(0, []) == "2 restarting dropped" and actuator.current() == 0
    actuator.close(timeout=10)


def test_a_replica_that_beat_then_died_restarts_at_once_and_a_beat_resets_the_backoff() -> None:
    clock = FakeClock(0.0)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    actuator = ProcessActuator([], command=sleeper, clock=clock)
    host = __import__("socket").gethostname()
    try:
        actuator.scale(1, [])
        [replica] = actuator._serving
        actuator._streak = 5  # as after a crash loop
        # When it beats, then is killed
        assert actuator.tend([make_beat("a", host=host, pid=replica.pid)]) == ""
        replica.kill()
        replica.wait(10)
        # Then it is replaced at the next round without waiting, and the streak is reset
        assert actuator.current() == 1
        assert actuator.tend([]).startswith("restarted 1") and actuator._streak == 0
        # ... and a replica this actuator did not start counts by its beat (adopted)
        other = make_beat("b", host=host, pid=1)
        actuator.tend([other])
        assert actuator.current() == 2
    finally:
        actuator.close(timeout=10)
