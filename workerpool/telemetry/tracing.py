"""One span per job run, a child of the publisher's span.

The span starts when the run enters the middleware chain and ends when its message is settled
(acked, nacked or dead-lettered), so it carries the outcome label the metrics count. It is the
current span while the handler runs: spans the handler starts are its children, and log lines
it writes carry its trace id.
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, TracerProvider

from workerpool import constants as c
from workerpool.context import JobContext
from workerpool.envelope import Job
from workerpool.listeners import Settled
from workerpool.middleware import Middleware, Next
from workerpool.outcome import Failed, Outcome, Rejected, Unavailable
from workerpool.telemetry.propagation import extract
from workerpool.telemetry.runs import PerRun


@dataclass
class _Open:
    span: Span
    error: str | None = None  # the run's own failure, for the span status


class Tracing(Middleware):
    """Spans for the jobs of one subscription; ``settled`` is its settle listener."""

    def __init__(self, subscription: str, tracer_provider: TracerProvider | None = None) -> None:
        self._tracer = trace.get_tracer(c.INSTRUMENTATION_NAME, tracer_provider=tracer_provider)
        self._subscription = subscription
        self._open: PerRun[_Open] = PerRun()

    def run(self, job: Job, ctx: JobContext, call_next: Next) -> Outcome:
        span = self._tracer.start_span(
            job.name,
            context=extract(job.attributes),
            kind=SpanKind.CONSUMER,
            attributes={
                c.SPAN_MESSAGING_SYSTEM: c.MESSAGING_SYSTEM,
                c.SPAN_MESSAGING_DESTINATION: self._subscription,
                c.SPAN_MESSAGING_OPERATION: "process",
                c.SPAN_MESSAGING_MESSAGE_ID: job.message_id,
                c.SPAN_DELIVERY_ATTEMPT: job.delivery_attempt,
                c.SPAN_JOB_ID: job.job_id,
            },
        )
        entry = _Open(span)
        self._open.put(job, entry)
        try:
            with trace.use_span(span, end_on_exit=False):
                outcome = call_next(job, ctx)
        except BaseException:
            # A middleware bug (handlers cannot raise through ``_invoke``): the span is done.
            self._open.discard(job)
            span.end()
            raise
        entry.error = _record(span, outcome)
        return outcome

    def settled(self, event: Settled) -> None:
        entry = self._open.pop(event)
        if entry is None:
            return
        entry.span.set_attribute(c.SPAN_OUTCOME, event.label)
        if event.label in c.FAILED_LABELS:
            description = entry.error or event.error_type or event.label
            entry.span.set_status(Status(StatusCode.ERROR, description))
        entry.span.end()


def _record(span: Span, outcome: Outcome) -> str | None:
    """Record what the handler raised on the span; return its failure as a status text."""
    if not span.is_recording():
        return None  # the drain deadline settled it already
    match outcome:
        case Failed(error_type, message, exc) | Rejected(error_type, message, exc):
            if exc is not None:
                span.record_exception(exc)
            else:
                span.add_event(
                    "exception",
                    {"exception.type": error_type, "exception.message": message},
                )
            return f"{error_type}: {message}"
        case Unavailable(reason):
            return reason
    return None
