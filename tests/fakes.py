"""Fakes for the project's own pure-logic tests (the data-path ones are the test kit's:
``workerpool.testing.fakes``)."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from google.api_core.exceptions import PermissionDenied
from google.cloud.pubsub_v1.publisher.exceptions import PublishToPausedOrderingKeyException

from workerpool.autoscale.actuator import Beat
from workerpool.worker.middleware import Chain, Middleware, Steps
from workerpool.worker.outcome import Outcome
from workerpool.worker.run import Run


class FakeClock:
    """A clock that tests advance instead of sleeping (wall-clock seconds by default)."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Confirmed(Future[str]):
    """A publish Pub/Sub answers ``after`` seconds on (never, by default), confirming it or
    refusing it with ``error``: a wait for it lasts until then or its whole timeout, on
    ``advance`` (a fake clock's) or asleep; ``waits`` records each wait's timeout."""

    def __init__(
        self,
        waits: list[float],
        advance: Callable[[float], object] = time.sleep,
        after: float = float("inf"),
        message_id: str = "m",
        error: Exception | None = None,
    ) -> None:
        super().__init__()
        self._waits, self._advance, self._after = waits, advance, after
        self._id, self._error = message_id, error

    def result(self, timeout: float | None = None) -> str:
        assert timeout is not None, "a wait for a confirmation with no timeout"
        self._waits.append(timeout)
        if self._after > timeout:
            self._advance(timeout)
            raise TimeoutError
        self._advance(self._after)
        if self._error is not None:
            raise self._error
        return self._id


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


class PermitPool:
    """Permits as workerpool/worker/pool.py gives them: ``n`` to run, ``prefetch`` runs
    may wait without theirs."""

    def __init__(self, n: int, prefetch: int) -> None:
        self.cond = threading.Condition()
        self.free, self.parked, self.prefetch = n, 0, prefetch


class PoolPermit:
    def __init__(self, pool: PermitPool, state: str = "none") -> None:
        self.pool, self.state = pool, state

    def take(self) -> None:
        with self.pool.cond:
            while not self.pool.free:
                self.pool.cond.wait()
            self.pool.free -= 1
            self.state = "held"

    def put_down(self) -> bool:
        with self.pool.cond:
            if self.state != "held" or self.pool.parked >= self.pool.prefetch:
                return False
            self.state = "parked"
            self.pool.parked += 1
            self.pool.free += 1
            self.pool.cond.notify_all()
            return True

    def pick_up(self) -> bool:
        with self.pool.cond:
            while not self.pool.free:
                self.pool.cond.wait()
            self.pool.parked -= self.state == "parked"
            self.pool.free -= 1
            self.state = "held"
            return True

    def end(self) -> None:
        with self.pool.cond:
            self.pool.free += self.state == "held"
            self.pool.parked -= self.state == "parked"
            self.state = "none"
            self.pool.cond.notify_all()


class PausingPublisher:
    """A publisher with message ordering, as the client behaves: a publish that fails pauses
    its key (before its future fails), a publish to a paused key fails at once, and resuming
    a key that is not paused raises. Publishes wait for ``fail_pending`` until ``answering``."""

    def __init__(self) -> None:
        self.paused: set[str] = set()
        self.pending: list[tuple[str, Future[str]]] = []
        self.answering = False

    def publish(
        self, topic: str, data: bytes, ordering_key: str = "", **attributes: str
    ) -> Future[str]:
        future: Future[str] = Future()
        if ordering_key in self.paused:
            future.set_exception(PublishToPausedOrderingKeyException(ordering_key))
        elif self.answering:
            future.set_result("published")
        else:
            self.pending.append((ordering_key, future))
        return future

    def resume_publish(self, topic: str, ordering_key: str) -> None:
        if ordering_key not in self.paused:
            raise RuntimeError("Ordering key is not paused.")
        self.paused.discard(ordering_key)

    def fail_pending(self) -> None:
        """Fail what waits as the client fails a batch for good (an error it does not retry
        with ordering on), its key paused first."""
        refused = PermissionDenied("the topic is not ours")  # type: ignore[no-untyped-call]
        for ordering_key, future in self.pending:
            self.paused.add(ordering_key)
            future.set_exception(refused)
        self.pending.clear()
