"""What one pool is made of, built from its settings: the clients' subscription described,
the feature packages' middleware in their order (``chain``), the store-backed parts, then the
data path (acks, leases, processor, pool, puller) and the heartbeat. Every problem with the
settings is a ``ConfigError`` raised here, before anything starts."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from workerpool import constants as c
from workerpool import options as job_options
from workerpool.assembly import named
from workerpool.assembly.chain import chain
from workerpool.batches import batch_opener
from workerpool.batches.middleware import Batches
from workerpool.config import Settings
from workerpool.constants import ATTR_JOB
from workerpool.control.middleware import CancelGate, Cancels, CancelWatch
from workerpool.control.opening import cancel_opener
from workerpool.errors import ConfigError
from workerpool.heartbeats import heartbeat_opener
from workerpool.heartbeats.replica import Heartbeat
from workerpool.idempotency import IdempotencyStore, StoreError, StoreOpener, store_opener
from workerpool.idempotency.middleware import Idempotency
from workerpool.ordering.middleware import key_blocks
from workerpool.periodic import MemoryMarks, Periodic, marks_opener
from workerpool.periodic.control import declared
from workerpool.periodic.firing import Periodics
from workerpool.progress import job_state_opener
from workerpool.progress.middleware import Checkpoints
from workerpool.pubsub import Clients, SubscriptionInfo, describe_subscription, topic_path
from workerpool.ratelimit import RateLimiters
from workerpool.registry import Registry
from workerpool.schedule import schedule_opener
from workerpool.schedule.delays import Delays, Firer
from workerpool.slots import Limits, open_slot_store
from workerpool.slots.gate import PoolGate
from workerpool.slots.leases import SlotLeases
from workerpool.slots.middleware import Concurrency
from workerpool.telemetry import Telemetry
from workerpool.worker.acks import ACK_WINDOW, ORDERED_ACK_WINDOW, Acknowledger
from workerpool.worker.aio import EventLoop
from workerpool.worker.backoff import Backoff
from workerpool.worker.delivery import Delivery
from workerpool.worker.failures import DeadLetterPublisher
from workerpool.worker.lease import Leaser
from workerpool.worker.limits import PoolLimits
from workerpool.worker.middleware import Middleware, RateLimit, TimeLimit
from workerpool.worker.ordering import Sequencer
from workerpool.worker.pool import Pool
from workerpool.worker.processor import Processor, ProcessorSettings
from workerpool.worker.puller import Puller
from workerpool.worker.renewal import Renewer
from workerpool.worker.timers import Timers

log = logging.getLogger(__name__)


@dataclass
class Parts:
    """Everything built for one pool, in the order ``Launcher`` starts it."""

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


class PoolBuilder:
    def __init__(
        self,
        settings: Settings,
        *,
        subscription: str,
        worker_id: str,
        jobs: Registry,
        middleware: Sequence[Middleware],
        store: IdempotencyStore | None,
        limiters: RateLimiters,
        telemetry: Telemetry,
        schedules: Sequence[Periodic] | None,
    ) -> None:
        """See ``Launcher``, which makes one: the names the settings give are resolved now, so
        a bad one stops the worker before it connects to anything."""
        self.settings = settings
        self.subscription = subscription
        self.worker_id = worker_id
        self.telemetry = telemetry
        self._jobs = jobs
        self._schedules = schedules
        self._user_middleware = [*named.build(settings), *middleware]
        self._store = store
        self._open_store = None if store is not None else _opener(settings.idempotency_store)
        self._limiters = limiters

    def build(
        self, clients: Clients, job_config: Mapping[str, Any], slot_limits: Limits | None
    ) -> Parts:
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
        coordination += key_blocks(
            self._jobs.specs(), s.idempotency_store, self.telemetry.metrics.watch_blocked
        )
        limits = PoolLimits(
            s.max_outstanding, s.prefetch_for(ordered=info.message_ordering), s.max_bytes
        )
        middleware = self._middleware(timers, concurrency, coordination, limits)
        _check_options(self._jobs, middleware, self._limiters)
        acks = Acknowledger(
            clients.subscriber,
            self.subscription,
            ack_window=ORDERED_ACK_WINDOW if info.message_ordering else ACK_WINDOW,
        )
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
                ordered=info.message_ordering,
                job_config=job_config,
            ),
            limiters=self._limiters,
            loop=loop,
            renewer=Renewer(clients.publisher, info.topic, info.name, info.max_delivery_attempts),
        )
        sequencer = (
            Sequencer(limits.max_held // c.ORDERED_KEY_SHARE_OF_HOLD)
            if info.message_ordering
            else None
        )
        pool = Pool(processor, leaser, limits, sequencer=sequencer)
        gate = concurrency.gate if concurrency is not None else None
        puller = Puller(clients.subscriber, self.subscription, pool, gate=gate)
        heartbeat = self._heartbeat(pool, puller, processor)
        return Parts(
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
        self,
        timers: Timers,
        concurrency: Concurrency | None,
        coordination: list[Middleware],
        limits: PoolLimits,
    ) -> list[Middleware]:
        idempotency = None
        store = self._store
        if store is None and self._open_store is not None:
            try:
                store = self._open_store()
            except (ImportError, StoreError) as exc:
                raise ConfigError(f"idempotency_store: {exc}") from None
        if store is not None:
            # A completion's message stays held until it is recorded: a batch that waits for
            # more may hold what the pool spares beyond its low-water mark, no more.
            idempotency = Idempotency(
                store, self.worker_id, timers, ttl=self.settings.claim_ttl,
                write_batch=max(1, limits.low_water),
            )  # fmt: skip
            for periodics in (mw for mw in coordination if isinstance(mw, Periodics)):
                periodics.run_state = store.run_state
        return chain(
            telemetry=self.telemetry.middleware(self.subscription),
            coordination=coordination,
            idempotency=idempotency,
            concurrency=concurrency,
            rate_limit=RateLimit(self._limiters),
            checkpoints=self._checkpoints(),
            time_limit=TimeLimit(timers),
            cancels=self._cancels(),
            user=self._user_middleware,
        )

    def _checkpoints(self) -> Checkpoints | None:
        """Checkpoints and progress, where the store keeps them (beside the claims)."""
        try:
            opener = job_state_opener(self.settings.idempotency_store)
            store = None if opener is None else opener()
        except (ValueError, ImportError, StoreError) as exc:
            raise ConfigError(f"idempotency_store (for checkpoints): {exc}") from None
        if store is None:
            return None

        def is_async(delivery: Delivery) -> bool:
            spec = self._jobs.get(delivery.attributes.get(ATTR_JOB, ""))
            return spec is not None and spec.is_async

        return Checkpoints(store, self.worker_id, is_async=is_async)

    def _cancels(self) -> tuple[Middleware, Middleware] | None:
        """The cancel gate and watch, where the store keeps cancels (beside the claims)."""
        try:
            opener = cancel_opener(self.settings.idempotency_store)
            store = None if opener is None else opener()
        except (ValueError, ImportError, StoreError) as exc:
            raise ConfigError(f"idempotency_store (for cancels): {exc}") from None
        if store is None:
            return None
        cancels = Cancels(store)
        return CancelGate(cancels), CancelWatch(cancels)

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
        given = self._schedules
        schedules = declared(self.settings.schedules if given is None else given, self._jobs,
                             crons=given is None)  # fmt: skip
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
            schedules,
            marks,
            topic,
            publisher,
            on_late=self.telemetry.metrics.periodic_late,
            on_ticks=self.telemetry.metrics.periodic_ticks,
        )

    def _concurrency(self, timers: Timers, limits: Limits | None) -> Concurrency | None:
        if limits is None:
            return None
        s = self.settings
        store = open_slot_store(s.idempotency_store)
        leases = SlotLeases(store, self.worker_id, limits, timers, ttl=s.slot_ttl)
        gate = PoolGate(leases, s.pool_concurrency) if s.pool_concurrency else None
        return Concurrency(leases, patience=s.slot_wait, gate=gate)


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


def _opener(url: str) -> StoreOpener | None:
    try:
        return store_opener(url)
    except (ValueError, ImportError) as exc:
        raise ConfigError(f"idempotency_store: {exc}") from None
