"""OpenTelemetry traces and metrics, and job log lines, as middleware of the worker.

``Telemetry`` (providers injected, or the global ones) gives each pool its middleware;
``telemetry_from_env`` builds it from the ``OTEL_*`` variables.
"""

from workerpool.telemetry.exporters import telemetry_from_env
from workerpool.telemetry.hooks import Telemetry
from workerpool.telemetry.joblog import JobLog
from workerpool.telemetry.metrics import Metrics
from workerpool.telemetry.prometheus import PrometheusReader
from workerpool.telemetry.propagation import extract, inject
from workerpool.telemetry.tracing import Tracing

__all__ = [
    "JobLog",
    "Metrics",
    "PrometheusReader",
    "Telemetry",
    "Tracing",
    "extract",
    "inject",
    "telemetry_from_env",
]
