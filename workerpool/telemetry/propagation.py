"""W3C trace context in message attributes (``traceparent``/``tracestate``).

Publishers inject the current context; the worker extracts it as the job span's parent. The
W3C TraceContext format is part of the message contract, so it is used whatever
``OTEL_PROPAGATORS`` says.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping

from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from workerpool import constants as c

_PROPAGATOR = TraceContextTextMapPropagator()


def inject(attributes: MutableMapping[str, str], context: Context | None = None) -> None:
    """Add the trace context of ``context`` (default: the current one) unless the attributes
    already carry one; without an active span nothing is added."""
    if c.ATTR_TRACEPARENT not in attributes:
        _PROPAGATOR.inject(attributes, context=context)


def extract(attributes: Mapping[str, str]) -> Context:
    """The publisher's context from the attributes (an empty context if there is none)."""
    carrier = {
        key: attributes[key] for key in (c.ATTR_TRACEPARENT, c.ATTR_TRACESTATE) if key in attributes
    }
    return _PROPAGATOR.extract(carrier)
