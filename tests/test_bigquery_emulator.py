"""The BigQuery reverse-ETL job's lifecycle on the local BigQuery emulator and Pub/Sub emulator.

The emulator cannot run ``EXPORT DATA ... format='CLOUD_BIGTABLE'`` (it answers invalidQuery,
which one test uses), so the other tests swap the statement for a query that naps (see
tests/bigquery_fixture.py); everything else (job ids, 409s, labels, the cap's jobs.list,
polling, cancel) is the emulator's real behaviour. Each test runs its BigQuery jobs in a
project of its own, so one test's jobs never count toward another's cap.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import workerpool_jobs.bigquery_reverse_etl as plugin
from google.api_core.client_options import ClientOptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import bigquery
from workerpool_jobs.bigquery_reverse_etl import JOB_NAME, ExportRequest, run_export
from workerpool_jobs.bigquery_reverse_etl.launch import (
    EMULATOR_ENV,
    JOB_ID_PREFIX,
    JOB_LABEL_VALUE,
    LABEL_JOB,
    LABEL_JOB_ID,
    job_ids,
    label_value,
    make_client,
)
from workerpool_jobs.bigquery_reverse_etl.payload import PluginConfig

from tests.bigquery_fixture import (
    EXAMPLE_PAYLOAD,
    LIST_LAG_ENV,
    NAP_ENV,
    find_local_bigquery,
    local_bigquery,
    nap_query,
)
from tests.support import WorkerProcess, spawn_worker, wait_for, worker_processes
from workerpool import JobContext
from workerpool import constants as c
from workerpool.registry import Registry
from workerpool.slots import SqliteSlots
from workerpool.testing.pubsub import PubSubResources

EMULATOR_PROJECT = "workerpool-bq"
SLOT_KEY = PluginConfig().slot_key
PAYLOAD = {k: v for k, v in EXAMPLE_PAYLOAD.items() if k != "location"}


@pytest.fixture(scope="session")
def bigquery_host() -> Iterator[str]:
    """The emulator's URL, also exported as BIGQUERY_EMULATOR_HOST for the plugin and for
    worker processes. Without local-bigquery the tests skip, except under CI=true."""
    existing = os.environ.get(EMULATOR_ENV)
    if existing:
        yield existing
        return
    executable = find_local_bigquery()
    if executable is None:
        reason = (
            "local-bigquery could not be installed (emulator/install-bigquery-emulator.sh "
            "needs Python 3.13 and PyPI): the BigQuery emulator tests cannot run"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    with local_bigquery(executable, EMULATOR_PROJECT) as url:
        os.environ[EMULATOR_ENV] = url
        print(f"\nBigQuery emulator at {url}")
        try:
            yield url
        finally:
            os.environ.pop(EMULATOR_ENV, None)


@pytest.fixture
def project(bigquery_host: str) -> str:
    """A BigQuery project of this test's own on the emulator."""
    return f"wp-bq-{uuid.uuid4().hex[:10]}"


def client_for(host: str, project: str) -> bigquery.Client:
    return bigquery.Client(
        project=project,
        credentials=AnonymousCredentials(),  # type: ignore[no-untyped-call]
        client_options=ClientOptions(api_endpoint=host),
    )


def plugin_config(project: str, **overrides: Any) -> dict[str, Any]:
    return {
        "project": project,
        "location": "US",
        "max_concurrent_exports": 2,
        "defer_seconds": 1.0,
        "poll_min_seconds": 0.2,
        "poll_max_seconds": 0.5,
        **overrides,
    }


def registry(timeout: float = plugin.JOB_TIMEOUT) -> Registry:
    """The plugin's handler in a registry of the test's own (timeout as given)."""
    jobs = Registry()

    @jobs.job(
        JOB_NAME,
        timeout=timeout,
        max_attempts=plugin.MAX_ATTEMPTS,
        payload=ExportRequest,
        config=PluginConfig,
    )
    def handler(ctx: JobContext, request: ExportRequest) -> None:
        run_export(ctx, request, timeout=timeout)

    return jobs


def our_jobs(client: bigquery.Client, job_id: str | None = None) -> list[Any]:
    """Every job the plugin started in the client's project (of ``job_id`` if given)."""
    return [
        job
        for job in client.list_jobs()
        if job.job_id.startswith(JOB_ID_PREFIX)
        and job.labels.get(LABEL_JOB) == JOB_LABEL_VALUE
        and (job_id is None or job.labels.get(LABEL_JOB_ID) == label_value(job_id))
    ]


def running_exports(client: bigquery.Client) -> int:
    """PENDING and RUNNING exports (PENDING listed first, so a job starting in between is
    counted once rather than missed)."""
    return len(
        {
            job.job_id
            for state in ("pending", "running")
            for job in client.list_jobs(state_filter=state)
            if job.labels.get(LABEL_JOB) == JOB_LABEL_VALUE
        }
    )


def test_a_message_runs_one_bigquery_job_and_its_job_id_again_starts_none(
    pubsub_resources: PubSubResources,
    bigquery_host: str,
    project: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a worker whose exports nap for a second
    pubsub_resources.provision()
    monkeypatch.setattr(plugin, "query_builder", nap_query(1.0))
    client, job_id = client_for(bigquery_host, project), "segments-2026-11-30"
    config = {JOB_NAME: plugin_config(project)}
    with pubsub_resources.worker(registry(), job_config=config) as worker:
        # When a message runs, and the same job id is published again after it completed
        pubsub_resources.publish(JOB_NAME, PAYLOAD, job_id=job_id)
        assert wait_for(lambda: worker.processor.stats["done"] == 1, timeout=30)
        pubsub_resources.publish(JOB_NAME, PAYLOAD, job_id=job_id)
        assert wait_for(lambda: worker.processor.stats["duplicate"] == 1, timeout=30)
        first_stats = dict(worker.processor.stats)
    # ... and once more to a worker whose idempotency store never saw it (a fresh memory://)
    with pubsub_resources.worker(registry(), job_config=config) as fresh:
        pubsub_resources.publish(JOB_NAME, PAYLOAD, job_id=job_id)
        assert wait_for(lambda: fresh.processor.stats["done"] == 1, timeout=30)

    # Then exactly one BigQuery job ran, under the id derived from the job id, with our labels
    jobs = our_jobs(client, job_id)
    assert [job.job_id for job in jobs] == [job_ids(job_id)(1)]
    job = client.get_job(jobs[0].job_id)
    assert job.state == "DONE" and job.error_result is None
    assert job.labels == {
        "team": "ads",
        "workerpool-job": "bigquery-reverse_etl",
        "workerpool-job-id": job_id,
        "workerpool-attempt": "1",
        "workerpool-worker": job.labels["workerpool-worker"],
    }
    # the framework's store acked the copy; the fresh worker re-attached to the DONE job
    assert first_stats == {"done": 1, "duplicate": 1}


def test_invalid_query_ends_in_one_failure_record_with_bigquerys_reason(
    pubsub_resources: PubSubResources, bigquery_host: str, project: str
) -> None:
    # Given the real statement, which the emulator refuses (no Bigtable export there)
    pubsub_resources.provision()
    client = client_for(bigquery_host, project)
    with pubsub_resources.worker(
        registry(), job_config={JOB_NAME: plugin_config(project)}
    ) as worker:
        pubsub_resources.publish(JOB_NAME, PAYLOAD, job_id="bad-export")
        records = pubsub_resources.dead_letters(expected=1, timeout=30)
        time.sleep(1.0)  # (a retry would have run by now)
        stats = dict(worker.processor.stats)
    # Then one failure record carries BigQuery's reason and message, from the first delivery
    assert len(records) == 1, records
    attributes = records[0].attributes
    assert attributes[c.ATTR_ERROR_TYPE] == "bigquery.invalidQuery"
    assert "CLOUD_BIGTABLE" in attributes[c.ATTR_ERROR_MESSAGE]
    assert job_ids("bad-export")(1) in attributes[c.ATTR_ERROR_MESSAGE]
    assert attributes[c.ATTR_DELIVERY_ATTEMPT] == "1"
    assert stats == {"dead_lettered": 1}
    assert [job.job_id for job in our_jobs(client, "bad-export")] == [job_ids("bad-export")(1)]


class _Job:
    """A BigQuery job as the emulator reports it, except that attempt 1 of every job ends
    with rateLimitExceeded (the emulator cannot produce that error itself)."""

    def __init__(self, job: Any) -> None:
        self._job = job

    def __getattr__(self, name: str) -> Any:
        return getattr(self._job, name)

    @property
    def error_result(self) -> Any:
        if self._job.state == "DONE" and self._job.job_id.endswith("-a1"):
            return {"reason": "rateLimitExceeded", "message": "Exceeded rate limits (simulated)"}
        return self._job.error_result


class _RateLimitedFirstAttempts:
    def __init__(self, client: bigquery.Client) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def query(self, *args: Any, **kwargs: Any) -> _Job:
        return _Job(self._client.query(*args, **kwargs))

    def get_job(self, *args: Any, **kwargs: Any) -> _Job:
        return _Job(self._client.get_job(*args, **kwargs))


def test_rate_limit_exceeded_is_retried_as_a_new_attempt(
    pubsub_resources: PubSubResources,
    bigquery_host: str,
    project: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given BigQuery answering the first attempt of a job with rateLimitExceeded (simulated on
    # top of the emulator's real jobs: see _Job)
    pubsub_resources.provision()
    monkeypatch.setattr(plugin, "query_builder", nap_query(0.5))
    monkeypatch.setattr(
        plugin, "client_factory", lambda p, loc: _RateLimitedFirstAttempts(make_client(p, loc))
    )
    client = client_for(bigquery_host, project)
    with pubsub_resources.worker(
        registry(), job_config={JOB_NAME: plugin_config(project)}
    ) as worker:
        pubsub_resources.publish(JOB_NAME, PAYLOAD, job_id="busy-day")
        assert wait_for(lambda: worker.processor.stats["done"] == 1, timeout=60)
        stats = dict(worker.processor.stats)
    # Then the message was retried once, and the retry ran attempt 2 under its own id
    assert stats == {"retried": 1, "done": 1}
    jobs = {job.job_id: job for job in our_jobs(client, "busy-day")}
    assert sorted(jobs) == [job_ids("busy-day")(1), job_ids("busy-day")(2)]
    assert all(job.state == "DONE" for job in jobs.values())


def test_the_jobs_own_timeout_cancels_the_bigquery_job_and_retries(
    pubsub_resources: PubSubResources,
    bigquery_host: str,
    project: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a 2 s job timeout, exports that would take 4 s, and one BigQuery attempt allowed
    pubsub_resources.provision()
    monkeypatch.setattr(plugin, "query_builder", nap_query(4.0))
    client = client_for(bigquery_host, project)
    config = {JOB_NAME: plugin_config(project, max_export_attempts=1)}
    with pubsub_resources.worker(registry(timeout=2.0), job_config=config):
        pubsub_resources.publish(JOB_NAME, PAYLOAD, job_id="too-slow")
        records = pubsub_resources.dead_letters(expected=1, timeout=60)
    # Then the BigQuery job was cancelled at the timeout, the message retried, and the retry,
    # finding the cancelled attempt was the last allowed, recorded the failure
    job = client.get_job(job_ids("too-slow")(1))
    assert job.state == "DONE" and job.error_result["reason"] == "stopped"
    assert len(records) == 1
    assert records[0].attributes[c.ATTR_ERROR_TYPE] == "bigquery.stopped"
    assert int(records[0].attributes[c.ATTR_DELIVERY_ATTEMPT]) >= 2
    assert [j.job_id for j in our_jobs(client, "too-slow")] == [job_ids("too-slow")(1)]


def test_the_cap_keeps_at_most_two_exports_running_with_six_messages_and_six_slots(
    pubsub_resources: PubSubResources,
    bigquery_host: str,
    project: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given 6 pool slots, 6 messages, exports of 3 s, and the cap at 2
    pubsub_resources.provision(max_delivery_attempts=50)
    monkeypatch.setattr(plugin, "query_builder", nap_query(3.0))
    client = client_for(bigquery_host, project)
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.1):
            samples.append(running_exports(client))

    sampler = threading.Thread(target=sample, daemon=True)
    config = {JOB_NAME: plugin_config(project, max_concurrent_exports=2)}
    started = time.monotonic()
    with pubsub_resources.worker(registry(), max_outstanding=6, job_config=config) as worker:
        sampler.start()
        pubsub_resources.publish_many(JOB_NAME, [(f"segment-{i}", PAYLOAD) for i in range(6)])
        assert wait_for(lambda: worker.processor.stats["done"] == 6, timeout=90)
        stats = dict(worker.processor.stats)
    elapsed = time.monotonic() - started
    stop.set()
    sampler.join(5)
    # Then never more than 2 ran at once (sampled every 0.1 s from jobs.list), 2 often did,
    # and all 6 ran exactly once
    peak = max(samples)
    print(
        f"\ncap 2: peak {peak} running over {len(samples)} samples; {stats.get('deferred', 0)} "
        f"deferrals; 6 exports of 3 s took {elapsed:.1f}s"
    )
    assert peak == 2, samples
    assert sum(1 for s in samples if s == 2) >= 10
    jobs = our_jobs(client)
    assert sorted(job.labels[LABEL_JOB_ID] for job in jobs) == [f"segment-{i}" for i in range(6)]
    assert stats["done"] == 6 and stats.get("dead_lettered", 0) == 0


def _bigquery_worker(
    pubsub_resources: PubSubResources,
    tmp_path: Path,
    host: str,
    project: str,
    nap: float,
    max_outstanding: int = 2,
    list_lag: float = 0.0,
) -> WorkerProcess:
    """A real ``workerpool run`` process with the plugin, its config, and exports that nap;
    the workers of one test share an SQLite store (claims and slots) beside the ledger."""
    config = tmp_path / "workerpool.toml"
    settings = plugin_config(project)
    config.write_text(
        f'[jobs."{JOB_NAME}"]\n' + "".join(f"{k} = {v!r}\n" for k, v in settings.items())
    )
    return spawn_worker(
        pubsub_resources,
        tmp_path / "ledger.jsonl",
        "--jobs", "tests.bigquery_fixture",
        "--config", str(config),
        "--max-outstanding", str(max_outstanding),
        "--drain-timeout", "10",
        extra_env={EMULATOR_ENV: host, NAP_ENV: str(nap), LIST_LAG_ENV: str(list_lag)},
    )  # fmt: skip


def test_two_replicas_never_run_more_exports_than_the_cap_between_them(
    pubsub_resources: PubSubResources, bigquery_host: str, project: str, tmp_path: Path
) -> None:
    # Given two worker processes with 3 slots each, exports of 2 s, the cap at 2, and a
    # count of running exports as stale as jobs.list's in production (0.5 s: by that count
    # alone, replicas that count at once both start one, 3 or 4 running)
    pubsub_resources.provision(ack_deadline=60, min_backoff=1)
    client = client_for(bigquery_host, project)
    samples: list[int] = []
    with worker_processes() as workers:
        for _ in range(2):
            workers.append(
                _bigquery_worker(
                    pubsub_resources, tmp_path, bigquery_host, project, nap=2.0,
                    max_outstanding=3, list_lag=0.5,
                )
            )  # fmt: skip
        assert wait_for(lambda: all(w.ready() for w in workers), timeout=60)
        # When 8 exports are published at once
        pubsub_resources.publish_many(JOB_NAME, [(f"segment-{i}", PAYLOAD) for i in range(8)])

        def finished() -> int:
            return sum(len(re.findall(r"BigQuery job \S+ done", w.output())) for w in workers)

        deadline = time.monotonic() + 120
        while finished() < 8 and time.monotonic() < deadline:
            samples.append(running_exports(client))
            time.sleep(0.1)
        time.sleep(1.0)  # let the last acks go out, then drain
        for worker in workers:
            worker.signal(signal.SIGTERM)
        codes = [worker.wait(30) for worker in workers]
    started = [w.output().count("started BigQuery job") for w in workers]
    print(f"\ncap 2 over two replicas: peak {max(samples)} running over {len(samples)} "
          f"samples; exports started per replica {started}")  # fmt: skip
    # Then never more than 2 ran at once across both (sampled from jobs.list), 2 often did,
    # both replicas started exports, and each of the 8 ran exactly once
    assert max(samples) == 2, samples
    assert sum(1 for s in samples if s == 2) >= 20
    assert all(started) and sum(started) == 8
    assert sorted(j.labels[LABEL_JOB_ID] for j in our_jobs(client)) == sorted(
        f"segment-{i}" for i in range(8)
    )
    assert codes == [0, 0]


def test_sigterm_leaves_the_bigquery_job_running_and_the_next_worker_reattaches(
    pubsub_resources: PubSubResources, bigquery_host: str, project: str, tmp_path: Path
) -> None:
    # Given a worker process running an export that takes 8 s
    pubsub_resources.provision(ack_deadline=60, min_backoff=1)
    client, job_id = client_for(bigquery_host, project), "segments-sigterm"
    bq_job_id = job_ids(job_id)(1)
    with worker_processes() as workers:
        first = _bigquery_worker(pubsub_resources, tmp_path, bigquery_host, project, nap=8.0)
        workers.append(first)
        pubsub_resources.publish(JOB_NAME, PAYLOAD, job_id=job_id)

        def state() -> str | None:
            jobs = [job for job in client.list_jobs() if job.job_id == bq_job_id]
            return jobs[0].state if jobs else None

        assert wait_for(
            lambda: state() == "RUNNING" and "started BigQuery job" in first.output(),
            timeout=30,
            interval=0.2,
        ), first.output()

        # When it gets SIGTERM while the BigQuery job runs
        sent = first.signal(signal.SIGTERM)
        code = first.wait(30)
        exit_after = time.monotonic() - sent
        # Then it exits 0 at once, leaving the BigQuery job running, and its slot held
        assert code == 0, first.output()
        assert exit_after < 5.0, first.output()
        assert state() == "RUNNING"
        assert "left running" in first.output()
        slots = SqliteSlots(tmp_path / "claims.db")
        left = slots.table(SLOT_KEY).holders
        assert list(left) == [f"{JOB_ID_PREFIX}-{job_id}"]

        # When a second worker starts, it re-attaches and acks when the job is DONE
        launched = time.monotonic()
        second = _bigquery_worker(pubsub_resources, tmp_path, bigquery_host, project, nap=8.0)
        workers.append(second)
        assert wait_for(lambda: "attached to BigQuery job" in second.output(), timeout=30)
        attached_after = time.monotonic() - launched
        # ... holding the same slot (its token), not a second one
        assert {h: s.token for h, s in slots.table(SLOT_KEY).holders.items()} == {
            holder: held.token for holder, held in left.items()
        }
        assert wait_for(lambda: f"BigQuery job {bq_job_id} done" in second.output(), timeout=30)
        done_at = time.monotonic()
        assert state() == "DONE"
        assert wait_for(lambda: not slots.table(SLOT_KEY).holders, timeout=5)  # released
        slots.close()
        time.sleep(1.0)  # let the ack go out, then drain
        second.signal(signal.SIGTERM)
        assert second.wait(30) == 0, second.output()
    print(
        f"\nfirst worker exited {exit_after:.2f}s after SIGTERM; the second attached "
        f"{attached_after:.2f}s after launch; job done {done_at - sent:.2f}s after the SIGTERM"
    )
    # And exactly one jobs.insert was accepted: one BigQuery job, started by the first worker
    assert [job.job_id for job in our_jobs(client, job_id)] == [bq_job_id]
    assert first.output().count("started BigQuery job") == 1
    assert "started BigQuery job" not in second.output()
    # And the message was acked: nothing comes back on the subscription
    response = pubsub_resources.subscriber.pull(
        request={"subscription": pubsub_resources.subscription_path, "max_messages": 10}, timeout=5
    )
    assert not response.received_messages
