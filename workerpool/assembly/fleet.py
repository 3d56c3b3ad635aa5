"""The pools of one process (``[[pools]]``), started and drained together."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from workerpool.assembly.launcher import Launcher
from workerpool.config import Settings
from workerpool.ratelimit import LocalLimiters
from workerpool.registry import Registry, registry
from workerpool.telemetry import Telemetry
from workerpool.worker.limits import DrainReport


class Fleet:
    """The pools of one process, one per subscription (``[[pools]]``), each with its own bound
    and sharing the rate limiters. Draining quiets every pool at once, side by side, then waits
    for them all against one deadline."""

    def __init__(
        self,
        settings: Settings,
        *,
        jobs: Registry = registry,
        telemetry: Telemetry | None = None,
    ) -> None:
        self.telemetry = telemetry or Telemetry()
        limiters = LocalLimiters(
            settings.rate_limits, on_wait=self.telemetry.metrics.rate_limit_waited
        )
        self.settings = settings
        # Each pool fires the periodic schedules its settings keep, to its topic; the first
        # also those declared on the jobs (@job(schedule=)).
        self.launchers = [
            Launcher(
                pool, jobs=jobs, limiters=limiters, telemetry=self.telemetry,
                schedules=None if i == 0 else pool.schedules,
            )
            for i, pool in enumerate(settings.pool_settings())
        ]  # fmt: skip

    def start(self, abort: threading.Event | None = None) -> Fleet:
        """Start the pools one after another, none once ``abort`` is set (a signal came)."""
        started: list[Launcher] = []
        try:
            for launcher in self.launchers:
                if abort is not None and abort.is_set():
                    break
                started.append(launcher.start())
        except BaseException:
            for launcher in started:
                launcher.stop(time.monotonic())
            raise
        return self

    def stop(self, deadline: float, abort: threading.Event | None = None) -> list[DrainReport]:
        # Side by side, each quieted first: one pool's give-back (which may wait for copies
        # of messages on their last delivery), wait, interrupt and flush must not delay
        # another's past the shared deadline (the platform's SIGKILL follows it closely).
        with ThreadPoolExecutor(max_workers=len(self.launchers)) as stopping:
            return list(
                stopping.map(lambda launcher: launcher.stop(deadline, abort), self.launchers)
            )

    def healthy(self) -> bool:
        return all(launcher.healthy() for launcher in self.launchers)

    def ready(self) -> bool:
        return all(launcher.ready() for launcher in self.launchers)
