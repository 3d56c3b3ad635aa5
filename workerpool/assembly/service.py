"""One worker process, as ``workerpool run`` runs it: signals, the health server, the pools,
the drain, and an exit that keeps to the platform's grace period.

``serve`` returns once the drain is over; the caller then ends the process with ``exit_now``
(the CLI does; a benchmark that still has a report to write does that first).
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from typing import NoReturn

from workerpool.assembly.fleet import Fleet
from workerpool.config import Settings
from workerpool.telemetry import PrometheusReader, Telemetry, telemetry_from_env
from workerpool.telemetry.health import HealthServer
from workerpool.telemetry.logs import set_trace_project
from workerpool.worker.signals import Signals

log = logging.getLogger(__name__)

# After drain_timeout, the exit must come within a second (the platform's SIGKILL follows):
# the drain takes launcher.GRACE of it, flushing telemetry the rest up to EXIT_BY; what
# remains is slack for a busy machine, and LAST_RESORT ends the process whatever still runs.
EXIT_BY = 0.75
LAST_RESORT = 0.95
GC_YOUNG_THRESHOLD = 50_000  # allocations between young collections (see collect_rarely)


def serve(settings: Settings, signals: Signals | None = None) -> None:
    """Run the pools ``settings`` describe until SIGTERM or SIGINT, then drain them. Given
    ``signals`` held since the process started, one that came already starts no pool."""
    set_trace_project(settings.project)
    scrape = PrometheusReader() if settings.metrics_port else None
    telemetry = telemetry_from_env(extra_readers=[scrape] if scrape else [])
    signals = signals or Signals()
    signals.install()
    fleet = Fleet(settings, telemetry=telemetry)
    health = None
    if settings.metrics_port:
        health = HealthServer(
            settings.metrics_port, healthy=fleet.healthy, ready=fleet.ready, metrics=scrape
        ).start()
    fleet.start(abort=signals.stop)  # a signal while pools start: start no more of them
    collect_rarely()
    while not signals.stop.wait(1.0):
        pass
    log.info("signal received: draining (%.0fs)", settings.drain_timeout)
    deadline = signals.at + settings.drain_timeout  # counted from the signal, as the platform does
    _exit_at(deadline + LAST_RESORT, code=1, why="the drain overran its budget")
    fleet.stop(deadline, abort=signals.hurry)
    # The last spans and metrics get what is left; an exporter that cannot reach its
    # collector must not hold the exit.
    finish = threading.Thread(target=_shutdown, args=(health, telemetry), daemon=True)
    finish.start()
    finish.join(max(0.0, deadline + EXIT_BY - time.monotonic()))
    if finish.is_alive():
        log.warning("telemetry did not flush in time; exiting without it")


def collect_rarely() -> None:
    """Tune the cyclic garbage collector for a worker, once it has started.

    Everything the worker made to start (modules, clients, pools) lives until it exits: out
    of the collector's sight, its collections scan only what runs make. That was a third of
    the CPU of an async no-op run, measured (60 against 42 us per run).

    A job's objects are freed by reference counting, but a pull admits dozens of messages at
    once, a dozen tracked objects each, and the collector counts allocations less frees,
    never below zero: the count drifts up while messages come and go, and a young collection
    scans every message then held to free next to nothing. Measured with the defaults at
    N = 100, no-op jobs: at Python's threshold of 700 nearly every pull set one off; at
    10,000, one every 250-600 jobs, 2-5 ms each (8-10 us of CPU a job); at 50,000, one
    in 60,000 jobs or fewer, with the same peak RSS (no-op and 50 ms jobs). Cyclic garbage
    still goes, later: once the count passes 50,000. A threshold set higher already, or 0
    (automatic collection off), is left alone."""
    gc.freeze()
    young, *older = gc.get_threshold()
    if 0 < young < GC_YOUNG_THRESHOLD:  # (0: collection turned off on purpose)
        gc.set_threshold(GC_YOUNG_THRESHOLD, *older)


def _shutdown(health: HealthServer | None, telemetry: Telemetry) -> None:
    if health is not None:
        health.stop()
    telemetry.shutdown()


def exit_now(code: int) -> NoReturn:
    """End the process now. Everything is flushed by then; the interpreter's own teardown of
    the loaded libraries (gRPC, protobuf, OpenTelemetry) took 0.1-0.3 s more, measured, which a
    10 s Cloud Run grace period cannot spare. atexit handlers do not run: close what a job
    holds in a middleware's ``close``. The log flush is bounded too: a log pipe whose reader
    has stalled must not hold the exit."""
    flush = threading.Thread(target=logging.shutdown, daemon=True)
    flush.start()
    flush.join(0.1)
    os._exit(code)


def _exit_at(when: float, *, code: int, why: str) -> None:
    def watch() -> None:
        time.sleep(max(0.0, when - time.monotonic()))
        log.error("exiting now: %s", why)
        exit_now(code)

    threading.Thread(target=watch, name="workerpool-exit-watch", daemon=True).start()
