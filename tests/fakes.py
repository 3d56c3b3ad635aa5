"""Fakes for the project's own pure-logic tests (the data-path ones are the test kit's:
``workerpool.testing.fakes``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from workerpool.autoscale.actuator import Beat
from workerpool.context import Flag, JobContext
from workerpool.registry import JobSpec
from workerpool.testing.fakes import make_delivery
from workerpool.worker.envelope import Job
from workerpool.worker.middleware import Chain, Middleware, Steps
from workerpool.worker.outcome import Outcome
from workerpool.worker.run import Permit, Run


class FakeClock:
    """A clock that tests advance instead of sleeping (wall-clock seconds by default)."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_beat(
    replica: str,
    *,
    at: float = 1000.0,
    subscription: str = "projects/p/subscriptions/jobs",
    **fields: Any,
) -> Beat:
    """A replica's heartbeat as a worker of 4 idle slots writes it at ``at`` (lapsing 6 s
    later), with any field given instead."""
    beat = Beat(
        replica=replica, subscription=subscription, host="h", pid=0, slots=4, running=0,
        waiting=0, completed=0.0, saturated=False, draining=False, at=at, until=at + 6,
    )  # fmt: skip
    return dataclasses.replace(beat, **fields)


def beat(host: str, running: int, *, slots: int = 4, draining: bool = False) -> Beat:
    """A live replica's heartbeat: ``host`` is its pod's name on Kubernetes."""
    return make_beat(
        f"{host}-1-abcd", at=1_700_000_000.0,
        subscription="projects/ads-prod/subscriptions/jobs-sub", host=host, pid=1, slots=slots,
        running=running, draining=draining,
    )  # fmt: skip


def through(middleware: Middleware, run: Run, handler: Callable[[Run], Outcome]) -> Outcome:
    """``run`` through one middleware to ``handler``, on this thread, as the processor does."""
    steps = Steps(Chain([middleware]), run)
    ended = steps.enter()
    return steps.leave(handler(run) if ended is None else ended)


class RoomyPermit:
    """A run's permit in a pool with room for every waiter."""

    def __init__(self) -> None:
        self.held = True

    def put_down(self) -> bool:
        self.held = False
        return True

    def pick_up(self) -> bool:
        self.held = True
        return True


def slot_run(
    job_id: str,
    permit: Permit | None = None,
    *,
    key: str = "bigquery-exports",
    hand_back: Callable[[Run, Outcome], bool] = lambda run, outcome: True,
) -> Run:
    """A run as the middleware sees it, of a job that takes a slot of ``key``."""
    spec = JobSpec("demo.slot", lambda ctx, payload: None, options={"concurrency": key})
    message_id = f"m-{job_id}"
    job = Job(spec, job_id, {}, message_id, 1, None, {})
    ctx = JobContext(spec.name, job_id, message_id, 1, None, Flag())
    delivery = make_delivery(b"{}", {}, message_id=message_id)
    return Run(job, ctx, delivery, hand_back, permit=permit or RoomyPermit())
