"""Traces, metrics, logs and the health endpoint: in-process, with in-memory OpenTelemetry.

OpenTelemetry's global providers can be set once per process, so every test injects its own
providers through ``Telemetry``.
"""

from __future__ import annotations

import io
import json
import logging
import random
import sys
import threading
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricsData
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext, SpanKind, StatusCode, TraceFlags

import workerpool
from tests.support import http_get, wait_for
from workerpool import JobContext, PermanentError, RetryableError
from workerpool import constants as c
from workerpool.cli import main
from workerpool.constants import Label
from workerpool.errors import ConfigError
from workerpool.publishing import JobMessage
from workerpool.ratelimit import LocalLimiters, parse_rate
from workerpool.registry import Registry
from workerpool.telemetry import PrometheusReader, Telemetry, extract, inject
from workerpool.telemetry.exporters import exporter_names, span_processors, telemetry_from_env
from workerpool.telemetry.health import HealthServer
from workerpool.telemetry.histograms import TakesJobHistograms
from workerpool.telemetry.joblog import JobLog
from workerpool.telemetry.logs import (
    CloudLoggingFormatter,
    set_trace_project,
    setup_logging,
)
from workerpool.telemetry.metrics import Metrics
from workerpool.telemetry.prometheus import metric_name
from workerpool.testing.fakes import FakeAcks, FakeDeadLetters, FakeLeaser, make_delivery
from workerpool.testing.pubsub import PubSubResources
from workerpool.worker.lease import Leaser
from workerpool.worker.middleware import Middleware
from workerpool.worker.processor import Processor
from workerpool.worker.run import Settled


class OwnInMemoryReader(TakesJobHistograms, InMemoryMetricReader):
    """An in-memory reader that takes the job histograms, as the worker's own readers do."""

    def _receive_metrics(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> None:
        super()._receive_metrics(self.with_job_histograms(metrics_data), timeout_millis, **kwargs)


def _in_memory(
    *, own_histograms: bool = False
) -> tuple[InMemorySpanExporter, InMemoryMetricReader, Telemetry]:
    """With ``own_histograms``, the job histograms are recorded by workerpool, as with the
    readers ``workerpool run`` makes; else by the SDK, as with a meter provider of a user's."""
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = OwnInMemoryReader() if own_histograms else InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    telemetry = Telemetry(
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
        metric_readers=[reader] if own_histograms else (),
    )
    return spans, reader, telemetry


def _points(data: MetricsData | None, name: str) -> dict[tuple[tuple[str, Any], ...], Any]:
    """``{sorted attributes: value}`` of metric ``name`` (a histogram's value is its count)."""
    assert data is not None
    for resource_metrics in data.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                if metric.name == name:
                    return {
                        tuple(sorted((p.attributes or {}).items())): getattr(p, "value", None)
                        if hasattr(p, "value")
                        else p.count
                        for p in metric.data.data_points
                    }
    return {}


# --- traces ----------------------------------------------------------------------------------


def test_job_spans_are_children_of_the_publishers_span(pubsub_resources: PubSubResources) -> None:
    # Given jobs published with workerpool.publish inside a publisher's span: one that
    # succeeds, one that fails permanently, one that raises an unexpected exception
    pubsub_resources.provision()
    spans, _, telemetry = _in_memory()
    jobs = Registry()

    @jobs.job("t.ok")
    def ok(ctx: JobContext, payload: dict[str, Any]) -> None:
        pass

    @jobs.job("t.broken")
    def broken(ctx: JobContext, payload: dict[str, Any]) -> None:
        raise PermanentError("cannot do that")

    @jobs.job("t.crash", max_attempts=1)
    def crash(ctx: JobContext, payload: dict[str, Any]) -> None:
        raise ValueError("boom")

    publisher_tracer = TracerProvider().get_tracer("publisher")
    with publisher_tracer.start_as_current_span("upload") as parent:
        workerpool.publish(
            pubsub_resources.topic,
            "t.ok",
            {"n": 1},
            job_id="ok-1",
            project=pubsub_resources.project,
        )
        for name in ("t.broken", "t.crash"):
            workerpool.publish(
                pubsub_resources.topic_path,
                name,
                {},
                job_id=f"{name}-1",
                publisher=pubsub_resources.publisher,
            )
    pubsub_resources.publish("t.ok", {}, job_id="untraced-1")  # no trace context: a root span

    # When a worker runs them
    with pubsub_resources.worker(jobs, telemetry=telemetry) as worker:
        assert wait_for(lambda: sum(worker.processor.stats.values()) == 4, timeout=30)

    # Then each run has one span named after its job, in the publisher's trace, its child
    finished = spans.get_finished_spans()
    by_job = {s.attributes[c.SPAN_JOB_ID]: s for s in finished if s.attributes}
    assert sorted(by_job) == ["ok-1", "t.broken-1", "t.crash-1", "untraced-1"]
    publisher = parent.get_span_context()
    for job_id in ("ok-1", "t.broken-1", "t.crash-1"):
        span = by_job[job_id]
        assert span.context is not None and span.parent is not None
        assert span.context.trace_id == publisher.trace_id
        assert span.parent.span_id == publisher.span_id
        assert span.kind is SpanKind.CONSUMER
        assert span.attributes is not None
        assert span.attributes[c.SPAN_MESSAGING_SYSTEM] == "gcp_pubsub"
        assert span.attributes[c.SPAN_MESSAGING_DESTINATION] == pubsub_resources.subscription_path
        assert span.attributes[c.SPAN_MESSAGING_MESSAGE_ID]
        assert span.attributes[c.SPAN_DELIVERY_ATTEMPT] == 1
    ok_span = by_job["ok-1"]
    assert ok_span.name == "t.ok"
    assert ok_span.attributes is not None and ok_span.attributes[c.SPAN_OUTCOME] == "done"
    assert ok_span.status.status_code is StatusCode.UNSET and not ok_span.events
    # ... and a failing run records its exception and an error status
    for job_id, error in (("t.broken-1", "PermanentError"), ("t.crash-1", "ValueError")):
        span = by_job[job_id]
        assert span.attributes is not None
        assert span.attributes[c.SPAN_OUTCOME] == "dead_lettered"
        assert span.status.status_code is StatusCode.ERROR
        (event,) = span.events
        assert event.name == "exception" and event.attributes is not None
        assert str(event.attributes["exception.type"]).endswith(error)
        assert "Traceback" in str(event.attributes["exception.stacktrace"])
    # ... and a message without a trace context starts a trace of its own
    untraced = by_job["untraced-1"]
    assert untraced.parent is None and untraced.context is not None
    assert untraced.context.trace_id != publisher.trace_id


def test_a_batchs_completion_span_links_to_the_span_the_batch_was_published_in(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given a batch of 3 children published inside a publisher's span, on an SQLite store
    pubsub_resources.provision()
    spans, _, telemetry = _in_memory()
    store = f"sqlite:///{tmp_path / 'fleet.db'}"
    jobs = Registry()

    @jobs.job("t.child")
    def child(ctx: JobContext, payload: dict[str, Any]) -> None:
        pass

    @jobs.job("t.done")
    def done(ctx: JobContext, payload: dict[str, Any]) -> None:
        pass

    publisher_tracer = TracerProvider().get_tracer("publisher")
    with publisher_tracer.start_as_current_span("fan-out") as parent:
        workerpool.publish_batch(
            pubsub_resources.topic_path,
            [workerpool.JobMessage("t.child", {}, f"child-{i}") for i in range(3)],
            on_complete="t.done", store=store, publisher=pubsub_resources.publisher,
        )  # fmt: skip
    # When a worker runs the children, then the completion
    with pubsub_resources.worker(jobs, telemetry=telemetry, idempotency_store=store):
        assert wait_for(
            lambda: any(s.name == "t.done" for s in spans.get_finished_spans()), timeout=30
        )
    # Then the completion's span starts a trace of its own (a fan-in has many causes) and
    # links to the batch's publisher's span; each child's span is that span's child
    finished = spans.get_finished_spans()
    [completion] = [s for s in finished if s.name == "t.done"]
    children = [s for s in finished if s.name == "t.child"]
    publisher = parent.get_span_context()
    assert completion.context is not None and completion.parent is None
    assert completion.context.trace_id != publisher.trace_id
    assert [(link.context.trace_id, link.context.span_id) for link in completion.links] == [
        (publisher.trace_id, publisher.span_id)
    ]
    assert len(children) == 3
    assert all(s.parent is not None and s.parent.span_id == publisher.span_id for s in children)
    assert all(not s.links for s in children)


def test_publishing_injects_the_current_trace_context_and_keeps_a_given_one() -> None:
    tracer = TracerProvider().get_tracer("test")
    assert c.ATTR_TRACEPARENT not in JobMessage("j", {}).encode()[1]  # no span, nothing added
    with tracer.start_as_current_span("outer") as span:
        _, attributes = JobMessage("j", {}, "id-1").encode()
        given = "00-0123456789abcdef0123456789abcdef-0123456789abcdef-01"
        _, kept = JobMessage("j", {}, attributes={c.ATTR_TRACEPARENT: given}).encode()
    context = span.get_span_context()
    assert attributes[c.ATTR_TRACEPARENT].startswith(
        f"00-{context.trace_id:032x}-{context.span_id:016x}-"
    )
    assert kept[c.ATTR_TRACEPARENT] == given
    restored = extract(attributes)
    carrier: dict[str, str] = {}
    inject(carrier, restored)
    assert carrier[c.ATTR_TRACEPARENT] == attributes[c.ATTR_TRACEPARENT]


# --- metrics ---------------------------------------------------------------------------------


@pytest.mark.parametrize("own_histograms", [False, True], ids=["sdk-histograms", "own-histograms"])
def test_counters_match_the_outcomes_of_20_jobs_exactly(
    pubsub_resources: PubSubResources, own_histograms: bool
) -> None:
    # Given 20 jobs: 12 that succeed, 4 that fail once then succeed, 4 that fail permanently
    pubsub_resources.provision()
    _, reader, telemetry = _in_memory(own_histograms=own_histograms)
    jobs = Registry()

    @jobs.job("t.ok")
    def ok(ctx: JobContext, payload: dict[str, Any]) -> None:
        pass

    @jobs.job("t.flaky")
    def flaky(ctx: JobContext, payload: dict[str, Any]) -> None:
        if ctx.delivery_attempt < 2:
            raise RetryableError("not yet")

    @jobs.job("t.broken")
    def broken(ctx: JobContext, payload: dict[str, Any]) -> None:
        raise PermanentError("never")

    pubsub_resources.publish_many("t.ok", [(f"ok-{i}", {}) for i in range(12)])
    pubsub_resources.publish_many("t.flaky", [(f"flaky-{i}", {}) for i in range(4)])
    pubsub_resources.publish_many("t.broken", [(f"broken-{i}", {}) for i in range(4)])

    # When a pool of 4 runs them all
    with pubsub_resources.worker(jobs, max_outstanding=4, telemetry=telemetry) as worker:
        stats = worker.processor.stats
        assert wait_for(lambda: stats["done"] + stats["dead_lettered"] == 20, timeout=60)
        gauges = reader.get_metrics_data()
    # (the gauges stop with the pool; the counters stay)
    data = reader.get_metrics_data()
    stats = worker.processor.stats

    # Then the finished counter is exactly the processor's own count, by job and outcome
    finished = _points(data, c.METRIC_JOBS_FINISHED)
    assert finished == {
        (("job", "t.ok"), ("outcome", "done")): 12,
        (("job", "t.flaky"), ("outcome", "retried")): 4,
        (("job", "t.flaky"), ("outcome", "done")): 4,
        (("job", "t.broken"), ("outcome", "dead_lettered")): 4,
    }
    by_outcome: Counter[str] = Counter()
    for attributes, value in finished.items():
        by_outcome[dict(attributes)["outcome"]] += value
    assert by_outcome == stats == Counter(done=16, retried=4, dead_lettered=4)
    # ... runs started and timed once per run, queue latency once per run
    assert _points(data, c.METRIC_JOBS_STARTED) == {
        (("job", "t.ok"),): 12,
        (("job", "t.flaky"),): 8,
        (("job", "t.broken"),): 4,
    }
    assert _points(data, c.METRIC_JOB_DURATION) == finished
    assert sum(_points(data, c.METRIC_QUEUE_LATENCY).values()) == 24
    # ... the pool's in-flight gauge and its limit, and one drain
    pool = (("pool", pubsub_resources.subscription),)
    assert 0 <= _points(gauges, c.METRIC_IN_FLIGHT)[pool] <= 4
    assert _points(gauges, c.METRIC_POOL_LIMIT) == {pool: 4}
    assert _points(data, c.METRIC_DRAIN_DURATION) == {pool: 1}


def test_lease_extensions_and_rate_limit_waits_are_counted() -> None:
    _, reader, telemetry = _in_memory()
    # The Leaser's on_extend hook
    leaser = Leaser(FakeAcks(), extension=30, on_extend=telemetry.metrics.lease_extended)
    leaser.add([make_delivery(b"{}", {}, message_id=f"m-{i}") for i in range(3)])
    leaser.extend_once()
    leaser.extend_once()
    # The rate limiters' on_wait hook (as the launcher wires it)
    limiters = LocalLimiters(
        {"partner": parse_rate("1000/s:1")}, on_wait=telemetry.metrics.rate_limit_waited
    )
    for _ in range(3):
        assert limiters.acquire("partner", 1, threading.Event()) is not None
    data = reader.get_metrics_data()
    assert _points(data, c.METRIC_LEASE_EXTENSIONS) == {(): 6}
    assert _points(data, c.METRIC_RATE_LIMIT_WAIT) == {(("limiter", "partner"),): 3}


def test_unregistered_job_names_do_not_become_label_values() -> None:
    _, reader, telemetry = _in_memory()
    telemetry.metrics.know_jobs(["t.known"])
    for job in ("t.known", "evil-1", "evil-2"):
        telemetry.metrics.settled(Settled(Label.DEAD_LETTERED, job, "id", "m", 1))
    finished = _points(reader.get_metrics_data(), c.METRIC_JOBS_FINISHED)
    assert finished == {
        (("job", "(unknown)"), ("outcome", "dead_lettered")): 2,
        (("job", "t.known"), ("outcome", "dead_lettered")): 1,
    }


def test_messages_renewed_on_their_last_delivery_are_counted_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, reader, telemetry = _in_memory()
    telemetry.metrics.know_jobs(["t.wait"])
    job_log = JobLog()
    events = [
        Settled(Label.DEFERRED, "t.wait", "a", "m1", 5, renewed=True),
        Settled(Label.RELEASED, "t.wait", "b", "m2", 5, renewed=True),
        Settled(Label.DEFERRED, "t.wait", "c", "m3", 4),
    ]
    with caplog.at_level(logging.INFO, logger="workerpool.jobs"):
        for event in events:
            telemetry.metrics.settled(event)
            job_log.settled(event)
    # The counter counts the copies, by job; the finished counter keeps why they came back
    data = reader.get_metrics_data()
    assert _points(data, c.METRIC_MESSAGES_RENEWED) == {(("job", "t.wait"),): 2}
    assert _points(data, c.METRIC_JOBS_FINISHED) == {
        (("job", "t.wait"), ("outcome", "deferred")): 2,
        (("job", "t.wait"), ("outcome", "released")): 1,
    }
    # and the end line says so only where it happened
    fields = [record.fields for record in caplog.records]
    assert [f.get("renewed") for f in fields] == [True, True, None]


def test_every_end_line_has_the_attributes_make_record_gives_it(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given records that name no thread or process (as ``setup_logging`` has them)
    for flag in ("logThreads", "logProcesses", "logMultiprocessing"):
        monkeypatch.setattr(logging, flag, False)
    job_log = JobLog()
    events = [Settled(Label.DONE, f"t.{i}", f"j-{i}", f"m-{i}", 1) for i in range(3)]
    # When several end lines are logged
    with caplog.at_level(logging.INFO, logger="workerpool.jobs"):
        before = time.time()
        for event in events:
            job_log.settled(event)
        after = time.time()
    # Then each has the attributes ``makeRecord`` gives the first, its own time and fields
    logger = logging.getLogger("workerpool.jobs")
    for record, event in zip(caplog.records, events, strict=True):
        made = logger.makeRecord(
            logger.name, record.levelno, record.pathname, record.lineno, record.msg, (), None,
            record.funcName, {"fields": record.fields, "span_context": record.span_context},
        )  # fmt: skip
        # (but for the time, and what a formatter sets on a record it formats)
        timing = {"created", "msecs", "relativeCreated", "message", "asctime"}
        assert {k: v for k, v in vars(record).items() if k not in timing} == {
            k: v for k, v in vars(made).items() if k not in timing
        }
        assert before <= record.created <= after and record.fields["job_id"] == event.job_id
        assert record.getMessage() == f"job {event.job} done"
        assert record.msecs == int((record.created % 1) * 1000)
        # (both since logging started)
        since = (record.created - made.created) * 1000
        assert abs(record.relativeCreated - made.relativeCreated - since) < 0.01
    assert record.funcName == "settled" and record.pathname.endswith("joblog.py")
    # and an application's record factory still makes each one
    made_by_it: list[str] = []
    factory = logging.getLogRecordFactory()

    def counting(*args: Any, **kwargs: Any) -> logging.LogRecord:
        made_by_it.append(args[4])
        return factory(*args, **kwargs)

    logging.setLogRecordFactory(counting)
    try:
        with caplog.at_level(logging.INFO, logger="workerpool.jobs"):
            job_log.settled(events[0])
    finally:
        logging.setLogRecordFactory(factory)
    assert made_by_it == ["job t.0 done"]
    # and so does a logger class of the application's (``logging.setLoggerClass``)

    class Numbering(logging.Logger):
        def makeRecord(self, *args: Any, **kwargs: Any) -> logging.LogRecord:
            made_by_it.append(args[4])
            return super().makeRecord(*args, **kwargs)

    monkeypatch.setattr(logger, "__class__", Numbering)
    with caplog.at_level(logging.INFO, logger="workerpool.jobs"):
        job_log.settled(events[1])
    assert made_by_it == ["job t.0 done", "job t.1 done"]


def test_a_failing_settled_hook_never_breaks_settling() -> None:
    jobs, heard = Registry(), []

    @jobs.job("t.ok")
    def ok(ctx: JobContext, payload: dict[str, Any]) -> None:
        pass

    class Broken(Middleware):
        def settled(self, event: Settled) -> None:
            raise RuntimeError("telemetry bug")

    class Ear(Middleware):
        def settled(self, event: Settled) -> None:
            heard.append(event)

    acks = FakeAcks()
    processor = Processor(jobs, acks, FakeLeaser(), FakeDeadLetters(), [Broken(), Ear()])
    processor.process(make_delivery(b"{}", {"job": "t.ok", "job_id": "a"}))
    processor.process(make_delivery(b"[]", {"job": "t.ok", "job_id": "b"}, message_id="m-2"))
    assert acks.acked == ["ack-m-1", "ack-m-2"]
    done, rejected = heard
    assert (done.label, done.job, done.job_id, done.message_id, done.attempt) == (
        "done", "t.ok", "a", "m-1", 1,
    )  # fmt: skip
    assert done.duration is not None and done.duration >= 0 and not done.error_type
    assert (rejected.label, rejected.duration, rejected.error_type) == (
        "dead_lettered", None, c.ERR_NOT_OBJECT,
    )  # fmt: skip


# --- Prometheus text and the health server ---------------------------------------------------


def test_prometheus_text_format() -> None:
    reader = PrometheusReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    meter.create_counter("workerpool.jobs.finished", unit="{job}", description="Done.").add(
        3, {"job": 'a"b', "outcome": "done"}
    )
    histogram = meter.create_histogram(
        "workerpool.job.duration", unit="s", explicit_bucket_boundaries_advisory=[0.1, 1.0]
    )
    for seconds in (0.05, 0.5, 5.0):
        histogram.record(seconds, {"job": "x"})
    meter.create_up_down_counter("workerpool.held").add(2)
    text = reader.render()
    lines = text.splitlines()
    assert "# TYPE workerpool_jobs_finished_total counter" in lines
    assert "# HELP workerpool_jobs_finished_total Done." in lines
    assert 'workerpool_jobs_finished_total{job="a\\"b",outcome="done"} 3' in lines
    assert "# TYPE workerpool_job_duration_seconds histogram" in lines
    assert 'workerpool_job_duration_seconds_bucket{job="x",le="0.1"} 1' in lines
    assert 'workerpool_job_duration_seconds_bucket{job="x",le="1.0"} 2' in lines
    assert 'workerpool_job_duration_seconds_bucket{job="x",le="+Inf"} 3' in lines
    assert 'workerpool_job_duration_seconds_count{job="x"} 3' in lines
    assert 'workerpool_job_duration_seconds_sum{job="x"} 5.55' in lines
    assert "# TYPE workerpool_held gauge" in lines and "workerpool_held 2" in lines
    assert metric_name("workerpool.drain.duration", "s", counter=False) == (
        "workerpool_drain_duration_seconds"
    )


def test_health_server_answers_real_http_requests() -> None:
    healthy, ready = threading.Event(), threading.Event()
    reader = PrometheusReader()
    MeterProvider(metric_readers=[reader]).get_meter("t").create_counter("workerpool.x").add(1)
    server = HealthServer(
        0, healthy=healthy.is_set, ready=ready.is_set, metrics=reader, host="127.0.0.1"
    ).start()
    base = f"http://127.0.0.1:{server.port}"
    try:
        assert http_get(base + "/healthz")[0] == 503 and http_get(base + "/readyz")[0] == 503
        healthy.set()
        ready.set()
        assert http_get(base + "/healthz") == (200, "ok\n")
        assert http_get(base + "/readyz") == (200, "ready\n")
        status, body = http_get(base + "/metrics")
        assert status == 200 and "workerpool_x_total 1" in body
        assert http_get(base + "/nope")[0] == 404
        with pytest.raises(ConfigError, match="metrics_port: cannot listen on port"):
            HealthServer(server.port, healthy=healthy.is_set, ready=ready.is_set).start()
    finally:
        server.stop()


# --- exporters from OTEL_* ---------------------------------------------------------------------


def test_exporters_follow_the_otel_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    assert exporter_names("traces", {}) == []
    assert exporter_names("traces", {"OTEL_TRACES_EXPORTER": "none"}) == []
    assert exporter_names("metrics", {"OTEL_METRICS_EXPORTER": "console,otlp"}) == [
        "console",
        "otlp",
    ]
    assert (
        exporter_names("traces", {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"})
        == []
    )
    with pytest.raises(ConfigError, match="OTEL_TRACES_EXPORTER: unknown exporter 'zipkin'"):
        exporter_names("traces", {"OTEL_TRACES_EXPORTER": "zipkin"})
    (console,) = span_processors({"OTEL_TRACES_EXPORTER": "console"})
    assert isinstance(console, SimpleSpanProcessor)
    env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    (otlp,) = span_processors(env)
    assert isinstance(otlp, BatchSpanProcessor)
    assert type(otlp.span_exporter).__module__.startswith("opentelemetry.exporter.otlp.proto.http")
    otlp.shutdown()
    with pytest.raises(ConfigError, match="unsupported protocol 'carrier-pigeon'"):
        span_processors(
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "carrier-pigeon"}
        )
    # Without the otlp extra installed: a clear configuration error
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    with pytest.raises(ConfigError) as raised:
        span_processors({"OTEL_TRACES_EXPORTER": "otlp"})
    assert str(raised.value) == (
        "OTEL_TRACES_EXPORTER=otlp needs the OTLP exporter: pip install 'workerpool[otlp]'"
    )


def test_with_the_sdk_disabled_no_job_span_is_made_and_the_publishers_trace_stays_current() -> None:
    # Given the telemetry of a worker run with OTEL_SDK_DISABLED=true, and a job
    telemetry = telemetry_from_env({"OTEL_SDK_DISABLED": "true"}, install=False)
    jobs, seen = Registry(), []

    @jobs.job("t.traced")
    def traced(ctx: JobContext, payload: dict[str, Any]) -> None:
        seen.append(trace.get_current_span())

    processor = Processor(
        jobs, FakeAcks(), FakeLeaser(), FakeDeadLetters(), telemetry.middleware("s")
    )
    # When a message published inside a trace runs
    trace_id, span_id = "ab" * 16, "cd" * 8
    attributes = {"job": "t.traced", "job_id": "j1", "traceparent": f"00-{trace_id}-{span_id}-01"}
    processor.process(make_delivery(b"{}", attributes))
    # Then the span current in the handler is the publisher's own: none was made for the run
    (span,) = seen
    context = span.get_span_context()
    assert (context.trace_id, context.span_id) == (int(trace_id, 16), int(span_id, 16))
    assert not span.is_recording()
    # And no run is measured: nothing could read the metrics (with the SDK on, runs are)
    assert not any(isinstance(mw, Metrics) for mw in telemetry.middleware("s"))
    enabled = telemetry_from_env({}, install=False)
    assert any(isinstance(mw, Metrics) for mw in enabled.middleware("s"))
    enabled.shutdown()


# --- logs -------------------------------------------------------------------------------------


def _record(message: str, **extra: Any) -> logging.LogRecord:
    record = logging.LogRecord("workerpool.jobs", logging.WARNING, __file__, 7, message, (), None)
    record.__dict__.update(extra)
    return record


def test_json_log_lines_have_the_cloud_logging_shape() -> None:
    tracer = TracerProvider().get_tracer("test")
    set_trace_project("proj-1")
    try:
        with tracer.start_as_current_span("job") as span:
            line = CloudLoggingFormatter().format(_record("job t.x retried", fields={"job": "t.x"}))
        untraced = CloudLoggingFormatter().format(_record("plain"))
    finally:
        set_trace_project("")
    entry = json.loads(line)
    context = span.get_span_context()
    assert entry["severity"] == "WARNING" and entry["message"] == "job t.x retried"
    assert entry["job"] == "t.x" and entry["logger"] == "workerpool.jobs" and entry["time"]
    assert entry[c.LOG_TRACE] == f"projects/proj-1/traces/{context.trace_id:032x}"
    assert entry[c.LOG_SPAN_ID] == f"{context.span_id:016x}"
    assert entry[c.LOG_TRACE_SAMPLED] is True
    assert c.LOG_TRACE not in json.loads(untraced)


def _entry_as_one_dict(record: logging.LogRecord, span: Any = None) -> dict[str, Any]:
    """What a JSON line must read as: the entry built as one dict, as the formatter once did."""
    message = record.getMessage() + (f"\n{record.exc_text}" if record.exc_text else "")
    entry: dict[str, Any] = {
        "severity": record.levelname,
        "message": message,
        "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="microseconds"),
        "logger": record.name,
        c.LOG_SOURCE_LOCATION: {
            "file": record.pathname, "line": str(record.lineno), "function": record.funcName
        },
    }  # fmt: skip
    entry.update(getattr(record, "fields", {}))
    if span is not None:
        entry[c.LOG_TRACE] = f"projects/proj-1/traces/{span.trace_id:032x}"
        entry[c.LOG_SPAN_ID] = f"{span.span_id:016x}"
        entry[c.LOG_TRACE_SAMPLED] = span.trace_flags.sampled
    return entry


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"job": "t.x", "attempt": 3, "duration": 0.000123, "ok": True, "none": None},
        {"text": 'caf\u00e9 "quoted"\n\ttab \u2603', "nested": {"a": [1, 2.5, "b"]}},
        {"odd": Path("/x"), "nan": float("nan")},  # not JSON: written as str() and NaN
        {"message": "a field wins", "severity": "ALERT", "job": "t.y"},
        {c.LOG_TRACE: "the trace wins", "logger": "mine"},
        {"surrogate": "\ud800 lone"},
    ],
)
def test_json_lines_read_as_the_entry_built_as_one_dict(fields: dict[str, Any]) -> None:
    # Given records with and without a trace, a traceback, and these fields
    span = SpanContext(0xAB << 100, 0xCD << 40, False, TraceFlags(1))
    try:
        raise ValueError("boom")
    except ValueError:
        failed = _record("failed: %s", exc_info=sys.exc_info(), fields=fields)
    failed.args = ("why",)
    cases = [(_record("m\u00e9ssage", fields=fields), None), (failed, None),
             (_record("traced", fields=fields, span_context=span), span)]  # fmt: skip
    set_trace_project("proj-1")
    try:
        formatter = CloudLoggingFormatter()
        lines = [(formatter.format(record), record, span) for record, span in cases]
    finally:
        set_trace_project("")
    for line, record, span in lines:
        # Then each is one valid UTF-8 JSON object, each key once, equal to the one dict
        line.encode("utf-8")
        pairs = json.loads(line, object_pairs_hook=lambda items: items)
        assert len({key for key, _ in pairs}) == len(pairs)
        expected = json.loads(_JSON_REFERENCE.encode(_entry_as_one_dict(record, span)))
        assert json.dumps(json.loads(line), sort_keys=True) == json.dumps(expected, sort_keys=True)


_JSON_REFERENCE = json.JSONEncoder(default=str, ensure_ascii=False)


def test_json_line_times_are_the_ones_datetime_writes() -> None:
    # Given times on both sides of whole seconds and half microseconds, and random ones
    rng = random.Random(7)
    base = 1_764_860_000
    times = [base + rng.random() * 100 for _ in range(20_000)]
    times += [base + k + f for k in range(5) for f in (0.0, 0.9999995, 0.9999994, 0.0000005,
              0.0000015, 0.5, 0.9999999999)]  # fmt: skip
    formatter = CloudLoggingFormatter()
    record = _record("t")
    for created in times:
        record.created = created
        entry = json.loads(formatter.format(record))
        # Then each is what datetime makes of it, rounding and carry included
        assert entry["time"] == datetime.fromtimestamp(created, UTC).isoformat(
            timespec="microseconds"
        ), created


def test_a_bad_log_call_never_raises_and_other_handlers_see_the_record_as_logged() -> None:
    # Given the worker's log handler and another handler beside it
    root, level = logging.getLogger(), logging.getLogger().level
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    other = Keep()
    stream = io.StringIO()
    try:
        handler = setup_logging(stream=stream)
        root.addHandler(other)
        # When a line is logged whose arguments do not fit its format, and a good one
        logging.raiseExceptions = False  # handleError would print the error to stderr
        logging.getLogger("t").info("%d items", "many")
        logging.getLogger("t").info("%s items", "some")
        handler.flush()
    finally:
        logging.raiseExceptions = True
        root.removeHandler(other)
        root.removeHandler(setup_logging(stream=io.StringIO()))
        root.setLevel(level)
    # Then the call did not raise, the good line was written, and the other handler got the
    # records untouched
    assert "some items" in stream.getvalue()
    assert [(r.msg, r.args) for r in seen] == [("%d items", ("many",)), ("%s items", ("some",))]


def test_lines_queued_from_many_threads_are_each_written_once_by_a_flush() -> None:
    # Given the worker's log handler, with a filter that drops some lines
    root, level = logging.getLogger(), logging.getLogger().level
    stream = io.StringIO()
    try:
        handler = setup_logging(stream=stream)
        handler.addFilter(lambda record: "secret" not in record.getMessage())

        # When 8 threads log 50 lines each (and one line the filter drops), then it flushes
        def log_lines(thread: int) -> None:
            for i in range(50):
                logging.getLogger("t").info("line %d-%d", thread, i)

        threads = [threading.Thread(target=log_lines, args=(t,)) for t in range(8)]
        for thread in threads:
            thread.start()
        logging.getLogger("t").info("a secret line")
        for thread in threads:
            thread.join()
        handler.flush()
        written = stream.getvalue().splitlines()
    finally:
        root.removeHandler(setup_logging(stream=io.StringIO()))
        root.setLevel(level)
    # Then every line is there once, the filtered one is not, and nothing waits unwritten
    messages = sorted(json.loads(line)["message"] for line in written)
    assert messages == sorted(f"line {t}-{i}" for t in range(8) for i in range(50))


def test_job_log_lines_carry_the_run_and_never_the_payload(
    pubsub_resources: PubSubResources, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a job whose payload holds something private
    pubsub_resources.provision()
    _, _, telemetry = _in_memory()
    jobs = Registry()

    @jobs.job("t.private")
    def private(ctx: JobContext, payload: dict[str, Any]) -> None:
        ctx.logger.info("handled")

    pubsub_resources.publish("t.private", {"email": "someone@example.com"}, job_id="p-1")
    # When it runs
    with (
        caplog.at_level(logging.DEBUG),
        pubsub_resources.worker(jobs, telemetry=telemetry) as worker,
    ):
        assert wait_for(lambda: worker.processor.stats["done"] == 1, timeout=30)
    # Then one start line (debug) and one end line (info) carry the run's fields, and the
    # payload is nowhere
    lines = [r for r in caplog.records if r.name == "workerpool.jobs"]
    assert [r.levelno for r in lines] == [logging.DEBUG, logging.INFO]
    start, end = [r.fields for r in lines]
    assert start == {"job": "t.private", "job_id": "p-1", "message_id": start["message_id"],
                     "attempt": 1}  # fmt: skip
    assert end["outcome"] == "done" and end["duration"] >= 0 and end["job_id"] == "p-1"
    assert end["message_id"] == start["message_id"] and end["attempt"] == 1
    assert lines[1].span_context.is_valid  # the end line keeps the run's trace
    formatter = CloudLoggingFormatter()
    text = "\n".join(formatter.format(r) for r in caplog.records)
    assert "someone@example.com" not in text
    handled = [json.loads(formatter.format(r)) for r in caplog.records if r.msg == "handled"]
    assert handled and handled[0]["job_id"] == "p-1"


def test_cli_publish_passes_the_trace_context_on(
    pubsub_resources: PubSubResources, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a traced script's context in TRACEPARENT
    pubsub_resources.provision()
    given = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    monkeypatch.setenv("TRACEPARENT", given)
    publish = [
        "publish",
        "--project",
        pubsub_resources.project,
        "--topic",
        pubsub_resources.topic,
        "--job",
        "t.x",
    ]
    runner = CliRunner()
    # When jobs are published without a trace exporter, then with one
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    assert runner.invoke(main, [*publish, "--job-id", "plain", "--data", "{}"]).exit_code == 0
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    assert runner.invoke(main, [*publish, "--job-id", "spanned", "--data", "{}"]).exit_code == 0
    received = pubsub_resources.subscriber.pull(
        request={"subscription": pubsub_resources.subscription_path, "max_messages": 10}, timeout=10
    ).received_messages
    parents = {
        m.message.attributes["job_id"]: m.message.attributes["traceparent"] for m in received
    }
    # Then the first carries the given context as it is; the second a publish span in its trace
    assert parents["plain"] == given
    assert parents["spanned"].split("-")[1] == given.split("-")[1]
    assert parents["spanned"].split("-")[2] != given.split("-")[2]
