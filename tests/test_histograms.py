"""The job histograms workerpool records itself: the same points the SDK would make, from
many threads at once, in the temporality each reader asks for, through the readers the
worker makes."""

from __future__ import annotations

import gc
import math
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest
from opentelemetry.sdk.metrics import Histogram as SdkHistogram
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    HistogramDataPoint,
    InMemoryMetricReader,
    MetricExporter,
    MetricExportResult,
    MetricsData,
)
from opentelemetry.sdk.metrics.view import Aggregation, ExponentialBucketHistogramAggregation

from workerpool import constants as c
from workerpool.telemetry import PrometheusReader
from workerpool.telemetry.exporters import PeriodicReader
from workerpool.telemetry.histograms import JobHistogram, JobHistograms, _Totals
from workerpool.telemetry.metrics import Metrics

BOUNDS = (0.1, 1.0, 10.0)
# On a bound (counted in its bucket: upper bounds are inclusive), between, beyond, zero.
VALUES = (0.0, 0.05, 0.1, 0.1000001, 0.7, 1.0, 3.0, 10.0, 11.0, 1e6)


def _histogram(labels: Sequence[str] = ("job",)) -> JobHistogram:
    return JobHistogram("t.seconds", unit="s", description="T.", bounds=BOUNDS, label_names=labels)


class _Exporter(MetricExporter):
    """Keeps what it is given, and asks for the temporality it is made with."""

    def __init__(
        self, histograms: AggregationTemporality, aggregation: Aggregation | None = None
    ) -> None:
        super().__init__(
            preferred_temporality={SdkHistogram: histograms},
            preferred_aggregation={SdkHistogram: aggregation} if aggregation else None,
        )
        self.exported: list[MetricsData] = []

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> MetricExportResult:
        self.exported.append(metrics_data)
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        pass


def _job_points(data: MetricsData, name: str) -> dict[str, HistogramDataPoint]:
    found = {}
    for resource_metrics in data.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                if metric.name == name:
                    for point in metric.data.data_points:
                        found[str((point.attributes or {})["job"])] = point
    return found


def _names(data: MetricsData) -> set[tuple[str, str]]:
    """(scope, metric) of every metric in ``data``."""
    return {
        (scope.scope.name, metric.name)
        for rm in data.resource_metrics
        for scope in rm.scope_metrics
        for metric in scope.metrics
    }


def _summary(point: HistogramDataPoint) -> tuple[Any, ...]:
    return (
        tuple(point.bucket_counts), point.count, point.sum, point.min, point.max,
        tuple(point.explicit_bounds),
    )  # fmt: skip


def test_points_are_the_ones_the_sdk_makes_for_the_same_values() -> None:
    # Given the same values recorded by the SDK and by a job histogram
    sdk_reader = InMemoryMetricReader()
    sdk = (
        MeterProvider(metric_readers=[sdk_reader])
        .get_meter("t")
        .create_histogram("t.seconds", unit="s", explicit_bucket_boundaries_advisory=BOUNDS)
    )
    ours = _histogram()
    for value in VALUES:
        sdk.record(value, {"job": "a"})
        ours.record(value, ("a",))
    sdk.record(0.5, {"job": "b"})
    ours.record(0.5, ("b",))

    # When a reader of ours collects
    exporter = _Exporter(AggregationTemporality.CUMULATIVE)
    reader = PeriodicReader(exporter, export_interval_millis=math.inf)
    provider = MeterProvider(metric_readers=[reader])
    reader.job_histograms = JobHistograms([ours], "workerpool")
    provider.get_meter("other").create_counter("t.count").add(1)  # the SDK has points too
    reader.collect()

    # Then its points are the SDK's: buckets, count, sum, min and max, by label
    expected = _job_points(sdk_reader.get_metrics_data(), "t.seconds")
    got = _job_points(exporter.exported[-1], "t.seconds")
    assert {job: _summary(p) for job, p in got.items()} == {
        job: _summary(p) for job, p in expected.items()
    }
    assert got["a"].bucket_counts == (3, 3, 2, 2)
    # ... beside the SDK's own metrics, in a scope of its own
    assert _names(exporter.exported[-1]) == {("other", "t.count"), ("workerpool", "t.seconds")}
    provider.shutdown()


def test_values_the_sdk_would_drop_are_dropped() -> None:
    ours = _histogram()
    for value in (-1.0, math.nan, math.inf, -math.inf):
        ours.record(value, ("a",))
    assert ours.totals() == {}
    ours.record(2.0, ("a",))
    assert ours.totals()[("a",)].count == 1


def test_many_threads_recording_at_once_lose_nothing() -> None:
    # Given 16 threads recording 5,000 values each under two labels, while a reader collects
    ours = _histogram()
    start = threading.Barrier(17)
    collected: list[int] = []

    def record(index: int) -> None:
        start.wait()
        for i in range(5_000):
            ours.record((i % 20) / 10, ("even" if index % 2 == 0 else "odd",))

    def read() -> None:
        start.wait()
        for _ in range(200):
            collected.append(sum(t.count for t in ours.totals().values()))

    threads = [threading.Thread(target=record, args=(i,)) for i in range(16)]
    reader = threading.Thread(target=read)
    for thread in [*threads, reader]:
        thread.start()
    for thread in [*threads, reader]:
        thread.join()

    # Then the totals are exact, and no reading went backwards or past them
    totals = ours.totals()
    assert {labels: t.count for labels, t in totals.items()} == {
        ("even",): 40_000,
        ("odd",): 40_000,
    }
    per_thread_sum = sum((i % 20) / 10 for i in range(5_000))
    assert totals[("even",)].sum == pytest.approx(8 * per_thread_sum)
    assert (totals[("odd",)].min, totals[("odd",)].max) == (0.0, 1.9)
    assert collected == sorted(collected) and collected[-1] <= 80_000


def test_a_reader_that_prefers_delta_gets_what_was_recorded_since_it_last_collected() -> None:
    # Given a delta reader and a cumulative one, both of ours, on one provider
    delta_exporter = _Exporter(AggregationTemporality.DELTA)
    cumulative_exporter = _Exporter(AggregationTemporality.CUMULATIVE)
    delta = PeriodicReader(delta_exporter, export_interval_millis=math.inf)
    cumulative = PeriodicReader(cumulative_exporter, export_interval_millis=math.inf)
    provider = MeterProvider(metric_readers=[delta, cumulative])
    Metrics(provider, readers=[delta, cumulative])
    assert delta.job_histograms is cumulative.job_histograms is not None
    histogram = delta.job_histograms.histograms[0]
    assert histogram.name == c.METRIC_JOB_DURATION
    provider.get_meter("other").create_counter("t.count").add(1)

    # When jobs a and b finish, both readers collect, then only a finishes again
    histogram.record(0.5, ("a", "done"))
    histogram.record(2.0, ("b", "done"))
    delta.collect()
    cumulative.collect()
    histogram.record(20.0, ("a", "done"))
    delta.collect()
    cumulative.collect()

    # Then the delta reader's second collection has a's one new value only, from its first
    first, second = (_job_points(d, c.METRIC_JOB_DURATION) for d in delta_exporter.exported)
    assert {job: p.count for job, p in first.items()} == {"a": 1, "b": 1}
    assert {job: (p.count, p.sum) for job, p in second.items()} == {"a": (1, 20.0)}
    assert second["a"].start_time_unix_nano == first["a"].time_unix_nano
    assert (second["a"].min, second["a"].max) == (None, None)  # not known for an interval
    assert ("other", "t.count") in _names(delta_exporter.exported[-1])  # nothing else lost
    # ... and the cumulative reader's has everything, with min and max, from the start
    totals = _job_points(cumulative_exporter.exported[-1], c.METRIC_JOB_DURATION)
    assert {job: (p.count, p.sum, p.min, p.max) for job, p in totals.items()} == {
        "a": (2, 20.5, 0.5, 20.0),
        "b": (1, 2.0, 2.0, 2.0),
    }
    assert totals["a"].start_time_unix_nano == first["a"].start_time_unix_nano
    provider.shutdown()


def test_the_sdk_records_them_when_a_reader_is_not_one_of_ours() -> None:
    # (what the SDK then records: test_telemetry's counters test, with its sdk-histograms)
    ours, theirs = PrometheusReader(), InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[ours, theirs])
    Metrics(provider, readers=[ours, theirs])
    assert ours.job_histograms is None
    alone = PrometheusReader()
    Metrics(MeterProvider(metric_readers=[alone]))  # readers not said: a provider of a user's
    assert alone.job_histograms is None


def test_the_prometheus_reader_renders_them() -> None:
    reader = PrometheusReader()
    provider = MeterProvider(metric_readers=[reader])
    Metrics(provider, readers=[reader])
    provider.get_meter("other").create_counter("t.count").add(1)
    assert reader.job_histograms is not None
    duration = reader.job_histograms.histograms[0]
    for seconds in (0.003, 0.3, 3.0):
        duration.record(seconds, ("x", "done"))
    lines = reader.render().splitlines()
    assert "# TYPE workerpool_job_duration_seconds histogram" in lines
    labels = 'job="x",outcome="done"'
    assert f'workerpool_job_duration_seconds_bucket{{{labels},le="0.005"}} 1' in lines
    assert f'workerpool_job_duration_seconds_bucket{{{labels},le="0.5"}} 2' in lines
    assert f'workerpool_job_duration_seconds_bucket{{{labels},le="+Inf"}} 3' in lines
    assert f"workerpool_job_duration_seconds_count{{{labels}}} 3" in lines
    assert f"workerpool_job_duration_seconds_sum{{{labels}}} 3.303" in lines


class _Finalized:
    """Freed by the garbage collector only; its finalizer lets other threads in."""

    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        time.sleep(0)


def test_a_reading_meets_no_label_set_added_meanwhile() -> None:
    # Given a thread adding a label set a record, and collections that let other threads in
    # while a reading walks the cells (a finalizer that releases the GIL)
    ours = _histogram()
    stop = threading.Event()

    def record() -> None:
        i = 0
        while not stop.is_set():
            ours.record(0.5, (f"job{i}",))
            i += 1
            time.sleep(0)

    recorder = threading.Thread(target=record)
    recorder.start()
    thresholds = gc.get_threshold()
    gc.set_threshold(50)
    raised = []
    try:
        # When it is read 300 times (before the cells were walked under the lock, about
        # two readings in three raised "dictionary changed size during iteration")
        for _ in range(300):
            for _ in range(20):
                _Finalized()
            try:
                ours.totals()
            except RuntimeError as exc:
                raised.append(exc)
    finally:
        gc.set_threshold(*thresholds)
        stop.set()
        recorder.join()
    # Then no reading raised
    assert raised == []


def _delta_reader() -> tuple[_Exporter, PeriodicReader, MeterProvider, JobHistogram]:
    exporter = _Exporter(AggregationTemporality.DELTA)
    reader = PeriodicReader(exporter, export_interval_millis=math.inf)
    provider = MeterProvider(metric_readers=[reader])
    Metrics(provider, readers=[reader])
    provider.get_meter("other").create_counter("t.count").add(1)
    assert reader.job_histograms is not None
    return exporter, reader, provider, reader.job_histograms.histograms[0]


def _delta_sums(exporter: _Exporter) -> list[tuple[int, float]]:
    return [
        (point.count, point.sum)
        for data in exporter.exported
        for point in _job_points(data, c.METRIC_JOB_DURATION).values()
    ]


def test_two_collections_of_a_delta_reader_at_once_count_each_value_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a delta reader whose collection on its own thread pauses after reading the totals
    exporter, reader, provider, duration = _delta_reader()
    duration.record(1.0, ("a", "done"))
    read, go = threading.Event(), threading.Event()
    totals = duration.totals

    def slow_on_the_readers_thread() -> dict[tuple[str, ...], _Totals]:
        found = totals()
        if threading.current_thread().name == "periodic":
            read.set()
            go.wait(10)
        return found

    monkeypatch.setattr(duration, "totals", slow_on_the_readers_thread)
    periodic = threading.Thread(target=reader.collect, name="periodic")
    periodic.start()
    assert read.wait(10)
    # When a job ends and a force_flush collects meanwhile, then the paused one goes on
    duration.record(1.0, ("a", "done"))
    flush = threading.Thread(target=reader.collect)
    flush.start()
    go.set()
    periodic.join(10)
    flush.join(10)
    reader.collect()
    # Then the deltas count the two values once each, none negative
    counts = [count for count, _ in _delta_sums(exporter)]
    assert sum(counts) == 2 and min(counts) > 0, counts
    provider.shutdown()


def test_a_sum_read_one_value_behind_goes_with_the_next_delta(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a delta reader that reads a value's bucket count but not yet its sum (a thread
    # caught between the two), then, with nothing new, the whole of it
    exporter, reader, provider, duration = _delta_reader()
    duration.record(1.0, ("a", "done"))
    duration.record(7.0, ("a", "done"))
    whole = duration.totals()[("a", "done")]
    torn = _Totals(whole.buckets, 1.0, whole.min, whole.max)
    monkeypatch.setattr(duration, "totals", lambda: {("a", "done"): torn})
    reader.collect()
    monkeypatch.undo()
    reader.collect()
    # When the label set records again
    duration.record(3.0, ("a", "done"))
    reader.collect()
    # Then every value's sum was exported once: the missing 7 with the next point
    sums = _delta_sums(exporter)
    assert sums == [(2, 1.0), (1, 10.0)]
    assert sum(total for _, total in sums) == 11.0
    provider.shutdown()


def test_a_failing_merge_exports_everything_else_and_the_next_collection_has_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    exporter, reader, provider, duration = _delta_reader()
    duration.record(1.0, ("a", "done"))

    def broken() -> dict[tuple[str, ...], _Totals]:
        raise RuntimeError("a bug")

    monkeypatch.setattr(duration, "totals", broken)
    reader.collect()  # on the SDK's periodic thread, a raise here would end that thread
    assert "job histograms not exported" in caplog.text
    assert _job_points(exporter.exported[-1], c.METRIC_JOB_DURATION) == {}
    assert ("other", "t.count") in _names(exporter.exported[-1])  # the SDK's own went out
    monkeypatch.undo()
    reader.collect()
    assert _delta_sums(exporter) == [(1, 1.0)]
    provider.shutdown()


def test_a_reader_that_wants_another_histogram_aggregation_leaves_them_to_the_sdk() -> None:
    exporter = _Exporter(AggregationTemporality.CUMULATIVE, ExponentialBucketHistogramAggregation())
    reader = PeriodicReader(exporter, export_interval_millis=math.inf)
    provider = MeterProvider(metric_readers=[reader])
    Metrics(provider, readers=[reader])
    assert reader.job_histograms is None
    provider.shutdown()
