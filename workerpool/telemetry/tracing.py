"""One span per job run, a child of the publisher's span.

The span starts when the run enters the middleware chain and ends when its message is settled
(acked, nacked or dead-lettered), so it carries the outcome label the metrics count. It is the
current span while the handler runs: spans the handler starts are its children, and log lines
it writes carry its trace id. A batch's completion job is the one with a link: to the span its
batch was published in (its fan-in has many causes, so it starts a trace of its own).
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode, TracerProvider

from workerpool import constants as c
from workerpool.telemetry.propagation import extract
from workerpool.worker.middleware import Around, Middleware
from workerpool.worker.outcome import Failed, Outcome, Rejected, Unavailable
from workerpool.worker.run import Run, Settled
from workerpool.worker.text import safe_text


class Tracing(Middleware):
    """Spans for the jobs of one subscription: started in ``run``, ended in ``settled``."""

    def __init__(
        self,
        subscription: str,
        tracer_provider: TracerProvider | None = None,
        *,
        record: bool = True,
    ) -> None:
        """With ``record`` False (no exporter, or a sampler that drops everything) no span is
        made: the publisher's context is only made current, so log lines and the handler's
        own spans still belong to its trace."""
        self._tracer = trace.get_tracer(c.INSTRUMENTATION_NAME, tracer_provider=tracer_provider)
        self._subscription = subscription
        self._record = record

    def around(self, run: Run) -> Around | None:
        if self._record:
            return self._spanned(run)
        # No span of its own: the publisher's context is made current, if it sent one.
        return self._in_context(run) if c.ATTR_TRACEPARENT in run.job.attributes else None

    def _in_context(self, run: Run) -> Around:
        run.span = trace.get_current_span(extract(run.job.attributes))
        with trace.use_span(run.span, end_on_exit=False):
            return (yield)

    def _spanned(self, run: Run) -> Around:
        job = run.job
        span = self._tracer.start_span(
            job.name,
            context=extract(job.attributes),
            kind=SpanKind.CONSUMER,
            links=_links(job.attributes),
            attributes={
                c.SPAN_MESSAGING_SYSTEM: c.MESSAGING_SYSTEM,
                c.SPAN_MESSAGING_DESTINATION: self._subscription,
                c.SPAN_MESSAGING_OPERATION: "process",
                c.SPAN_MESSAGING_MESSAGE_ID: job.message_id,
                c.SPAN_DELIVERY_ATTEMPT: job.delivery_attempt,
                c.SPAN_JOB_ID: job.job_id,
            },
        )
        run.span = span
        try:
            with trace.use_span(span, end_on_exit=False):
                return (yield)
        except BaseException:
            # A middleware bug (handlers cannot raise through ``_invoke``): the span is done.
            span.end()
            raise

    def settled(self, event: Settled) -> None:
        if event.run is None or not event.run.span.is_recording():
            return
        span = event.run.span
        span.set_attribute(c.SPAN_OUTCOME, event.label)
        if event.label in c.FAILED_LABELS:
            error = _record(span, event.run.outcome)
            span.set_status(Status(StatusCode.ERROR, error or event.error_type or event.label))
        span.end()


def _record(span: Span, outcome: Outcome | None) -> str | None:
    """Record what the handler raised on the span; return its failure as a status text."""
    match outcome:
        case Failed(error_type, message, exc) | Rejected(error_type, message, exc):
            if exc is not None:
                span.record_exception(exc)
            else:
                span.add_event(
                    "exception",
                    {"exception.type": error_type, "exception.message": safe_text(message)},
                )
            return safe_text(f"{error_type}: {message}")
        case Unavailable(reason):
            return reason
    return None


def _links(attributes: Mapping[str, str]) -> list[Link]:
    """A link to the span a batch was published in, on its completion job's span."""
    linked = attributes.get(c.ATTR_LINKED_TRACEPARENT)
    if not linked:
        return []
    context = trace.get_current_span(extract({c.ATTR_TRACEPARENT: linked})).get_span_context()
    return [Link(context)] if context.is_valid else []
