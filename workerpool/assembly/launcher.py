"""The worker's lifecycle: start, quiet (stop pulling), stop(deadline).

``start`` builds every part of a pool (one ``Parts``) and starts their threads; nothing starts
a thread before that. Draining follows the drain sequence of the design page (docs/design.md)
and is bounded by its deadline whatever the store, Pub/Sub or a stuck handler do: stop pulling
and give back what has not started; tell running jobs; wait until a deadline computed once from
the monotonic clock; then hand back at once what still runs, and give the releases, the ack
flush and the closing of clients what is left of a short grace period, each against the same
deadline, never more.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from enum import Enum

from workerpool.assembly.build import Parts, PoolBuilder
from workerpool.batches.middleware import no_batches
from workerpool.batches.store import DEADLINE_JOB
from workerpool.config import Settings
from workerpool.constants import Label
from workerpool.errors import ConfigError
from workerpool.idempotency import IdempotencyStore
from workerpool.periodic import Periodic
from workerpool.pubsub import Clients, SubscriptionInfo, connect, subscription_path
from workerpool.ratelimit import LocalLimiters, RateLimiters
from workerpool.registry import JobSpec, Registry, registry
from workerpool.slots.declared import declared_limits
from workerpool.telemetry import Telemetry
from workerpool.worker.failures import worker_identity
from workerpool.worker.limits import DrainReport
from workerpool.worker.middleware import Middleware
from workerpool.worker.pool import Pool
from workerpool.worker.processor import Processor

log = logging.getLogger(__name__)

# After the drain deadline (or a second signal): the time the hand-backs, the claim releases,
# the ack flush and closing the clients share, so the process exits within the platform's
# grace period (drain_timeout + 1 s); a part that does not finish in time is left behind.
GRACE = 0.6
# Of that: what the sweep, the ack flush and closing need after the last pull came back.
_AFTER_PULL = 0.3
# How long messages whose failure record is still being published may finish.
_RECORD_GRACE = 0.1
# Of GRACE: what the ack flush and closing need after the last ack is queued.
_FLUSH = 0.3


class Phase(Enum):
    NEW = "new"
    RUNNING = "running"
    STOPPED = "stopped"


class Launcher:
    def __init__(
        self,
        settings: Settings,
        *,
        jobs: Registry = registry,
        middleware: Sequence[Middleware] = (),
        clients: Clients | None = None,
        worker_id: str | None = None,
        store: IdempotencyStore | None = None,
        limiters: RateLimiters | None = None,
        telemetry: Telemetry | None = None,
        schedules: Sequence[Periodic] | None = None,
    ) -> None:
        """``middleware`` come after the ones ``settings.middleware`` names, innermost of the
        chain (workerpool.assembly.chain);
        ``store`` overrides ``settings.idempotency_store`` with a store object of your own;
        ``limiters`` are shared by the pools of one process (default: from settings);
        ``telemetry`` (traces, metrics, job log lines) too (default: global providers);
        ``schedules`` the periodic schedules to fire (default: the settings' and the jobs'),
        each checked to name a registered job.
        Nothing is opened or started until ``start``."""
        if not settings.project or not settings.subscription:
            raise ConfigError("project and subscription are required")
        self.settings = settings
        self.worker_id = worker_id or worker_identity()
        self.subscription = subscription_path(settings.project, settings.subscription)
        self.telemetry = telemetry or Telemetry()
        self._jobs = jobs
        self._clients = clients
        self._builder = PoolBuilder(
            settings,
            subscription=self.subscription,
            worker_id=self.worker_id,
            jobs=jobs,
            middleware=middleware,
            store=store,
            limiters=limiters
            or LocalLimiters(
                settings.rate_limits, on_wait=self.telemetry.metrics.rate_limit_waited
            ),
            telemetry=self.telemetry,
            schedules=schedules,
        )
        self._phase = Phase.NEW
        self._parts: Parts | None = None
        self._released_before = 0  # messages released before the drain began
        self._lock = threading.Lock()  # orders start() against stop()

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def info(self) -> SubscriptionInfo:
        return self._started().info

    @property
    def pool(self) -> Pool:
        return self._started().pool

    @property
    def processor(self) -> Processor:
        return self._started().processor

    def _started(self) -> Parts:
        if self._parts is None:
            raise RuntimeError("the launcher has not started")
        return self._parts

    # --- start -------------------------------------------------------------------------------

    def start(self) -> Launcher:
        with self._lock:
            if self._phase is not Phase.NEW:
                raise RuntimeError(f"cannot start a launcher that is {self._phase.value}")
            # A typo in a job's config section, or a key without a limit, stops the worker
            # here, before any connection.
            self._jobs.add(JobSpec(DEADLINE_JOB, no_batches))  # every worker knows the net
            job_config = self._jobs.configs(self.settings.job_config)
            s = self.settings
            slot_limits = declared_limits(
                self._jobs.specs(), job_config, concurrency=s.concurrency,
                bulk=s.concurrency_leases, shards=s.concurrency_shards,
                pool_key=s.pool_concurrency,
                store_url=s.idempotency_store,
            )  # fmt: skip
            clients = self._clients or connect()
            try:
                self._parts = self._builder.build(clients, job_config, slot_limits)
            except BaseException:
                clients.close()
                raise
            self._run(self._parts)
            self._phase = Phase.RUNNING
        return self

    def _run(self, parts: Parts) -> None:
        s = self.settings
        self.telemetry.metrics.know_jobs(self._jobs.names())
        self.telemetry.metrics.watch_pool(s.subscription, parts.pool)
        parts.timers.start()
        parts.acks.start()
        parts.leaser.start()
        for mw in parts.middleware:
            mw.start()
        parts.pool.start()
        parts.puller.start()
        if parts.heartbeat is not None:
            parts.heartbeat.start()
        if parts.info.has_retry_policy:
            log.info("%s has a retry policy: Pub/Sub spaces redeliveries", self.subscription)
        if parts.info.message_ordering:
            log.info("%s is ordered: each key's messages run one at a time", self.subscription)
        log.info(
            "worker %s pulling %s with max_outstanding=%d prefetch=%d",
            self.worker_id,
            self.subscription,
            s.max_outstanding,
            parts.pool.limits.prefetch,
        )

    # --- stop --------------------------------------------------------------------------------

    def quiet(self, deadline: float | None = None) -> int:
        """Stop pulling and give back every message not started; returns how many. With a
        drain's monotonic ``deadline``, no copy of a message on its last delivery is waited
        for beyond it."""
        if self._parts is None:
            return 0
        if deadline is not None:
            self._parts.processor.renew_until(deadline)
        first = not self._parts.pool.quieted
        if first:
            self._released_before = self._parts.processor.stats[Label.RELEASED]
        self._parts.puller.stop(timeout=0)
        heartbeat = self._parts.heartbeat
        released = self._parts.pool.stop_starting()
        if heartbeat is not None:
            heartbeat.poke()  # the autoscaler counts this replica's slots out at once
        released += self._parts.pool.quiet()  # may wait for copies until the deadline
        if heartbeat is not None and released:
            heartbeat.poke()  # and no longer counts what it gave back as waiting here
        if first or released:
            log.info("draining: stopped pulling, released %d waiting messages", released)
        return released

    def stop(self, deadline: float, abort: threading.Event | None = None) -> DrainReport:
        """Wait for running jobs until the monotonic ``deadline`` (or ``abort``), then hand
        back what still runs, flush, and close, all within ``GRACE`` after it. Idempotent;
        safe before start."""
        started = time.monotonic()
        with self._lock:
            phase, self._phase = self._phase, Phase.STOPPED
        if phase is not Phase.RUNNING or self._parts is None:
            return DrainReport(0, 0, 0, 0.0)
        parts = self._parts
        self.quiet(deadline)
        # A pull in flight is waited for (bounded by its 2 s deadline), so nothing it brings
        # is lost; anything it brings is given back at once.
        parts.puller.stop(timeout=max(0.0, deadline - time.monotonic()))
        parts.pool.quiet()
        running = parts.pool.running
        log.info("draining: waiting for %d running jobs", running)
        idle = self._wait_idle(parts.pool, deadline, abort)
        end = min(deadline, time.monotonic()) + GRACE
        interrupted = 0
        if not idle:
            interrupted = parts.processor.interrupt_running()
            log.warning("draining: deadline passed, gave back %d running jobs", interrupted)
        # A pull still in flight can bring back the very messages just given back (measured:
        # lost for their whole ack deadline when the channel closed under it): wait for it,
        # and give those back again, before the acks are flushed.
        parts.puller.stop(timeout=max(0.0, end - _AFTER_PULL - time.monotonic()))
        parts.pool.quiet()
        self._sweep(parts, min(end, time.monotonic() + _RECORD_GRACE), end - _FLUSH)
        flushed = parts.acks.close(timeout=max(0.0, end - 0.15 - time.monotonic()))
        parts.leaser.stop(timeout=0)
        self._close(parts, end)
        released = parts.processor.stats[Label.RELEASED] - self._released_before
        report = DrainReport(
            released, max(0, running - interrupted), interrupted, time.monotonic() - started
        )
        log.info(
            "drained in %.1fs: %d released, %d finished, %d interrupted, acks flushed=%s",
            report.seconds,
            report.released_waiting,
            report.finished,
            report.interrupted,
            flushed,
        )
        self.telemetry.metrics.drained(self.settings.subscription, report.seconds)
        return report

    def _wait_idle(self, pool: Pool, deadline: float, abort: threading.Event | None) -> bool:
        while time.monotonic() < deadline:
            if abort is not None and abort.is_set():
                return pool.wait_idle(time.monotonic())
            if pool.wait_idle(min(deadline, time.monotonic() + 0.1)):
                return True
        return pool.wait_idle(time.monotonic())

    def _sweep(self, parts: Parts, until: float, end: float) -> None:
        """Nothing held may outlive the drain: a message whose failure record is still being
        published gets until ``until``, then it is given back like a running one. One that
        cannot be given back any more gets until ``end``, before the acks are flushed: its
        record is out (its run acks it once the middleware has heard of it), or it was taken
        and its ack or nack is on its way (a hand-back publishing a copy first)."""
        while parts.leaser.holding() and time.monotonic() < until:
            time.sleep(0.01)
        abandoned = parts.processor.give_back(parts.leaser.holding(), force=True)
        if abandoned:
            log.warning("draining: gave back %d messages still being settled", abandoned)
        while parts.leaser.holding() and time.monotonic() < end:
            time.sleep(0.01)
        left = len(parts.leaser.holding())
        if left:
            log.warning(
                "draining: %d messages were still being settled (a dead-lettered one heard "
                "by the middleware, a hand-back publishing a copy); their acks or nacks may "
                "not be sent (each comes back after its lease)",
                left,
            )

    def _close(self, parts: Parts, end: float) -> None:
        """Close every part side by side, each on a daemon thread, waiting for them only
        until ``end``: a close stuck on a dead network must not hold the exit past it."""
        steps: list[tuple[str, Callable[[], object]]] = [
            *((type(mw).__name__, _closer(mw, end)) for mw in parts.middleware),
            ("slots", lambda: parts.pool.join(end - 0.1)),
            ("event loop", lambda: parts.loop.release(max(0.0, end - 0.1 - time.monotonic()))),
            ("timers", lambda: parts.timers.close(max(0.0, end - 0.1 - time.monotonic()))),
            ("clients", parts.clients.close),
        ]
        if parts.heartbeat is not None:
            beats = parts.heartbeat
            steps.append(("heartbeat", lambda: beats.close(max(0.0, end - time.monotonic()))))
        threads = [
            threading.Thread(
                target=_logged(name, step), name=f"workerpool-close-{name}", daemon=True
            )
            for name, step in steps
        ]
        for thread in threads:
            thread.start()
        for (name, _), thread in zip(steps, threads, strict=True):
            thread.join(max(0.0, end - time.monotonic()))
            if thread.is_alive():
                log.warning("draining: closing %s did not finish in time; left behind", name)

    # --- probes ------------------------------------------------------------------------------

    def healthy(self) -> bool:
        """Every part can do its work (its last pull answered, acks and lease extensions go
        through, claims are renewed), or the worker is draining."""
        if self._phase is Phase.STOPPED:
            return True
        parts = self._parts
        if parts is None:
            return False
        return (
            parts.puller.healthy.is_set()
            and parts.acks.healthy
            and parts.leaser.healthy
            and all(mw.healthy for mw in parts.middleware)
        )

    def ready(self) -> bool:
        """Started and not draining: readiness turns false as soon as draining starts."""
        return (
            self._phase is Phase.RUNNING
            and self._parts is not None
            and not self._parts.pool.quieted
        )


def _closer(mw: Middleware, end: float) -> Callable[[], None]:
    return lambda: mw.close(max(0.0, end - time.monotonic()))


def _logged(name: str, step: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        try:
            step()
        except Exception:
            log.exception("draining: closing %s failed", name)

    return run
