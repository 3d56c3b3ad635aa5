"""The per-job histograms (job duration, queue latency), aggregated by the threads that record
them and handed to this process's metric readers as they collect.

Two OpenTelemetry SDK ``Histogram.record`` calls a job were the largest part of the default
middleware's metrics cost: each builds a ``Measurement``, cleans, copies and hashes its
attributes and takes the aggregation's lock (5.7 us alone; with a hundred slot threads,
taking the two out cut the defaults' CPU per no-op job by a fifth, measured). The SDK cannot
take points aggregated elsewhere (no producer hook in 1.45), so these two histograms are ours
from the record to the reader: each thread adds to bucket counts of its own, with no lock,
and a reader that collects (``JobHistogramReader``) merges them into what it exports, as the
SDK would have: explicit buckets (upper bound inclusive), sum, count, min and max, in the
temporality the reader prefers for histograms.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TypeGuard

from opentelemetry.sdk.metrics import Histogram as SdkHistogram
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricReader,
    MetricsData,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.sdk.metrics.view import DefaultAggregation
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

log = logging.getLogger(__name__)

Labels = tuple[str, ...]  # label values, in the order of the histogram's label names


@dataclass(frozen=True)
class _Totals:
    buckets: tuple[int, ...]
    sum: float
    min: float
    max: float

    @property
    def count(self) -> int:
        return sum(self.buckets)


class JobHistogram:
    """An explicit-bucket histogram that many threads record into without a lock: each thread
    has cells of its own, one per label set, summed when read. Only a thread's first value of
    a label set takes the lock (a reader walks the cells under it: iterating a dict that
    grows raises, and a garbage collection run meanwhile may let another thread in). A reader
    may catch a thread between two fields of one recording: ``count`` is the buckets' sum, so
    the two always agree, and a ``sum`` one value behind is made good by a later reading."""

    def __init__(
        self,
        name: str,
        *,
        unit: str,
        description: str,
        bounds: Sequence[float],
        label_names: Sequence[str],
    ) -> None:
        self.name = name
        self.unit = unit
        self.description = description
        self.bounds = tuple(bounds)
        self.label_names = tuple(label_names)
        self._sum_at = len(self.bounds) + 1  # a cell: the buckets' counts, sum, min, max
        self._local = threading.local()
        self._threads: list[dict[Labels, list[float]]] = []
        self._lock = threading.Lock()  # a new thread, a new label set, a reading

    def record(self, value: float, labels: Labels) -> None:
        """Count ``value`` under ``labels``; a negative or non-finite one is dropped, as the
        SDK drops it."""
        if not 0.0 <= value < math.inf:
            return
        cells: dict[Labels, list[float]] | None = getattr(self._local, "cells", None)
        if cells is None:
            cells = self._local.cells = {}
            with self._lock:
                self._threads.append(cells)
        at = self._sum_at
        cell = cells.get(labels)
        if cell is None:  # made with its first value in it: a reading never sees it empty
            cell = [0] * at + [value, value, value]
            cell[bisect_left(self.bounds, value)] = 1
            with self._lock:
                cells[labels] = cell
            return
        cell[bisect_left(self.bounds, value)] += 1
        cell[at] += value
        if value < cell[at + 1]:
            cell[at + 1] = value
        elif value > cell[at + 2]:
            cell[at + 2] = value

    def totals(self) -> dict[Labels, _Totals]:
        with self._lock:
            cells = [(labels, cell[:]) for each in self._threads for labels, cell in each.items()]
        merged: dict[Labels, list[float]] = {}
        at = self._sum_at
        for labels, cell in cells:
            into = merged.get(labels)
            if into is None:
                merged[labels] = cell
                continue
            for i in range(at + 1):
                into[i] += cell[i]
            into[at + 1] = min(into[at + 1], cell[at + 1])
            into[at + 2] = max(into[at + 2], cell[at + 2])
        return {
            labels: _Totals(tuple(int(n) for n in cell[:at]), cell[at], cell[at + 1], cell[at + 2])
            for labels, cell in merged.items()
        }


@dataclass
class _Collected:
    """A delta reader's last collection: the start of its next delta, and per histogram and
    label set the totals its deltas have reported so far."""

    at: int
    reported: dict[str, dict[Labels, _Totals]]


class JobHistograms:
    """The job histograms of one process, added to what its readers collect."""

    def __init__(self, histograms: Sequence[JobHistogram], scope: str) -> None:
        self.histograms = tuple(histograms)
        self._scope = InstrumentationScope(scope)
        self._started = time.time_ns()
        self._collected: weakref.WeakKeyDictionary[MetricReader, _Collected] = (
            weakref.WeakKeyDictionary()
        )
        # One reading at a time: two collections of one delta reader (its thread and a
        # force_flush) must not both count what was recorded between them, or neither.
        self._lock = threading.Lock()

    def added_to(self, data: MetricsData, reader: MetricReader) -> MetricsData:
        """``data`` as ``reader`` collected it, with the job histograms in it."""
        delta = _preference(reader, "_instrument_class_temporality") is AggregationTemporality.DELTA
        temporality = AggregationTemporality.DELTA if delta else AggregationTemporality.CUMULATIVE
        metrics: list[Metric] = []
        with self._lock:
            now = time.time_ns()
            last = self._collected.get(reader)
            reported: dict[str, dict[Labels, _Totals]] = {}
            for histogram in self.histograms:
                totals = histogram.totals()
                if delta:
                    since = dict(last.reported.get(histogram.name, {})) if last else {}
                    start = last.at if last else self._started
                    points = _delta_points(histogram, totals, since, start, now)
                    reported[histogram.name] = since
                else:
                    points = [
                        _point(histogram, labels, each, self._started, now, minmax=True)
                        for labels, each in totals.items()
                    ]
                if points:
                    metrics.append(
                        Metric(
                            histogram.name,
                            histogram.description,
                            histogram.unit,
                            Histogram(points, temporality),
                        )
                    )
            if delta:
                self._collected[reader] = _Collected(now, reported)
        return _merged(data, metrics, self._scope) if metrics else data


def _preference(reader: MetricReader, kind: str) -> object:
    """The reader's preferred temporality or aggregation for histograms (from its
    exporter's, e.g. OTLP's ``OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE``). The SDK
    keeps them by its own instrument classes, the histogram's a subclass of the public one;
    None if it says nothing."""
    preferred: Mapping[type, object] = getattr(reader, kind, {})
    for instrument, value in preferred.items():
        if issubclass(instrument, SdkHistogram):
            return value
    return None


def _delta_points(
    histogram: JobHistogram,
    totals: Mapping[Labels, _Totals],
    reported: dict[Labels, _Totals],
    start: int,
    at: int,
) -> list[HistogramDataPoint]:
    """A point per label set with values since ``reported`` (which then moves on to
    ``totals``). A label set with no new count keeps its old ``reported``: a sum read one
    value behind goes with its next point, not lost."""
    points = []
    for labels, now in totals.items():
        earlier = reported.get(labels)
        if earlier is None:
            since = now
        else:
            buckets = tuple(n - m for n, m in zip(now.buckets, earlier.buckets, strict=True))
            if not any(buckets):
                continue
            since = _Totals(buckets, now.sum - earlier.sum, now.min, now.max)
        # A delta's min and max would need cells per reader: it leaves them out (OTLP's
        # fields are optional) rather than send the whole run's.
        points.append(_point(histogram, labels, since, start, at, minmax=False))
        reported[labels] = now
    return points


def _point(
    histogram: JobHistogram,
    labels: Labels,
    totals: _Totals,
    start: int,
    at: int,
    *,
    minmax: bool,
) -> HistogramDataPoint:
    return HistogramDataPoint(
        attributes={k: str(v) for k, v in zip(histogram.label_names, labels, strict=True)},
        start_time_unix_nano=start,
        time_unix_nano=at,
        count=totals.count,
        sum=totals.sum,
        bucket_counts=totals.buckets,
        explicit_bounds=histogram.bounds,
        min=totals.min if minmax else None,  # type: ignore[arg-type]
        max=totals.max if minmax else None,  # type: ignore[arg-type]
        exemplars=[],
    )


def _merged(data: MetricsData, metrics: list[Metric], scope: InstrumentationScope) -> MetricsData:
    """``data`` with ``metrics`` in ``scope``'s metrics (made if it has none yet). The SDK
    hands a reader one resource's metrics, and none at all when it has no point (then our
    counters have none either: a job that ran was counted as started)."""
    resources = list(data.resource_metrics) or [ResourceMetrics(Resource.get_empty(), [], "")]
    first = resources[0]
    scopes = list(first.scope_metrics)
    for i, scoped in enumerate(scopes):
        if scoped.scope.name == scope.name:
            scopes[i] = replace(scoped, metrics=[*scoped.metrics, *metrics])
            break
    else:
        scopes.append(ScopeMetrics(scope, metrics, ""))
    resources[0] = replace(first, scope_metrics=scopes)
    return replace(data, resource_metrics=resources)


class TakesJobHistograms:
    """A metric reader of ours: once ``Metrics`` gives it the job histograms, what it collects
    has them (``Metrics`` records them with the SDK instead unless every reader ``takes``)."""

    job_histograms: JobHistograms | None = None

    def with_job_histograms(self, data: MetricsData) -> MetricsData:
        if self.job_histograms is None:
            return data
        assert isinstance(self, MetricReader)
        try:
            return self.job_histograms.added_to(data, self)
        except Exception:  # a bug here must not stop the SDK's export of everything else
            log.exception("job histograms not exported")
            return data


def takes(reader: MetricReader) -> TypeGuard[TakesJobHistograms]:
    """True for a reader of ours that wants histograms as ours are: explicit buckets (a
    preference for another aggregation, such as base-2 exponential, leaves them to the SDK)."""
    preferred = _preference(reader, "_instrument_class_aggregation")
    return isinstance(reader, TakesJobHistograms) and (
        preferred is None or isinstance(preferred, DefaultAggregation)
    )
