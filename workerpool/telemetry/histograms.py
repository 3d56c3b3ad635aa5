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

import math
import threading
import time
import weakref
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

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
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

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
    has cells of its own, summed when read. A reader may catch a thread between two fields of
    one recording: ``count`` is the buckets' sum, so the two always agree, and a ``sum`` one
    value behind is made good by the next collection."""

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
        self._lock = threading.Lock()  # only when a thread records for the first time

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
        cell = cells.get(labels)
        if cell is None:
            cell = cells[labels] = [0] * self._sum_at + [0.0, value, value]
        cell[bisect_left(self.bounds, value)] += 1
        at = self._sum_at
        cell[at] += value
        if value < cell[at + 1]:
            cell[at + 1] = value
        elif value > cell[at + 2]:
            cell[at + 2] = value

    def totals(self) -> dict[Labels, _Totals]:
        with self._lock:
            threads = list(self._threads)
        merged: dict[Labels, list[float]] = {}
        at = self._sum_at
        for cells in threads:
            for labels, cell in list(cells.items()):  # one C call each: no torn dict or cell
                cell = cell[:]
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
    """What a reader collected last: the start of its next delta, and the totals it had."""

    at: int
    totals: dict[str, dict[Labels, _Totals]]


class JobHistograms:
    """The job histograms of one process, added to what its readers collect."""

    def __init__(self, histograms: Sequence[JobHistogram], scope: str) -> None:
        self.histograms = tuple(histograms)
        self._scope = InstrumentationScope(scope)
        self._started = time.time_ns()
        self._collected: weakref.WeakKeyDictionary[MetricReader, _Collected] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    def added_to(self, data: MetricsData, reader: MetricReader) -> MetricsData:
        """``data`` as ``reader`` collected it, with the job histograms in it."""
        now = time.time_ns()
        totals = {h.name: h.totals() for h in self.histograms}
        with self._lock:
            last = self._collected.get(reader)
            self._collected[reader] = _Collected(now, totals)
        delta = _temporality(reader) is AggregationTemporality.DELTA
        metrics: list[Metric] = []
        for histogram in self.histograms:
            before = last.totals.get(histogram.name, {}) if delta and last else {}
            start = last.at if delta and last else self._started
            points = _points(histogram, totals[histogram.name], before, start, now, delta=delta)
            if points:
                temporality = (
                    AggregationTemporality.DELTA if delta else AggregationTemporality.CUMULATIVE
                )
                metrics.append(
                    Metric(
                        histogram.name,
                        histogram.description,
                        histogram.unit,
                        Histogram(points, temporality),
                    )
                )
        return _merged(data, metrics, self._scope) if metrics else data


def _temporality(reader: MetricReader) -> AggregationTemporality:
    # The reader's preference for histograms (from its exporter's, e.g. OTLP's
    # OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE). The SDK keeps it by its own
    # instrument classes, the histogram's a subclass of the public one.
    preferred: Mapping[type, AggregationTemporality] = getattr(
        reader, "_instrument_class_temporality", {}
    )
    for kind, temporality in preferred.items():
        if issubclass(kind, SdkHistogram):
            return temporality
    return AggregationTemporality.CUMULATIVE


def _points(
    histogram: JobHistogram,
    now: Mapping[Labels, _Totals],
    before: Mapping[Labels, _Totals],
    start: int,
    at: int,
    *,
    delta: bool,
) -> list[HistogramDataPoint]:
    points = []
    for labels, totals in now.items():
        attributes = {k: str(v) for k, v in zip(histogram.label_names, labels, strict=True)}
        if not delta:
            points.append(_point(histogram, attributes, totals, start, at, minmax=True))
            continue
        earlier = before.get(labels)
        if earlier is None:
            points.append(_point(histogram, attributes, totals, start, at, minmax=False))
            continue
        buckets = tuple(n - m for n, m in zip(totals.buckets, earlier.buckets, strict=True))
        if any(buckets):
            since = _Totals(buckets, totals.sum - earlier.sum, totals.min, totals.max)
            points.append(_point(histogram, attributes, since, start, at, minmax=False))
    return points


def _point(
    histogram: JobHistogram,
    attributes: dict[str, Any],
    totals: _Totals,
    start: int,
    at: int,
    *,
    minmax: bool,
) -> HistogramDataPoint:
    # A delta's min and max would need cells per reader: it leaves them out (OTLP's fields
    # are optional) rather than send the whole run's.
    return HistogramDataPoint(
        attributes=attributes,
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
    has them (``Metrics`` records them with the SDK instead unless every reader is one)."""

    job_histograms: JobHistograms | None = None

    def with_job_histograms(self, data: MetricsData) -> MetricsData:
        if self.job_histograms is None:
            return data
        assert isinstance(self, MetricReader)
        return self.job_histograms.added_to(data, self)
