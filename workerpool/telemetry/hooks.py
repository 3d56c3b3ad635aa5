"""Where telemetry plugs into a worker: plain middleware, and a few callbacks.

``Telemetry`` holds the tracer and meter providers of one process and its ``Metrics``;
``middleware(subscription)`` gives each pool's processor its telemetry middleware (outermost,
so every run is seen, even one the idempotency check short-circuits).
"""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry.metrics import MeterProvider
from opentelemetry.sdk.metrics import MeterProvider as SdkMeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import TracerProvider

from workerpool.telemetry.joblog import JobLog
from workerpool.telemetry.metrics import Metrics
from workerpool.telemetry.tracing import Tracing
from workerpool.worker.middleware import Middleware


class Telemetry:
    """Traces, metrics and job log lines for the pools of one process.

    The providers are injected (tests pass their own; ``workerpool run`` passes the ones built
    from ``OTEL_*``); None means OpenTelemetry's global providers, no-ops until configured.
    OpenTelemetry lets a process set its global providers only once, hence the injection.
    """

    def __init__(
        self,
        *,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
        job_logs: bool = True,
        owned: bool = False,
        spans_exported: bool = True,
        metrics_read: bool = True,
        metric_readers: Sequence[MetricReader] = (),
    ) -> None:
        """``owned``: ``shutdown()`` shuts the providers down too (flushing exporters).
        ``spans_exported``: False when no exporter takes the tracer provider's spans (then job
        spans are not made at all; log lines still carry the publisher's trace).
        ``metrics_read``: False when no reader can ever collect the job metrics
        (``OTEL_SDK_DISABLED``): no run pays for measuring them.
        ``metric_readers``: the meter provider's readers, when the caller made them (see
        ``Metrics``)."""
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        self._record_spans = spans_exported and not _never_samples(tracer_provider)
        self.metrics = Metrics(meter_provider, readers=metric_readers)
        self._metrics_read = metrics_read
        self._job_log = JobLog() if job_logs else None
        self._owned = owned

    def middleware(self, subscription: str) -> list[Middleware]:
        tracing = Tracing(subscription, self.tracer_provider, record=self._record_spans)
        chain: list[Middleware] = [tracing]
        if self._metrics_read:
            chain.append(self.metrics)
        if self._job_log is not None:
            chain.append(self._job_log)
        return chain

    def shutdown(self) -> None:
        """Flush and stop the exporters (only providers this object was given to own)."""
        if not self._owned:
            return
        if isinstance(self.tracer_provider, SdkTracerProvider):
            self.tracer_provider.shutdown()
        if isinstance(self.meter_provider, SdkMeterProvider):
            self.meter_provider.shutdown()


def _never_samples(provider: TracerProvider | None) -> bool:
    """``OTEL_TRACES_SAMPLER=always_off``: the SDK would make a span per job only to drop it."""
    sampler = getattr(provider, "sampler", None)
    return sampler is not None and sampler.get_description() == ALWAYS_OFF.get_description()
