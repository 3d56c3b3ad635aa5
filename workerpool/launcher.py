"""The worker's lifecycle: start, quiet (stop pulling), stop(deadline).

Draining follows DESIGN.md: stop pulling and give back what has not started; tell running
jobs; wait until a deadline computed once from the monotonic clock; then cancel and give back
what still runs; flush every ack and nack before the clients close.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from workerpool.acks import Acknowledger
from workerpool.admin import SubscriptionInfo, describe_subscription, subscription_path, topic_path
from workerpool.backoff import Backoff
from workerpool.clients import Clients
from workerpool.config import Settings
from workerpool.deadletter import DeadLetterPublisher, worker_identity
from workerpool.errors import ConfigError
from workerpool.idempotency import IdempotencyStore, StoreUnavailable, open_store
from workerpool.idempotency.middleware import Idempotency
from workerpool.lease import Leaser
from workerpool.middleware import Middleware, RateLimit, TimeLimit
from workerpool.pool import DrainReport, Pool, PoolLimits
from workerpool.processor import Processor, ProcessorSettings
from workerpool.ratelimit import LocalLimiters, RateLimiters
from workerpool.registry import Registry, registry
from workerpool.subscriber import Puller
from workerpool.telemetry import Telemetry

log = logging.getLogger(__name__)

_FLUSH_TIMEOUT = 10.0


def _idempotency(
    settings: Settings, owner: str, store: IdempotencyStore | None
) -> list[Middleware]:
    if store is None:
        try:
            store = open_store(settings.idempotency_store)
        except (ValueError, ImportError, StoreUnavailable) as exc:
            raise ConfigError(f"idempotency_store: {exc}") from None
    return [] if store is None else [Idempotency(store, owner, ttl=settings.claim_ttl)]


def _check_rate_limits(jobs: Registry, limiters: RateLimiters) -> None:
    declared = set(limiters.names())
    for spec in jobs.specs():
        name = spec.options.get("rate_limit")
        if name and name not in declared:
            raise ConfigError(f"job {spec.name} uses rate limit {name!r}, which is not declared")


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
    ) -> None:
        """``store`` overrides ``settings.idempotency_store`` with a store object of your own;
        ``limiters`` are shared by the pools of one process (default: from settings);
        ``telemetry`` (traces, metrics, job log lines) too (default: global providers)."""
        if not settings.project or not settings.subscription:
            raise ConfigError("project and subscription are required")
        self.settings = settings
        self.worker_id = worker_id or worker_identity()
        self.subscription = subscription_path(settings.project, settings.subscription)
        self._jobs = jobs
        self.telemetry = telemetry or Telemetry()
        hooks = self.telemetry.hooks(self.subscription)
        self._listeners = hooks.listeners
        self._limiters = limiters or LocalLimiters(
            settings.rate_limits, on_wait=self.telemetry.metrics.rate_limit_waited
        )
        _check_rate_limits(jobs, self._limiters)
        self._middleware = [
            *hooks.middleware,  # outermost: every run is seen, even one short-circuited
            *_idempotency(settings, self.worker_id, store),
            RateLimit(self._limiters),
            TimeLimit(),
            *middleware,
        ]
        self._clients = clients or Clients()
        self._stopped = False
        self.info: SubscriptionInfo | None = None
        self._acks: Acknowledger | None = None
        self._leaser: Leaser | None = None
        self._pool: Pool | None = None
        self._puller: Puller | None = None
        self._processor: Processor | None = None

    @property
    def pool(self) -> Pool:
        assert self._pool is not None, "start() first"
        return self._pool

    @property
    def processor(self) -> Processor:
        assert self._processor is not None, "start() first"
        return self._processor

    def start(self) -> Launcher:
        s = self.settings
        self.info = describe_subscription(self._clients.subscriber, self.subscription)
        dead_letter_topic = (
            topic_path(s.project, s.dead_letter_topic)
            if s.dead_letter_topic
            else self.info.dead_letter_topic
        )
        if not dead_letter_topic:
            raise ConfigError(
                f"dead_letter_topic is required: {self.subscription} has no dead-letter policy"
            )
        self._acks = Acknowledger(self._clients.subscriber, self.subscription)
        self._leaser = Leaser(
            self._acks,
            extension=s.lease_extension,
            on_extend=self.telemetry.metrics.lease_extended,
        )
        dead_letters = DeadLetterPublisher(
            self._clients.publisher,
            dead_letter_topic,
            subscription=self.subscription,
            source_topic=self.info.topic,
            worker=self.worker_id,
        )
        self._processor = Processor(
            self._jobs,
            self._acks,
            self._leaser,
            dead_letters,
            self._middleware,
            ProcessorSettings(
                Backoff(s.min_backoff, s.max_backoff),
                s.max_payload_bytes,
                server_backoff=self.info.has_retry_policy,
                exactly_once=self.info.exactly_once,
                job_config=s.job_config,
            ),
            limiters=self._limiters,
            listeners=self._listeners,
        )
        limits = PoolLimits(s.max_outstanding, s.prefetch, s.max_bytes)
        self._pool = Pool(self._processor, self._leaser, self._acks, limits)
        self.telemetry.metrics.know_jobs(self._jobs.names())
        self.telemetry.metrics.watch_pool(s.subscription, self._pool)
        self._puller = Puller(self._clients.subscriber, self.subscription, self._pool)
        self._leaser.start()
        self._pool.start()
        self._puller.start()
        if self.info.has_retry_policy:
            log.info("%s has a retry policy: Pub/Sub spaces redeliveries", self.subscription)
        log.info(
            "worker %s pulling %s with max_outstanding=%d prefetch=%d",
            self.worker_id,
            self.subscription,
            s.max_outstanding,
            s.prefetch,
        )
        return self

    def quiet(self) -> int:
        """Stop pulling and give back every message not started; returns how many."""
        assert self._puller is not None and self._pool is not None
        self._puller.stop(timeout=0)
        released = self._pool.quiet()
        log.info("draining: stopped pulling, released %d waiting messages", released)
        return released

    def stop(self, deadline: float, abort: threading.Event | None = None) -> DrainReport:
        """Wait for running jobs until the monotonic ``deadline`` (or ``abort``), then cancel
        and give back what still runs, flush, and close. Idempotent; safe before start."""
        started = time.monotonic()
        if self._stopped or self._pool is None:
            return DrainReport(0, 0, 0, 0.0)
        self._stopped = True
        released = self.quiet()
        assert self._puller is not None and self._acks is not None and self._leaser is not None
        self._puller.stop(timeout=max(0.0, deadline - time.monotonic()))
        released += self._pool.quiet()  # anything a last in-flight pull brought
        running = self._pool.running
        log.info("draining: waiting for %d running jobs", running)
        idle = self._wait_idle(deadline, abort)
        interrupted = 0 if idle else self._pool.interrupt()
        if interrupted:
            log.warning("draining: deadline passed, gave back %d running jobs", interrupted)
        flushed = self._acks.close(timeout=_FLUSH_TIMEOUT)
        self._leaser.stop()
        self._pool.join(timeout=0.1)
        for mw in self._middleware:
            mw.close()
        self._clients.close()
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

    def healthy(self) -> bool:
        """The pull stream is healthy (its last pull answered), or the worker is draining."""
        if self._stopped:
            return True
        return self._puller is not None and self._puller.healthy.is_set()

    def ready(self) -> bool:
        """Started and not draining: readiness turns false as soon as draining starts."""
        return self._pool is not None and not self._pool.quieted

    def _wait_idle(self, deadline: float, abort: threading.Event | None) -> bool:
        assert self._pool is not None
        while time.monotonic() < deadline:
            if abort is not None and abort.is_set():
                return self._pool.wait_idle(time.monotonic())
            if self._pool.wait_idle(min(deadline, time.monotonic() + 0.1)):
                return True
        return self._pool.wait_idle(time.monotonic())


class Fleet:
    """The pools of one process, one per subscription (``[[pools]]``), each with its own bound
    and sharing the rate limiters. Draining quiets every pool first, then waits for them all
    against one deadline."""

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
        self.launchers = [
            Launcher(pool, jobs=jobs, limiters=limiters, telemetry=self.telemetry)
            for pool in settings.pool_settings()
        ]

    def start(self) -> Fleet:
        started: list[Launcher] = []
        try:
            for launcher in self.launchers:
                started.append(launcher.start())
        except BaseException:
            for launcher in started:
                launcher.stop(time.monotonic())
            raise
        return self

    def stop(self, deadline: float, abort: threading.Event | None = None) -> list[DrainReport]:
        for launcher in self.launchers:
            launcher.quiet()
        # Side by side: one pool's wait, interrupt and flush must not delay another's past
        # the shared deadline (the platform's SIGKILL follows it closely).
        with ThreadPoolExecutor(max_workers=len(self.launchers)) as stopping:
            return list(
                stopping.map(lambda launcher: launcher.stop(deadline, abort), self.launchers)
            )

    def healthy(self) -> bool:
        return all(launcher.healthy() for launcher in self.launchers)

    def ready(self) -> bool:
        return all(launcher.ready() for launcher in self.launchers)
