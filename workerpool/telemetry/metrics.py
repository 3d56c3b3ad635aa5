"""The worker's OpenTelemetry instruments, every name under the ``workerpool.`` prefix.

One ``Metrics`` serves every pool of a process. It is fed by small hooks, never by a second
count of its own: ``run`` (a run starts) and ``settled`` (how each message left the pool, the
same labels as ``Processor.stats``), both middleware hooks, and ``lease_extended``
(the Leaser's ``on_extend``), ``rate_limit_waited`` (for rate limiters), ``watch_pool`` (in-flight
gauges) and ``drained``.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Protocol

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Meter, MeterProvider, Observation
from opentelemetry.sdk.metrics.export import MetricReader

from workerpool import constants as c
from workerpool.telemetry.histograms import JobHistogram, JobHistograms, Labels, takes
from workerpool.worker.counts import Counts
from workerpool.worker.middleware import Middleware
from workerpool.worker.run import Run, Settled


@functools.cache
def _attributes(job: str, outcome: str | None = None) -> Mapping[str, str]:
    """One attribute mapping per job (and outcome), made once: label values are bounded."""
    if outcome is None:
        return MappingProxyType({c.LABEL_JOB: job})
    return MappingProxyType({c.LABEL_JOB: job, c.LABEL_OUTCOME: str(outcome)})


# Histogram bucket bounds in seconds: from a quick job to an hours-long one.
_SECONDS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600,
    7200, 14400,
)  # fmt: skip


class _Limits(Protocol):
    @property
    def max_outstanding(self) -> int: ...


class WatchedPool(Protocol):
    """What the gauges read from a pool."""

    @property
    def running(self) -> int: ...

    @property
    def held(self) -> int: ...

    @property
    def limits(self) -> _Limits: ...


_Record = Callable[[float, Labels], None]


class Metrics(Middleware):
    """With ``readers`` (the meter provider's, every one ours: see ``histograms.takes``), the
    two histograms measured once a job (duration, queue latency) are ours, recorded without
    an SDK call (see ``histograms``); else, with a provider of the caller's, the SDK's."""

    def __init__(
        self, meter_provider: MeterProvider | None = None, *, readers: Sequence[MetricReader] = ()
    ) -> None:
        meter = metrics.get_meter(c.INSTRUMENTATION_NAME, meter_provider=meter_provider)
        # Counted by the slots without a lock or an SDK call, observed when a reader collects:
        # four SDK measurements per job (each cleaning and hashing its attributes) were most
        # of the metrics' cost per job; two histograms remain.
        self._started: Counts[str] = Counts()
        self._finished: Counts[tuple[str, str]] = Counts()
        self._renewed: Counts[str] = Counts()
        meter.create_observable_counter(
            c.METRIC_JOBS_STARTED,
            callbacks=[self._observe_started],
            unit="{job}",
            description="Job runs started, by job.",
        )
        meter.create_observable_counter(
            c.METRIC_JOBS_FINISHED,
            callbacks=[self._observe_finished],
            unit="{job}",
            description="Messages that left the pool, by job and outcome ("
            + ", ".join(c.Label)
            + ").",
        )
        meter.create_observable_counter(
            c.METRIC_MESSAGES_RENEWED,
            callbacks=[self._observe_renewed],
            unit="{message}",
            description="Messages published again as a fresh copy, then acked, on the last "
            "delivery their subscription's dead-letter policy allows, by job.",
        )
        duration = JobHistogram(
            c.METRIC_JOB_DURATION,
            unit="s",
            description="From the start of a run to its ack or nack, by job and outcome.",
            bounds=_SECONDS,
            label_names=(c.LABEL_JOB, c.LABEL_OUTCOME),
        )
        queue_latency = JobHistogram(
            c.METRIC_QUEUE_LATENCY,
            unit="s",
            description="From the message's publish time to the start of its run, by job.",
            bounds=_SECONDS,
            label_names=(c.LABEL_JOB,),
        )
        ours = [reader for reader in readers if takes(reader)]
        if readers and len(ours) == len(readers):
            given = JobHistograms([duration, queue_latency], c.INSTRUMENTATION_NAME)
            for reader in ours:
                reader.job_histograms = given
            self._record_duration: _Record = duration.record
            self._record_queue_latency: _Record = queue_latency.record
        else:
            self._record_duration = _sdk_histogram(meter, duration)
            self._record_queue_latency = _sdk_histogram(meter, queue_latency)
        self._extensions = meter.create_counter(
            c.METRIC_LEASE_EXTENSIONS,
            unit="{extension}",
            description="Ack deadline extensions of held messages.",
        )
        self._rate_limit_wait = meter.create_histogram(
            c.METRIC_RATE_LIMIT_WAIT,
            unit="s",
            description="Time spent waiting for a rate-limit token, by limiter.",
            explicit_bucket_boundaries_advisory=_SECONDS,
        )
        self._periodic_lateness = meter.create_histogram(
            c.METRIC_PERIODIC_LATENESS,
            unit="s",
            description="How long after its tick a periodic job was published, by schedule.",
            explicit_bucket_boundaries_advisory=_SECONDS,
        )
        self._periodic_ticks = meter.create_counter(
            c.METRIC_PERIODIC_TICKS,
            unit="{tick}",
            description="Ticks of periodic schedules by outcome: fired (published), skipped "
            "(by the overlap policy) or missed (left out by catch_up after a downtime).",
        )
        meter.create_observable_gauge(
            c.METRIC_KEYS_BLOCKED,
            callbacks=[self._observe_blocked],
            unit="{key}",
            description="Ordering keys blocked now (a job of ordered_exhausted='block' "
            "exhausted its attempts, no operator has let the key go on), by that job.",
        )
        self._blocked_now: Callable[[], Mapping[str, int] | None] | None = None
        self._drain = meter.create_histogram(
            c.METRIC_DRAIN_DURATION,
            unit="s",
            description="How long draining a pool took, from the signal to the flushed acks.",
            explicit_bucket_boundaries_advisory=_SECONDS,
        )
        meter.create_observable_gauge(
            c.METRIC_IN_FLIGHT,
            callbacks=[self._gauge(lambda pool: pool.running)],
            unit="{job}",
            description="Jobs running now, by pool.",
        )
        meter.create_observable_gauge(
            c.METRIC_HELD,
            callbacks=[self._gauge(lambda pool: pool.held)],
            unit="{message}",
            description="Messages a pool holds the lease of now, running or not, by pool.",
        )
        meter.create_observable_gauge(
            c.METRIC_POOL_LIMIT,
            callbacks=[self._gauge(lambda pool: pool.limits.max_outstanding)],
            unit="{job}",
            description="Jobs a pool may run at once (max_outstanding), by pool.",
        )
        self._pools: dict[str, WatchedPool] = {}
        self._known_jobs: set[str] = set()
        self._lock = threading.Lock()

    # --- the middleware: a run starts, a message leaves ----------------------------------

    def before(self, run: Run) -> None:
        job = run.job
        self._known_jobs.add(job.name)  # a set's add is atomic; reads tolerate a late one
        self._started.add(job.name)
        if job.published is not None:
            latency = time.time() - job.published
            self._record_queue_latency(max(0.0, latency), (job.name,))

    def settled(self, event: Settled) -> None:
        job = self._job_label(event)
        self._finished.add((job, event.label))
        if event.renewed:
            self._renewed.add(job)
        duration = event.duration
        if duration is not None:
            self._record_duration(duration, (job, event.label))

    def _job_label(self, event: Settled) -> str:
        # A message that never ran may name any job at all: keep label values bounded.
        if event.run is not None or event.job in self._known_jobs:
            return event.job
        return c.UNKNOWN_JOB_LABEL

    def _observe_started(self, options: CallbackOptions) -> Iterable[Observation]:
        totals = self._started.totals()
        return [Observation(count, _attributes(job)) for job, count in totals.items()]

    def _observe_finished(self, options: CallbackOptions) -> Iterable[Observation]:
        totals = self._finished.totals()
        return [Observation(n, _attributes(job, label)) for (job, label), n in totals.items()]

    def _observe_renewed(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(n, _attributes(job)) for job, n in self._renewed.totals().items()]

    def know_jobs(self, names: Iterable[str]) -> None:
        """Jobs that are registered: their name labels even a message that never ran."""
        self._known_jobs.update(names)

    # --- other hooks ------------------------------------------------------------------------

    def lease_extended(self, count: int) -> None:
        """The Leaser's ``on_extend``: ``count`` messages had their ack deadline extended."""
        self._extensions.add(count)

    def rate_limit_waited(self, limiter: str, seconds: float) -> None:
        """A run (or an outbound call) waited ``seconds`` for a token of ``limiter``."""
        self._rate_limit_wait.record(seconds, {c.LABEL_LIMITER: limiter})

    def periodic_late(self, schedule: str, seconds: float) -> None:
        """A tick of ``schedule`` was published ``seconds`` after it fell."""
        self._periodic_lateness.record(seconds, {c.LABEL_SCHEDULE: schedule})

    def periodic_ticks(self, schedule: str, outcome: str, count: int) -> None:
        """``count`` ticks of ``schedule`` were fired, skipped or missed (``outcome``)."""
        self._periodic_ticks.add(count, {c.LABEL_SCHEDULE: schedule, c.LABEL_OUTCOME: outcome})

    def watch_blocked(self, blocked_now: Callable[[], Mapping[str, int] | None]) -> None:
        """Report ``blocked_now()`` (keys blocked now by job, from the shared store; None if
        it cannot be read) as a gauge (``workerpool.ordering``)."""
        self._blocked_now = blocked_now

    def _observe_blocked(self, options: CallbackOptions) -> Iterable[Observation]:
        counts = None if self._blocked_now is None else self._blocked_now()
        return [Observation(n, _attributes(job)) for job, n in (counts or {}).items()]

    def watch_pool(self, name: str, pool: WatchedPool) -> None:
        """Report ``pool``'s running jobs, held messages and limit as gauges labelled
        ``pool=name``."""
        with self._lock:
            self._pools[name] = pool

    def drained(self, name: str, seconds: float) -> None:
        """Pool ``name`` finished draining in ``seconds``; its gauges stop."""
        self._drain.record(seconds, {c.LABEL_POOL: name})
        with self._lock:
            self._pools.pop(name, None)

    def _gauge(
        self, value: Callable[[WatchedPool], int]
    ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        """A gauge callback reporting ``value`` of every watched pool."""

        def observe(options: CallbackOptions) -> Iterable[Observation]:
            with self._lock:
                pools = list(self._pools.items())
            return [Observation(value(pool), {c.LABEL_POOL: name}) for name, pool in pools]

        return observe


def _sdk_histogram(meter: Meter, histogram: JobHistogram) -> _Record:
    """``histogram`` as an SDK instrument of ``meter``: its ``record``, for our labels."""
    instrument = meter.create_histogram(
        histogram.name,
        unit=histogram.unit,
        description=histogram.description,
        explicit_bucket_boundaries_advisory=histogram.bounds,
    )

    def record(value: float, labels: Labels) -> None:
        instrument.record(value, _attributes(*labels))

    return record
