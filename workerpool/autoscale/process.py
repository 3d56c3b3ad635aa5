"""The local actuator: ``workerpool run`` processes on this machine, for the demo, the tests,
and a single host.

The fleet it counts is what the heartbeats say: every replica of the subscription that beats
and does not drain, whoever started it (replicas an autoscaler that died left behind are
adopted: counted, and drained by their pid on a scale-in like its own), plus its own replicas
started and not beating yet, plus places waiting to restart.

A scale-in never kills: it sends SIGTERM to the replicas chosen, which drain as on any
platform (stop pulling, hand back what has not started, finish what runs within their
``--drain-timeout``, exit 0). It chooses places waiting to restart first, then replicas that
have not beaten yet (still starting: they hold nothing), then the least busy by their beats.
A draining replica is not counted any more, though it runs until its jobs end.

Its replicas die with it: on Linux each asks for the parent-death signal SIGTERM before it
becomes the worker, so an autoscaler killed by SIGKILL leaves none pulling (they drain as on a
scale-in). The signal comes when the *thread* that started a replica ends, so one thread must
start them and drain them (``close``): the autoscaler's loop.

A replica that exits before its first beat (a bad deploy: an import error, a wrong flag) is
a crash at start: its place is restarted after a backoff that doubles with each such round in
a row, from 1 s to 60 s, and resets when a replica beats. Restarting at once would start
dozens of processes a minute that do nothing. A replica that dies after beating is restarted
at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from workerpool.autoscale.actuator import Actuator, Beat, least_busy

log = logging.getLogger(__name__)

WORKER_COMMAND = (sys.executable, "-m", "workerpool", "run")
BACKOFF_FIRST, BACKOFF_MOST = 1.0, 60.0


# What a replica's first interpreter runs, on Linux: it asks for the parent-death signal and
# then becomes the worker (exec keeps the signal and the pid). Set in the parent between fork
# and exec (a ``preexec_fn``), it made ``subprocess`` use fork rather than vfork, so the child
# ran gRPC's fork handlers: beside busy gRPC channels (the autoscaler's probe) they aborted 175
# of 1,377 replicas as they started (SIGABRT, measured). vfork runs none: the Popen call must
# keep to what vfork allows (no preexec_fn, user or group). Asked for after the thread that
# started it has ended, the signal never comes: that is checked after asking (where /proc
# shows threads). Python ignores SIGPIPE and SIGXFSZ at start: the worker gets them as the
# parent's subprocess would have passed them, at their default. Where the signal is refused
# (a sandbox's seccomp filter, say) the replica starts all the same, saying so: the
# autoscaler drains its replicas as it stops, and the signal is for its crash. A command that
# cannot be run exits 127 with one line, as a shell's not found does, not with a traceback.
_DIE_WITH_PARENT = """\
import ctypes, os, signal, sys
if ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM)) != 0:  # PR_SET_PDEATHSIG
    sys.stderr.write("replica started without the parent-death signal (%s): it outlives the "
                     "autoscaler if that crashes\\n" % os.strerror(ctypes.get_errno()))
parent, thread = sys.argv[1:3]
threads = f"/proc/{parent}/task"
if os.getppid() != int(parent) or (
    os.path.isdir(threads) and not os.path.exists(f"{threads}/{thread}")
):
    sys.stderr.write("replica not started: the thread that started it has ended\\n")
    os._exit(1)
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
try:
    os.execvp(sys.argv[3], sys.argv[3:])
except OSError as exc:
    sys.stderr.write("replica not started: %s: %s\\n" % (sys.argv[3], exc.strerror))
    os._exit(127)
"""


def _dying_with_this_thread(argv: Sequence[str]) -> list[str]:
    """``argv``, run so that it gets SIGTERM when the thread that starts it ends (as it is,
    off Linux). The first interpreter is isolated (``-I -S``): nothing in the working
    directory or the environment can shadow what it imports, and it starts sooner."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    here = [str(os.getpid()), str(threading.get_native_id())]
    return [sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT, *here, *argv]


class ProcessActuator(Actuator):
    name = "process"

    def __init__(
        self,
        worker_args: Sequence[str],
        *,
        command: Sequence[str] = WORKER_COMMAND,
        env: Mapping[str, str] | None = None,
        backoff: tuple[float, float] = (BACKOFF_FIRST, BACKOFF_MOST),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._argv = [*command, *worker_args]
        self._env = None if env is None else dict(env)
        self._backoff = backoff
        self._clock = clock
        self._serving: list[subprocess.Popen[bytes]] = []
        self._stopping: list[subprocess.Popen[bytes]] = []
        self._host = socket.gethostname()
        self._beats: list[Beat] = []  # the live beats the last round read
        self._beaten: set[int] = set()  # pids of own replicas seen beating
        # Pids on this host whose beats no longer count: adopted replicas sent SIGTERM, own
        # replicas that exited (a crash leaves its beat until it lapses).
        self._left: set[int] = set()
        self._restarting = 0  # places whose replica exited, to start again at _restart_at
        self._restart_at = 0.0
        self._streak = 0  # rounds in a row in which a replica exited before its first beat
        self._exits_at_start = 0
        self._said: list[str] = []  # what reaping found, for the round's decision line

    def current(self) -> int:
        self._reap()
        return len(self._serving) + self._restarting + len(self._adopted())

    def exits_at_start(self) -> int:
        return self._exits_at_start

    def tend(self, beats: Sequence[Beat] | None) -> str:
        if beats is not None:
            self._beats = list(beats)
            here = {b.pid for b in beats if b.host == self._host}
            own = {p.pid for p in self._serving}
            if here & own - self._beaten:
                self._streak = 0  # a replica got up: the deploy works
            self._beaten = (self._beaten | (here & own)) & own
            self._left &= here
        self._reap()
        if self._restarting and self._clock() >= self._restart_at:
            started = self._start(self._restarting)
            self._restarting = 0
            self._said.append(f"restarted {started}")
        said, self._said = "; ".join(self._said), []
        return said

    def scale(self, desired: int, beats: Sequence[Beat]) -> str:
        missing = desired - self.current()
        if missing > 0 and self._restarting:
            self._restarting += missing  # a crash loop's backoff holds new places too
            return f"{missing} more to start with the {self._restarting} restarting"
        if missing > 0:
            return f"started {self._start(missing)}"
        if missing == 0:
            return "no change"
        dropped = min(self._restarting, -missing)
        self._restarting -= dropped
        pids = self._drain(self._choose(-missing - dropped, beats))
        said = [f"{dropped} restarting dropped"] if dropped else []
        if pids or not dropped:
            said.append(f"draining {len(pids)} (pids {', '.join(map(str, pids))})")
        return "; ".join(said)

    def _start(self, count: int) -> str:
        argv = _dying_with_this_thread(self._argv)
        started = [subprocess.Popen(argv, env=self._env) for _ in range(count)]
        self._serving += started
        return f"{len(started)} (pids {', '.join(str(p.pid) for p in started)})"

    def _adopted(self) -> list[Beat]:
        """Serving replicas of the subscription this actuator did not start (another host's,
        or left by an autoscaler that died), and has not drained."""
        own = {p.pid for p in (*self._serving, *self._stopping)} | self._left
        return [
            b for b in self._beats
            if not b.draining and not (b.host == self._host and b.pid in own)
        ]  # fmt: skip

    def _choose(self, count: int, beats: Sequence[Beat]) -> list[int]:
        """Pids to drain: own replicas not beating yet, then the least busy of the replicas
        on this host (own or adopted)."""
        own = {p.pid for p in self._serving}
        beating = {b.pid for b in beats if b.host == self._host and b.pid in own}
        chosen = [p.pid for p in self._serving if p.pid not in beating][:count]
        skip = {p.pid for p in self._stopping} | self._left | set(chosen)
        here = [b for b in beats if b.host == self._host and b.pid not in skip]
        return chosen + [b.pid for b in least_busy(here, count - len(chosen))]

    def _drain(self, pids: list[int]) -> list[int]:
        by_pid = {p.pid: p for p in self._serving}
        for pid in pids:
            process = by_pid.get(pid)
            if process is None:  # adopted
                self._left.add(pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
                continue
            process.send_signal(signal.SIGTERM)
            self._serving.remove(process)
            self._stopping.append(process)
        return pids

    def _reap(self) -> None:
        crashed = []
        for process in [p for p in self._serving if p.poll() is not None]:
            self._serving.remove(process)
            self._left.add(process.pid)
            if process.pid in self._beaten:
                log.warning("replica pid %d exited with %d", process.pid, process.returncode)
                self._restarting += 1  # it served: start another at once
                self._restart_at = min(self._restart_at, self._clock())
            else:
                crashed.append(process)
        for process in [p for p in self._stopping if p.poll() is not None]:
            self._stopping.remove(process)
            if process.returncode:
                log.warning("replica pid %d exited with %d", process.pid, process.returncode)
        if crashed:
            self._crashed(crashed)

    def _crashed(self, crashed: list[subprocess.Popen[bytes]]) -> None:
        """Places of replicas that exited before their first beat wait for the backoff; the
        replicas started together that exit a round apart wait for the same restart."""
        exits = ", ".join(f"pid {p.pid} with {p.returncode}" for p in crashed)
        self._exits_at_start += len(crashed)
        pending, self._restarting = self._restarting, self._restarting + len(crashed)
        if pending:
            self._said.append(f"crash loop: {exits} exited before a beat too")
            return
        self._streak += 1
        first, most = self._backoff
        delay = min(most, first * 2 ** (self._streak - 1))
        self._restart_at = self._clock() + delay
        self._said.append(
            f"crash loop: {exits} exited before a beat, {self._streak} times in a row: "
            f"restarting in {delay:g} s"
        )

    def close(self, timeout: float = 60.0) -> None:
        """Drain every replica it started (SIGTERM) and wait for them, up to ``timeout``
        seconds; adopted replicas are left as they are."""
        self._restarting = 0
        for process in self._serving:
            process.send_signal(signal.SIGTERM)
        self._stopping += self._serving
        self._serving = []
        deadline = time.monotonic() + timeout
        for process in self._stopping:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("replica pid %d still draining; left running", process.pid)
        self._reap()
