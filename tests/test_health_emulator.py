"""A real ``workerpool run`` process: console spans, JSON logs, and the --metrics-port endpoint."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

from tests.support import http_get, ledger_events, spawn_worker, wait_for, worker_processes
from workerpool import constants as c
from workerpool.testing.emulator import free_port
from workerpool.testing.pubsub import PubSubResources

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


def _json_lines(text: str) -> list[dict[str, Any]]:
    entries = []
    for line in text.splitlines():
        if line.startswith("{") and line.endswith("}"):
            try:
                entries.append(json.loads(line))
            except ValueError:
                continue
    return entries


def test_console_exporter_prints_job_spans_and_logs_are_json(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given a worker process with OTEL_TRACES_EXPORTER=console and debug logs, its stderr not
    # a terminal
    pubsub_resources.provision()
    ledger = tmp_path / "ledger.jsonl"
    with worker_processes() as workers:
        environment = {
            "OTEL_TRACES_EXPORTER": "console",
            "OTEL_SERVICE_NAME": "w1",
            "WORKERPOOL_LOG_LEVEL": "debug",
        }
        worker = spawn_worker(pubsub_resources, ledger, extra_env=environment)
        workers.append(worker)
        # When it runs a job published with a trace context, and one whose payload is private
        pubsub_resources.publish(
            "demo.sleep", {"seconds": 0.1}, job_id="traced-1", traceparent=TRACEPARENT
        )
        pubsub_resources.publish("demo.echo", {"note": "PRIVATE-VALUE"}, job_id="echo-1")
        assert wait_for(lambda: len(ledger_events(ledger, "done")) == 1, timeout=30)
        assert wait_for(lambda: "job demo.echo done" in worker.output(), timeout=30)
        worker.signal(signal.SIGTERM)
        assert worker.wait(30) == 0, worker.output()
    output = worker.output()

    # Then the job's span is printed, in the publisher's trace, with its outcome
    assert '"name": "demo.sleep"' in output, output
    assert f'"trace_id": "0x{TRACE_ID}"' in output
    assert '"workerpool.outcome": "done"' in output and '"workerpool.job_id": "traced-1"' in output
    assert '"service.name": "w1"' in output
    # And the log lines are JSON in the Cloud Logging shape: the line of how the job ended at
    # INFO, and (at debug level only) a start line
    entries = _json_lines(output)
    job_lines = [e for e in entries if e.get("logger") == "workerpool.jobs"]
    start, end = [e for e in job_lines if e.get("job_id") == "traced-1"]
    assert start["severity"] == "DEBUG" and start["message"] == "job demo.sleep started"
    assert end["severity"] == "INFO" and end["message"].startswith("job demo.sleep done in ")
    assert {k: end[k] for k in ("job", "job_id", "attempt", "outcome")} == {
        "job": "demo.sleep", "job_id": "traced-1", "attempt": 1, "outcome": "done",
    }  # fmt: skip
    assert end["duration"] >= 0.1 and end["message_id"] == start["message_id"]
    trace_field = f"projects/{pubsub_resources.project}/traces/{TRACE_ID}"
    assert start[c.LOG_TRACE] == trace_field and end[c.LOG_TRACE] == trace_field
    # ... and the payload is in no log line
    assert "PRIVATE-VALUE" not in output


def test_metrics_port_serves_metrics_health_and_readiness_that_drops_on_drain(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given a worker with --metrics-port that has finished one job and runs a long one
    pubsub_resources.provision(ack_deadline=60)
    ledger = tmp_path / "ledger.jsonl"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with worker_processes() as workers:
        worker = spawn_worker(
            pubsub_resources, ledger, "--metrics-port", str(port), "--drain-timeout", "4",
            "--max-outstanding", "2",
        )  # fmt: skip
        workers.append(worker)
        assert wait_for(lambda: http_get(base + "/healthz")[0] == 200, timeout=30), worker.output()
        assert http_get(base + "/readyz") == (200, "ready\n")  # started, so ready
        pubsub_resources.publish("demo.sleep", {"seconds": 0.1}, job_id="quick-1")
        assert wait_for(lambda: len(ledger_events(ledger, "done")) == 1, timeout=30)
        pubsub_resources.publish("demo.sleep", {"seconds": 60}, job_id="long-1")
        assert wait_for(lambda: len(ledger_events(ledger, "start")) == 2, timeout=30)

        # When /metrics is scraped
        status, text = http_get(base + "/metrics")
        # Then it has the counters, the in-flight and held gauges and the limit in Prometheus text
        assert status == 200
        lines = text.splitlines()
        assert 'workerpool_jobs_finished_total{job="demo.sleep",outcome="done"} 1' in lines, text
        assert 'workerpool_jobs_started_total{job="demo.sleep"} 2' in lines
        assert f'workerpool_pool_in_flight{{pool="{pubsub_resources.subscription}"}} 1' in lines
        assert f'workerpool_pool_limit{{pool="{pubsub_resources.subscription}"}} 2' in lines
        assert f'workerpool_pool_held{{pool="{pubsub_resources.subscription}"}} 1' in lines
        assert "# TYPE workerpool_job_duration_seconds histogram" in lines
        # ... and the job histograms, recorded by the worker's own readers: one run timed to
        # its end, two runs' queue latency
        done = 'job="demo.sleep",outcome="done"'
        assert f"workerpool_job_duration_seconds_count{{{done}}} 1" in lines, text
        assert f'workerpool_job_duration_seconds_bucket{{{done},le="0.05"}} 0' in lines
        assert f'workerpool_job_duration_seconds_bucket{{{done},le="+Inf"}} 1' in lines
        assert 'workerpool_job_queue_latency_seconds_count{job="demo.sleep"} 2' in lines, text

        # When it gets SIGTERM while the long job runs (the drain lasts its 4 s timeout)
        sent = worker.signal(signal.SIGTERM)
        # Then /readyz turns 503 at once, while /healthz stays 200 and the process lives on
        assert wait_for(lambda: http_get(base + "/readyz")[0] == 503, timeout=2.0), worker.output()
        became_unready = time.monotonic() - sent
        assert worker.alive()
        assert http_get(base + "/healthz")[0] == 200
        print(f"\n/readyz answered 503 {became_unready:.2f}s after SIGTERM")
        # And the worker exits 0 after the drain timeout, its port closed
        assert worker.wait(30) == 0, worker.output()
        assert http_get(base + "/healthz")[0] == 0
    assert {r["job_id"] for r in ledger_events(ledger, "cancelled")} == {"long-1"}
    # At the default level, one log line per job: how it ended
    job_lines = [e for e in _json_lines(worker.output()) if e.get("logger") == "workerpool.jobs"]
    assert sorted((e["job_id"], e["outcome"]) for e in job_lines) == [
        ("long-1", "drained"), ("quick-1", "done"),
    ]  # fmt: skip
