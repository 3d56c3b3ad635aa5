"""Fakes for the project's own pure-logic tests (the data-path ones are the test kit's:
``workerpool.testing.fakes``)."""

from __future__ import annotations

from workerpool.autoscale.actuator import Beat


class FakeClock:
    """A clock that tests advance instead of sleeping (wall-clock seconds by default)."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def beat(host: str, running: int, *, slots: int = 4, draining: bool = False) -> Beat:
    """A live replica's heartbeat: ``host`` is its pod's name on Kubernetes."""
    return Beat(
        replica=f"{host}-1-abcd",
        subscription="projects/ads-prod/subscriptions/jobs-sub",
        host=host,
        pid=1,
        slots=slots,
        running=running,
        waiting=0,
        completed=0.0,
        saturated=False,
        draining=draining,
        at=1_700_000_000.0,
        until=1_700_000_030.0,
    )
