"""The worker's lifecycle: start, quiet (stop pulling), stop(deadline).

``start`` builds every part of a pool (one ``_Parts``) and starts their threads; nothing starts
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
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from typing import Any

from workerpool import options as job_options
from workerpool.batches import batch_opener
from workerpool.batches.middleware import Batches, no_batches
from workerpool.batches.store import DEADLINE_JOB
from workerpool.config import Settings
from workerpool.constants import Label
from workerpool.errors import ConfigError
from workerpool.heartbeats import heartbeat_opener
from workerpool.idempotency import IdempotencyStore, StoreError, StoreOpener, store_opener
from workerpool.idempotency.middleware import Idempotency
from workerpool.ops.admin import (
    SubscriptionInfo,
    describe_subscription,
    subscription_path,
    topic_path,
)
from workerpool.options import SCHEDULE
from workerpool.periodic import MemoryMarks, Periodic, marks_opener, with_jobs
from workerpool.periodic.firing import Periodics
from workerpool.ratelimit import LocalLimiters, RateLimiters
from workerpool.registry import JobSpec, Registry, registry
from workerpool.schedule import schedule_opener
from workerpool.schedule.delays import Delays, Firer
from workerpool.slots import KeyTemplate, Limits, open_slot_store, slot_store_opener
from workerpool.slots.gate import PoolGate
from workerpool.slots.leases import SlotLeases
from workerpool.slots.middleware import Concurrency
from workerpool.telemetry import Telemetry
from workerpool.worker import named
from workerpool.worker.acks import Acknowledger
from workerpool.worker.aio import EventLoop
from workerpool.worker.backoff import Backoff
from workerpool.worker.chain import chain
from workerpool.worker.clients import Clients, connect
from workerpool.worker.failures import DeadLetterPublisher, worker_identity
from workerpool.worker.heartbeat import Heartbeat
from workerpool.worker.lease import Leaser
from workerpool.worker.middleware import Middleware, RateLimit, TimeLimit
from workerpool.worker.ordering import Sequencer
from workerpool.worker.pool import DrainReport, Pool, PoolLimits
from workerpool.worker.processor import Processor, ProcessorSettings
from workerpool.worker.puller import Puller
from workerpool.worker.renewal import Renewer
from workerpool.worker.timers import Timers

log = logging.getLogger(__name__)

# After the drain deadline (or a second signal): the time the hand-backs, the claim releases,
# the ack flush and closing the clients share, so the process exits within the platform's
# grace period (drain_timeout + 1 s); a part that does not finish in time is left behind.
GRACE = 0.6
# Of that: what the sweep, the ack flush and closing need after the last pull came back.
_AFTER_PULL = 0.3
# How long messages whose failure record is still being published may finish.
_RECORD_GRACE = 0.1


class Phase(Enum):
    NEW = "new"
    RUNNING = "running"
    STOPPED = "stopped"


@dataclass
class _Parts:
    """Everything ``start`` built for one pool, in the order it started."""

    info: SubscriptionInfo
    clients: Clients
    timers: Timers
    loop: EventLoop
    acks: Acknowledger
    leaser: Leaser
    middleware: list[Middleware]
    processor: Processor
    pool: Pool
    puller: Puller
    heartbeat: Heartbeat | None


def _check_options(jobs: Registry, middleware: Sequence[Middleware], limits: RateLimiters) -> None:
    declared = frozenset().union(*(mw.options for mw in middleware))
    limiter_names = set(limits.names())
    for spec in jobs.specs():
        unread = sorted(set(spec.options) - declared)
        if unread:
            reader = job_options.declared().get(unread[0], "a middleware")
            raise ConfigError(
                f"job {spec.name}: no middleware of this worker reads {unread[0]} "
                f"(read by {reader}: is it named in the middleware setting?)"
            )
        name = spec.options.get("rate_limit")
        if name and name not in limiter_names:
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
        schedules: Sequence[Periodic] | None = None,
    ) -> None:
        """``middleware`` come after the ones ``settings.middleware`` names, innermost of the
        chain (workerpool.worker.chain);
        ``store`` overrides ``settings.idempotency_store`` with a store object of your own;
        ``limiters`` are shared by the pools of one process (default: from settings);
        ``telemetry`` (traces, metrics, job log lines) too (default: global providers);
        ``schedules`` the periodic schedules to fire (default: the settings' and the jobs').
        Nothing is opened or started until ``start``."""
        if not settings.project or not settings.subscription:
            raise ConfigError("project and subscription are required")
        self.settings = settings
        self.worker_id = worker_id or worker_identity()
        self.subscription = subscription_path(settings.project, settings.subscription)
        self.telemetry = telemetry or Telemetry()
        self._jobs = jobs
        self._schedules = schedules
        # Made now: a bad name stops the worker before it connects to anything.
        self._user_middleware = [*named.build(settings), *middleware]
        self._clients = clients
        self._store = store
        self._open_store = None if store is not None else _opener(settings.idempotency_store)
        self._limiters = limiters or LocalLimiters(
            settings.rate_limits, on_wait=self.telemetry.metrics.rate_limit_waited
        )
        self._phase = Phase.NEW
        self._parts: _Parts | None = None
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

    def _started(self) -> _Parts:
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
            slot_limits = self._slot_limits(job_config)
            clients = self._clients or connect()
            try:
                self._parts = self._build(clients, job_config, slot_limits)
            except BaseException:
                clients.close()
                raise
            self._run(self._parts)
            self._phase = Phase.RUNNING
        return self

    def _build(
        self, clients: Clients, job_config: Mapping[str, Any], slot_limits: Limits | None
    ) -> _Parts:
        s = self.settings
        info = describe_subscription(clients.subscriber, self.subscription)
        dead_letter_topic = (
            topic_path(s.project, s.dead_letter_topic)
            if s.dead_letter_topic
            else info.dead_letter_topic
        )
        if not dead_letter_topic:
            raise ConfigError(
                f"dead_letter_topic is required: {self.subscription} has no dead-letter policy"
            )
        timers = Timers()
        concurrency = self._concurrency(timers, slot_limits)
        coordination = self._coordination(info.topic, clients.publisher)
        middleware = self._middleware(timers, concurrency, coordination)
        _check_options(self._jobs, middleware, self._limiters)
        acks = Acknowledger(clients.subscriber, self.subscription)
        leaser = Leaser(
            acks,
            extension=s.lease_extension,
            granted=info.ack_deadline_seconds,
            on_extend=self.telemetry.metrics.lease_extended,
        )
        records = DeadLetterPublisher(
            clients.publisher,
            dead_letter_topic,
            subscription=self.subscription,
            source_topic=info.topic,
            worker=self.worker_id,
        )
        loop = EventLoop.shared()  # last: nothing after it raises, so it is always released
        processor = Processor(
            self._jobs,
            acks,
            leaser,
            records,
            middleware,
            ProcessorSettings(
                Backoff(s.min_backoff, s.max_backoff),
                s.max_payload_bytes,
                retry_policy=info.has_retry_policy,
                exactly_once=info.exactly_once,
                job_config=job_config,
            ),
            limiters=self._limiters,
            loop=loop,
            renewer=Renewer(clients.publisher, info.topic, info.name, info.max_delivery_attempts),
        )
        prefetch = s.prefetch_for(ordered=info.message_ordering)
        limits = PoolLimits(s.max_outstanding, prefetch, s.max_bytes)
        sequencer = _sequencer(info, s.max_backoff)
        pool = Pool(processor, leaser, limits, sequencer=sequencer)
        gate = concurrency.gate if concurrency is not None else None
        puller = Puller(clients.subscriber, self.subscription, pool, gate=gate)
        heartbeat = self._heartbeat(pool, puller, processor)
        return _Parts(
            info, clients, timers, loop, acks, leaser, middleware, processor, pool, puller,
            heartbeat,
        )  # fmt: skip

    def _heartbeat(self, pool: Pool, puller: Puller, processor: Processor) -> Heartbeat | None:
        interval = self.settings.heartbeat_interval
        try:
            opener = heartbeat_opener(self.settings.idempotency_store) if interval else None
            store = None if opener is None else opener()
        except (ValueError, ImportError, StoreError) as exc:
            raise ConfigError(f"idempotency_store (for heartbeats): {exc}") from None
        if store is None:
            return None
        return Heartbeat(
            store,
            replica=self.worker_id,
            subscription=self.subscription,
            pool=pool,
            settled=processor.stats,
            saturated=lambda: puller.saturated,
            interval=interval,
        )

    def _middleware(
        self, timers: Timers, concurrency: Concurrency | None, coordination: list[Middleware]
    ) -> list[Middleware]:
        idempotency = None
        store = self._store
        if store is None and self._open_store is not None:
            try:
                store = self._open_store()
            except (ImportError, StoreError) as exc:
                raise ConfigError(f"idempotency_store: {exc}") from None
        if store is not None:
            idempotency = Idempotency(store, self.worker_id, timers, ttl=self.settings.claim_ttl)
            for periodics in (mw for mw in coordination if isinstance(mw, Periodics)):
                periodics.running = store.running
        return chain(
            telemetry=self.telemetry.middleware(self.subscription),
            coordination=coordination,
            idempotency=idempotency,
            concurrency=concurrency,
            rate_limit=RateLimit(self._limiters),
            time_limit=TimeLimit(timers),
            user=self._user_middleware,
        )

    def _slot_limits(self, job_config: Mapping[str, Any]) -> Limits | None:
        """The declared concurrency limits, checked to cover every job's key (ConfigError if
        not); None when no job takes slots and none are declared. With limits declared, any
        run may take a slot for part of its run (ctx.slot). A job's config may declare the
        limits of keys it takes itself (``concurrency_limits``: the BigQuery plugin's
        ``max_concurrent_exports``); they hold only where the store can share slots."""
        declared = self._limits_of_configs(job_config)
        if declared and not self._can_share_slots():
            # Not a warning: a job that runs without its slots says so itself, when it runs.
            log.info(
                "concurrency limits of job configs (%s) not enforced: idempotency store %s "
                "cannot share slots",
                ", ".join(sorted(declared)),
                self.settings.idempotency_store,
            )
            declared = {}
        for key, limit in self.settings.concurrency.items():
            if declared.setdefault(key, limit) != limit:
                raise ConfigError(
                    f"concurrency {key!r}: [concurrency] says {limit}, a job's config "
                    f"{declared[key]}; declare it once"
                )
        limits = Limits(declared)
        keys = {
            spec.name: spec.options["concurrency"]
            for spec in self._jobs.specs()
            if spec.options.get("concurrency")
        }
        for job_name, key in keys.items():
            problem = KeyTemplate(key).check(limits)
            if problem:
                raise ConfigError(f"job {job_name}: concurrency key {key!r} {problem}")
        pool_key = self.settings.pool_concurrency
        if pool_key and (KeyTemplate(pool_key).fields or limits.of(pool_key) is None):
            raise ConfigError(
                f"pool_concurrency {pool_key!r}: a pool's key must be a plain key with a "
                "declared limit (the pool takes its slots before it sees any payload)"
            )
        return limits if keys or limits else None

    @staticmethod
    def _limits_of_configs(job_config: Mapping[str, Any]) -> dict[str, int]:
        declared: dict[str, int] = {}
        for name, config in job_config.items():
            for key, limit in getattr(config, "concurrency_limits", {}).items():
                if declared.setdefault(key, limit) != limit:
                    raise ConfigError(
                        f"concurrency {key!r}: job {name}'s config says {limit}, another "
                        f"job's {declared[key]}"
                    )
        return declared

    def _can_share_slots(self) -> bool:
        try:
            slot_store_opener(self.settings.idempotency_store)
        except (ValueError, ImportError):
            return False
        return True

    def _coordination(self, topic: str, publisher: Any) -> list[Middleware]:
        """Delayed jobs, periodic ones, and batches, where the store keeps them (beside the
        claims)."""
        url = self.settings.idempotency_store
        open_schedule, open_batches = schedule_opener(url), batch_opener(url)
        if open_schedule is None:
            return [Delays(topic, None, None), self._periodics(url, topic, publisher)]
        try:
            schedule = open_schedule()
            batches = None if open_batches is None else open_batches()
        except StoreError as exc:
            raise ConfigError(f"idempotency_store (for delays and batches): {exc}") from None
        firer = Firer(schedule, topic, publisher)
        delays: Middleware = Delays(topic, schedule, firer)
        periodics = self._periodics(url, topic, publisher)
        return [delays, periodics] + (
            [] if batches is None else [Batches(batches, schedule, firer)]
        )

    def _periodics(self, url: str, topic: str, publisher: Any) -> Middleware:
        """The firer of the periodic schedules (ConfigError for one naming no job)."""
        schedules = self._schedules
        if schedules is None:
            crons = {spec.name: spec.options.get(SCHEDULE) for spec in self._jobs.specs()}
            schedules = with_jobs(self.settings.schedules, crons)
        open_marks = marks_opener(url)
        if not schedules or open_marks is None:
            if schedules:
                raise ConfigError("periodic schedules need an idempotency_store, not none")
            return Periodics((), MemoryMarks(), topic, publisher)
        try:
            marks = open_marks()
        except StoreError as exc:
            raise ConfigError(f"idempotency_store (for periodic schedules): {exc}") from None
        return Periodics(
            schedules, marks, topic, publisher, on_late=self.telemetry.metrics.periodic_late
        )

    def _concurrency(self, timers: Timers, limits: Limits | None) -> Concurrency | None:
        if limits is None:
            return None
        s = self.settings
        store = open_slot_store(s.idempotency_store)
        leases = SlotLeases(store, self.worker_id, limits, timers, ttl=s.slot_ttl)
        gate = PoolGate(leases, s.pool_concurrency) if s.pool_concurrency else None
        return Concurrency(leases, patience=s.slot_wait, gate=gate)

    def _run(self, parts: _Parts) -> None:
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
        self._sweep(parts, min(end, time.monotonic() + _RECORD_GRACE))
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

    def _sweep(self, parts: _Parts, until: float) -> None:
        """Nothing held may outlive the drain: a message whose failure record is still being
        published gets until ``until``, then it is given back like a running one."""
        while parts.leaser.holding() and time.monotonic() < until:
            time.sleep(0.01)
        abandoned = parts.processor.give_back(parts.leaser.holding(), force=True)
        if abandoned:
            log.warning("draining: gave back %d messages still being settled", abandoned)

    def _close(self, parts: _Parts, end: float) -> None:
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


def _sequencer(info: SubscriptionInfo, max_backoff: float) -> Sequencer | None:
    """On an ordered subscription. What a key gave back comes back after the longest retry
    delay (ours or the subscription's) and a minute more, or is another worker's."""
    if not info.message_ordering:
        return None
    return Sequencer(owed_for=max(max_backoff, info.max_backoff) + 60.0)


def _opener(url: str) -> StoreOpener | None:
    try:
        return store_opener(url)
    except (ValueError, ImportError) as exc:
        raise ConfigError(f"idempotency_store: {exc}") from None


def _closer(mw: Middleware, end: float) -> Callable[[], None]:
    return lambda: mw.close(max(0.0, end - time.monotonic()))


def _logged(name: str, step: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        try:
            step()
        except Exception:
            log.exception("draining: closing %s failed", name)

    return run


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
        # The first pool fires the periodic schedules, to its topic.
        self.launchers = [
            Launcher(
                pool, jobs=jobs, limiters=limiters, telemetry=self.telemetry,
                schedules=None if i == 0 else (),
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
