"""A metric reader that renders the Prometheus text format, for ``/metrics``.

Collected on each scrape; names follow OpenTelemetry's Prometheus compatibility rules:
``.`` becomes ``_``, the unit is appended (``s`` -> ``_seconds``; ``{annotations}`` add
nothing), counters end in ``_total``, histograms expand to ``_bucket``/``_sum``/``_count``.
Small and dependency-free: opentelemetry-exporter-prometheus would bring prometheus_client
and its own HTTP server, and we serve health checks from the same port anyway.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.sdk.metrics.export import (
    Gauge,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricReader,
    MetricsData,
    Sum,
)

from workerpool.telemetry.histograms import TakesJobHistograms

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_INVALID = re.compile(r"[^a-zA-Z0-9_:]")
_UNITS = {"s": "seconds", "ms": "milliseconds", "By": "bytes", "1": "ratio"}


class PrometheusReader(TakesJobHistograms, MetricReader):
    """Register it on a MeterProvider; ``render()`` collects and returns the text format."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._latest: MetricsData | None = None

    def render(self) -> str:
        with self._lock:
            self.collect()
            data, self._latest = self._latest, None
        return render(data) if data is not None else ""

    def _receive_metrics(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> None:
        self._latest = self.with_job_histograms(metrics_data)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        pass


@dataclass
class _Family:
    name: str
    kind: str
    help: str
    lines: list[str] = field(default_factory=list)


def render(data: MetricsData) -> str:
    families: dict[str, _Family] = {}
    for resource_metrics in data.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                _add(families, metric)
    out: list[str] = []
    for family in families.values():
        out.append(f"# HELP {family.name} {_escape_help(family.help)}")
        out.append(f"# TYPE {family.name} {family.kind}")
        out.extend(family.lines)
    return "\n".join(out) + "\n" if out else ""


def metric_name(name: str, unit: str | None, *, counter: bool) -> str:
    """The Prometheus name of an OpenTelemetry instrument."""
    base = _INVALID.sub("_", name)
    suffix = _unit_suffix(unit or "")
    if suffix and not base.endswith("_" + suffix):
        base = f"{base}_{suffix}"
    if counter and not base.endswith("_total"):
        base += "_total"
    return base


def _unit_suffix(unit: str) -> str:
    unit = re.sub(r"\{[^}]*\}", "", unit).strip()
    return _INVALID.sub("_", _UNITS.get(unit, unit)).strip("_")


def _add(families: dict[str, _Family], metric: Metric) -> None:
    data = metric.data
    if isinstance(data, Sum):
        counter = data.is_monotonic
        kind = "counter" if counter else "gauge"
    elif isinstance(data, Gauge):
        counter, kind = False, "gauge"
    elif isinstance(data, Histogram):
        counter, kind = False, "histogram"
    else:
        return  # exponential histograms: not produced by our instruments
    name = metric_name(metric.name, metric.unit, counter=counter)
    family = families.setdefault(name, _Family(name, kind, metric.description or metric.name))
    if isinstance(data, Histogram):
        for point in data.data_points:
            family.lines.extend(_histogram_lines(name, point))
    else:
        for number in data.data_points:
            family.lines.append(_sample(name, number.attributes, number.value))


def _histogram_lines(name: str, point: HistogramDataPoint) -> Iterable[str]:
    cumulative = 0
    bounds: Sequence[float] = [*point.explicit_bounds, math.inf]
    for bound, count in zip(bounds, point.bucket_counts, strict=False):
        cumulative += count
        labels = {**dict(point.attributes or {}), "le": _value(bound)}
        yield _sample(f"{name}_bucket", labels, cumulative)
    yield _sample(f"{name}_sum", point.attributes, point.sum)
    yield _sample(f"{name}_count", point.attributes, point.count)


def _sample(name: str, attributes: Mapping[str, Any] | None, value: float | int) -> str:
    labels = ",".join(
        f'{_INVALID.sub("_", str(key))}="{_escape_label(str(val))}"'
        for key, val in (attributes or {}).items()
    )
    return f"{name}{{{labels}}} {_value(value)}" if labels else f"{name} {_value(value)}"


def _value(value: float | int) -> str:
    if isinstance(value, float):
        if math.isinf(value):
            return "+Inf" if value > 0 else "-Inf"
        if math.isnan(value):
            return "NaN"
        return repr(value)
    return str(value)


def _escape_label(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")
