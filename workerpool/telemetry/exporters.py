"""Tracer and meter providers built from the standard ``OTEL_*`` environment variables.

``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER``: a comma-separated list of ``console``,
``otlp`` or ``none``. Unset means ``none`` here (the SDK's own autoconfiguration would assume
``otlp``), so a worker without a collector does not log export errors. ``otlp`` uses gRPC
unless ``OTEL_EXPORTER_OTLP_[TRACES_|METRICS_]PROTOCOL`` is ``http/protobuf``, and needs the
``otlp`` extra (opentelemetry-exporter-otlp). Endpoint, headers, timeouts, the metric export
interval, the sampler and ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES`` are read by the
SDK and the exporters themselves, as everywhere else. ``OTEL_SDK_DISABLED=true`` turns it off.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from opentelemetry import context, metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    MetricReader,
    MetricsData,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.trace import SpanKind

from workerpool import constants as c
from workerpool.errors import ConfigError
from workerpool.telemetry.histograms import TakesJobHistograms
from workerpool.telemetry.hooks import Telemetry
from workerpool.telemetry.propagation import extract

DEFAULT_SERVICE_NAME = "workerpool"
_OTLP_MODULES = {
    ("traces", "grpc"): "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    ("traces", "http/protobuf"): "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    ("metrics", "grpc"): "opentelemetry.exporter.otlp.proto.grpc.metric_exporter",
    ("metrics", "http/protobuf"): "opentelemetry.exporter.otlp.proto.http.metric_exporter",
}
_OTLP_CLASSES = {"traces": "OTLPSpanExporter", "metrics": "OTLPMetricExporter"}


def _environ(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def disabled(env: Mapping[str, str] | None = None) -> bool:
    return _environ(env).get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def exporter_names(signal: str, env: Mapping[str, str] | None = None) -> list[str]:
    """``console``/``otlp`` names from ``OTEL_{SIGNAL}_EXPORTER``; a ConfigError for others."""
    variable = f"OTEL_{signal.upper()}_EXPORTER"
    raw = _environ(env).get(variable, "").strip().lower()
    names = [name.strip() for name in raw.split(",") if name.strip()]
    if not names or names == ["none"] or disabled(env):
        return []
    for name in names:
        if name not in ("console", "otlp"):
            raise ConfigError(f"{variable}: unknown exporter {name!r} (console, otlp or none)")
    return names


def _otlp(signal: str, env: Mapping[str, str] | None) -> Any:
    environ = _environ(env)
    protocol = (
        environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "grpc"
    ).strip()
    module_name = _OTLP_MODULES.get((signal, protocol))
    if module_name is None:
        raise ConfigError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL: unsupported protocol {protocol!r} "
            "(grpc or http/protobuf)"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        raise ConfigError(
            f"OTEL_{signal.upper()}_EXPORTER=otlp needs the OTLP exporter: "
            "pip install 'workerpool[otlp]'"
        ) from None
    return getattr(module, _OTLP_CLASSES[signal])()


def span_processors(env: Mapping[str, str] | None = None) -> list[SpanProcessor]:
    """One processor per configured trace exporter (console spans are printed at once)."""
    processors: list[SpanProcessor] = []
    for name in exporter_names("traces", env):
        if name == "console":
            processors.append(SimpleSpanProcessor(ConsoleSpanExporter()))
        else:
            exporter: SpanExporter = _otlp("traces", env)
            processors.append(BatchSpanProcessor(exporter))
    return processors


def metric_readers(env: Mapping[str, str] | None = None) -> list[MetricReader]:
    """One periodic reader per configured metric exporter (``OTEL_METRIC_EXPORT_INTERVAL``)."""
    readers: list[MetricReader] = []
    for name in exporter_names("metrics", env):
        exporter = ConsoleMetricExporter() if name == "console" else _otlp("metrics", env)
        readers.append(PeriodicReader(exporter))
    return readers


class PeriodicReader(TakesJobHistograms, PeriodicExportingMetricReader):
    """The SDK's periodic exporting reader, exporting the job histograms too."""

    def _receive_metrics(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> None:
        super()._receive_metrics(self.with_job_histograms(metrics_data), timeout_millis, **kwargs)


def resource() -> Resource:
    """``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES``; service ``workerpool`` by default."""
    detected = Resource.create()
    name = str(detected.attributes.get(SERVICE_NAME, ""))
    if not name or name.startswith("unknown_service"):
        detected = detected.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    return detected


def tracer_provider(processors: Sequence[SpanProcessor]) -> TracerProvider:
    provider = TracerProvider(resource=resource())
    for processor in processors:
        provider.add_span_processor(processor)
    return provider


def telemetry_from_env(
    env: Mapping[str, str] | None = None,
    *,
    extra_readers: Sequence[MetricReader] = (),
    install: bool = True,
) -> Telemetry:
    """Providers from ``OTEL_*`` (plus ``extra_readers``, e.g. the ``/metrics`` reader).

    With ``install`` they also become OpenTelemetry's global providers, so spans and metrics
    that job handlers make through the OpenTelemetry API go to the same exporters. Without a
    trace exporter no job span is made, but the publisher's trace context is still made
    current, so log lines link to its trace. Call ``Telemetry.shutdown()`` at exit to flush.
    """
    if disabled(env):
        # No span per job either: an API tracer would make one only to drop it. The
        # publisher's trace context is still made current, as without a trace exporter. No
        # measurement per job: nothing would ever read one (2-3 us a run, measured).
        return Telemetry(spans_exported=False, metrics_read=False)
    processors = span_processors(env)
    traces = tracer_provider(processors)
    readers = [*metric_readers(env), *extra_readers]
    meters = MeterProvider(resource=resource(), metric_readers=readers)
    if install:
        trace.set_tracer_provider(traces)
        metrics.set_meter_provider(meters)
    return Telemetry(
        tracer_provider=traces,
        meter_provider=meters,
        owned=True,
        spans_exported=bool(processors),
        metric_readers=readers,
    )


@contextlib.contextmanager
def publish_span(topic: str, env: Mapping[str, str] | None = None) -> Iterator[None]:
    """For ``workerpool publish``: a producer span the published jobs' spans are children of.

    Its parent is ``TRACEPARENT``/``TRACESTATE`` from the environment, if set (so a traced
    script can pass its context down). Without a trace exporter no span is made: the parent
    from the environment, if any, is passed on as it is.
    """
    environ = _environ(env)
    carrier = {key.lower(): environ[key] for key in ("TRACEPARENT", "TRACESTATE") if key in environ}
    parent = extract(carrier)
    processors = span_processors(env)
    if not processors:
        token = context.attach(parent)
        try:
            yield
        finally:
            context.detach(token)
        return
    provider = tracer_provider(processors)
    tracer = provider.get_tracer(c.INSTRUMENTATION_NAME)
    attributes = {
        c.SPAN_MESSAGING_SYSTEM: c.MESSAGING_SYSTEM,
        c.SPAN_MESSAGING_DESTINATION: topic,
        c.SPAN_MESSAGING_OPERATION: "send",
    }
    try:
        with tracer.start_as_current_span(
            "publish", context=parent, kind=SpanKind.PRODUCER, attributes=attributes
        ):
            yield
    finally:
        provider.shutdown()
