"""The local actuator: ``workerpool run`` processes on this machine, for the demo, the tests,
and a single host.

A scale-in never kills: it sends SIGTERM to the replicas chosen, which drain as on any
platform (stop pulling, hand back what has not started, finish what runs within their
``--drain-timeout``, exit 0). It chooses replicas that have not beaten yet first (still
starting: they hold nothing), then the least busy by their beats. A draining replica is not
counted any more, though it runs until its jobs end.
"""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from workerpool.autoscale.actuator import Actuator, Beat, least_busy

log = logging.getLogger(__name__)

WORKER_COMMAND = (sys.executable, "-m", "workerpool", "run")


class ProcessActuator(Actuator):
    name = "process"

    def __init__(
        self,
        worker_args: Sequence[str],
        *,
        command: Sequence[str] = WORKER_COMMAND,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self._argv = [*command, *worker_args]
        self._env = None if env is None else dict(env)
        self._serving: list[subprocess.Popen[bytes]] = []
        self._stopping: list[subprocess.Popen[bytes]] = []
        self._host = socket.gethostname()

    def current(self) -> int:
        self._reap()
        return len(self._serving)

    def scale(self, desired: int, beats: Sequence[Beat]) -> str:
        self._reap()
        missing = desired - len(self._serving)
        if missing > 0:
            started = [subprocess.Popen(self._argv, env=self._env) for _ in range(missing)]
            self._serving += started
            return f"started {len(started)} (pids {', '.join(str(p.pid) for p in started)})"
        if missing == 0:
            return "no change"
        victims = self._choose(-missing, beats)
        for process in victims:
            process.send_signal(signal.SIGTERM)
            self._serving.remove(process)
            self._stopping.append(process)
        return f"draining {len(victims)} (pids {', '.join(str(p.pid) for p in victims)})"

    def _choose(self, count: int, beats: Sequence[Beat]) -> list[subprocess.Popen[bytes]]:
        by_pid = {p.pid: p for p in self._serving}
        mine = [b for b in beats if b.host == self._host and b.pid in by_pid]
        beating = {b.pid for b in mine}
        starting = [p for p in self._serving if p.pid not in beating]
        chosen = starting[:count]
        chosen += [by_pid[b.pid] for b in least_busy(mine, count - len(chosen))]
        return chosen

    def _reap(self) -> None:
        for group in (self._serving, self._stopping):
            for process in [p for p in group if p.poll() is not None]:
                group.remove(process)
                if process.returncode:
                    log.warning("replica pid %d exited with %d", process.pid, process.returncode)

    def close(self, timeout: float = 60.0) -> None:
        """Drain every replica (SIGTERM) and wait for them, up to ``timeout`` seconds."""
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
