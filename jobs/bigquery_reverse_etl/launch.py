"""Launching a BigQuery job once per workerpool job id, the global cap, waiting, errors.

- The BigQuery job id is derived from the workerpool job id (``job_ids``), plus an attempt
  number: a job that ended with a retryable error cannot run again under its id, so the next
  attempt gets the next number. ``attach_or_launch`` walks the attempts from 1 and attaches to
  the first that is still running or ended for good, inserting only where none exists yet: a
  redelivered or duplicated message finds the job its twin started, never starts a second one.
- An export runs inside a slot of the fleet-wide key ``slot_key`` (``max_concurrent_exports``
  slots, shared by every replica through the store), named after the job id: the worker that
  re-attaches after a redelivery holds the same slot, and one that drains leaves it held for
  it. Before an insert it still counts this plugin's RUNNING and PENDING jobs (by label) and
  defers the message when they are at the cap: exports started outside workerpool, or left
  running longer than a slot's TTL with nobody attached, so count too.
- ``wait`` polls with a growing interval; on drain it leaves the BigQuery job running (the next
  worker re-attaches); at the job's own timeout it cancels it.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import random
import re
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, cast

import requests
from google.api_core import exceptions as gexc
from google.api_core.client_options import ClientOptions
from google.auth import exceptions as auth_exceptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import bigquery
from google.cloud.bigquery.retry import DEFAULT_RETRY

from workerpool import Defer, JobContext, PermanentError, RetryableError

from .payload import JOB_NAME, PluginConfig
from .statement import Query

log = logging.getLogger(__name__)

EMULATOR_ENV = "BIGQUERY_EMULATOR_HOST"
# Labels on every job the plugin starts. LABEL_JOB is what the global cap counts by.
LABEL_JOB = "workerpool-job"
LABEL_JOB_ID = "workerpool-job-id"
LABEL_ATTEMPT = "workerpool-attempt"
LABEL_WORKER = "workerpool-worker"
JOB_ID_PREFIX = "workerpool-retl"
API_TIMEOUT = 30.0  # seconds for one API call (the client retries transient failures within)
API_RETRY = DEFAULT_RETRY.with_deadline(60.0)

# errorResult reasons: https://cloud.google.com/bigquery/docs/error-messages
RETRYABLE_REASONS = frozenset(
    {
        "rateLimitExceeded", "backendError", "internalError", "jobBackendError",
        "jobInternalError", "jobRateLimitExceeded", "stopped", "timeout", "tableUnavailable",
    }
)  # fmt: skip


# --- Names --------------------------------------------------------------------------------------
def short_hash(text: str, length: int = 12) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def job_ids(job_id: str) -> Callable[[int], str]:
    """``attempt -> BigQuery job id`` for one workerpool job id: [A-Za-z0-9_-] only, well
    within BigQuery's 1024 characters, and distinct for distinct job ids (the hash)."""
    slug = re.sub(r"[^A-Za-z0-9_-]", "_", job_id)[:200]
    base = f"{JOB_ID_PREFIX}-{slug}-{short_hash(job_id)}"
    return lambda attempt: f"{base}-a{attempt}"


def label_value(text: str) -> str:
    """A label value (<= 63 of [a-z0-9_-]); one that had to change gets a hash suffix."""
    value = re.sub(r"[^a-z0-9_-]", "_", text.lower())
    if value == text and len(value) <= 63:
        return value
    return f"{value[:50]}-{short_hash(text)}"


JOB_LABEL_VALUE = label_value(JOB_NAME.replace(".", "-"))  # "bigquery-reverse_etl"


def job_labels(ctx: JobContext, extra: Mapping[str, str], attempt: int) -> dict[str, str]:
    return {
        **extra,
        LABEL_JOB: JOB_LABEL_VALUE,
        LABEL_JOB_ID: label_value(ctx.job_id),
        LABEL_ATTEMPT: str(attempt),
        LABEL_WORKER: label_value(os.uname().nodename),
    }


# --- The client ---------------------------------------------------------------------------------
_clients: dict[tuple[str | None, str | None, str], bigquery.Client] = {}
_clients_lock = threading.Lock()
# Held while counting running exports and inserting one, by every slot of this process.
_launch_lock = threading.Lock()


def make_client(project: str | None, location: str) -> bigquery.Client:
    """One client per (project, location), shared by the pool's threads. Honours
    ``BIGQUERY_EMULATOR_HOST`` (``http://host:port``) as Google's libraries honour theirs."""
    host = os.environ.get(EMULATOR_ENV) or None
    key = (host, project, location)
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            if host is not None:
                endpoint = host if "://" in host else f"http://{host}"
                client = bigquery.Client(
                    project=project,
                    location=location,
                    credentials=AnonymousCredentials(),  # type: ignore[no-untyped-call]
                    client_options=ClientOptions(api_endpoint=endpoint),
                )
            else:
                client = bigquery.Client(project=project, location=location)
            _clients[key] = client
        return client


# --- Errors -------------------------------------------------------------------------------------
def is_retryable(reason: str, message: str) -> bool:
    if reason in RETRYABLE_REASONS:
        return True
    if reason == "quotaExceeded":  # concurrent-job quotas pass; a daily quota does not soon
        return "concurrent" in message.lower()
    # invalidQuery, notFound, accessDenied, invalid, duplicate, billingNotEnabled, ...
    return False


def failure(error: Mapping[str, Any], job_id: str, *, last: bool = True) -> Exception:
    """The error for a job whose ``errorResult`` is ``error``. A retryable one on its ``last``
    allowed attempt is permanent."""
    reason, message = str(error.get("reason", "unknown")), str(error.get("message", ""))
    text = f"{reason}: {message} (BigQuery job {job_id})"
    if is_retryable(reason, message) and not last:
        return RetryableError(text)
    return PermanentError(text, error_type=f"bigquery.{reason}")


def api_failure(exc: Exception, what: str) -> Exception:
    """Map an exception from an API call to RetryableError / PermanentError."""
    if isinstance(exc, gexc.GoogleAPICallError):
        errors = getattr(exc, "errors", None) or [{}]
        reason = str(errors[0].get("reason", "")) if isinstance(errors[0], dict) else ""
        code = int(exc.code or 0)
        text = f"{what}: {exc.message}"
        if code == 429 or code >= 500 or is_retryable(reason, str(exc.message)):
            return RetryableError(text)
        return PermanentError(text, error_type=f"bigquery.{reason or code}")
    if isinstance(exc, auth_exceptions.DefaultCredentialsError):
        return RetryableError(f"{what}: no credentials: {exc}")
    return RetryableError(f"{what}: {type(exc).__name__}: {exc}")


# What API calls raise that ``api_failure`` maps to RetryableError / PermanentError. Anything
# else propagates (the framework retries it as an unexpected exception, traceback logged).
API_ERRORS = (
    gexc.GoogleAPICallError,
    gexc.RetryError,
    requests.exceptions.ConnectionError,
    requests.exceptions.Timeout,
    auth_exceptions.TransportError,
    auth_exceptions.DefaultCredentialsError,
    ConnectionError,
    TimeoutError,
)


@functools.cache
def _uncapped_by_slots(key: str) -> None:
    log.warning(
        "no concurrency slots for %s (the idempotency store cannot share them): exports are "
        "capped by counting jobs.list alone, which replicas can race",
        key,
    )


# --- One export ---------------------------------------------------------------------------------
@dataclass
class Export:
    """One message's export: find or start its BigQuery job, then wait for it."""

    client: bigquery.Client
    config: PluginConfig
    ctx: JobContext
    query: Query
    location: str
    labels: Mapping[str, str]
    timeout: float

    def __post_init__(self) -> None:
        self.job_id = job_ids(self.ctx.job_id)

    def run(self) -> None:
        with ExitStack() as stack:
            self.hold_slot(stack)
            job, attempt = self.attach_or_launch()
            self.wait(job, attempt)

    def hold_slot(self, stack: ExitStack) -> None:
        """A slot of the export key for as long as the export runs (waiting for one, or
        ``Defer``), named after the job id, so every delivery of it holds the same one."""
        key = self.config.slot_key
        try:
            stack.enter_context(self.ctx.slot(key, holder=f"{JOB_ID_PREFIX}-{self.ctx.job_id}"))
        except LookupError:  # this worker's store cannot share slots (none)
            _uncapped_by_slots(key)

    def get(self, job_id: str) -> bigquery.QueryJob | None:
        try:
            job = self.client.get_job(
                job_id, location=self.location, retry=API_RETRY, timeout=API_TIMEOUT
            )
        except gexc.NotFound:
            return None
        except API_ERRORS as exc:
            raise api_failure(exc, f"get BigQuery job {job_id}") from exc
        if job.job_type != "query":  # not one of ours, though it has our id
            raise PermanentError(
                f"BigQuery job {job_id} is not a query job", error_type="bigquery.conflict"
            )
        return cast(bigquery.QueryJob, job)

    def attach_or_launch(self) -> tuple[bigquery.QueryJob, int]:
        attempt = 1
        while True:
            job_id = self.job_id(attempt)
            job = self.get(job_id)
            if job is None:
                return self.insert(job_id, attempt), attempt
            error = job.error_result if job.state == "DONE" else None
            last = attempt >= self.config.max_export_attempts
            if error is None or not is_retryable(error.get("reason", ""), error.get("message", "")):
                self.ctx.logger.info("attached to BigQuery job %s (%s)", job_id, job.state)
                return job, attempt
            if last:
                raise failure(error, job_id, last=True)
            attempt += 1  # that attempt is over for good: the next one has its own id

    def running_exports(self) -> int:
        """This plugin's PENDING and RUNNING jobs in the project, counted by label. PENDING is
        listed first: a job that starts between the two calls is counted (once), not missed."""
        ours: set[str] = set()
        for state in ("pending", "running"):
            try:
                jobs = self.client.list_jobs(
                    state_filter=state, retry=API_RETRY, timeout=API_TIMEOUT
                )
                ours.update(j.job_id for j in jobs if j.labels.get(LABEL_JOB) == JOB_LABEL_VALUE)
            except API_ERRORS as exc:
                raise api_failure(exc, "list BigQuery jobs") from exc
        return len(ours)

    def insert(self, job_id: str, attempt: int) -> bigquery.QueryJob:
        """Start attempt ``attempt`` unless the exports running already reach the cap (then
        ``Defer``): the slot bounds ours; this count catches the others (see the module).

        Within this process, counting and inserting are one step (``_launch_lock``); without
        slots, replicas can race on the count: see docs/guide/bigquery-reverse-etl.md."""
        cap = self.config.max_concurrent_exports
        with _launch_lock:
            if self.ctx.draining.is_set() or self.ctx.cancelled.is_set():
                raise Defer("worker is stopping: not starting an export now", delay=0)
            running = self.running_exports()
            if running >= cap:
                # Jitter, so that messages deferred together do not all come back together.
                delay = self.config.defer_seconds * random.uniform(0.75, 1.25)
                raise Defer(f"{running} exports running, at the cap of {cap}", delay=delay)
            job, inserted = self.submit(job_id, attempt)
        if inserted:
            self.ctx.logger.info("started BigQuery job %s (%d of %d)", job_id, running + 1, cap)
        return job

    def submit(self, job_id: str, attempt: int) -> tuple[bigquery.QueryJob, bool]:
        """Insert the job; ``(job, False)`` when it already existed."""
        job_config = bigquery.QueryJobConfig(labels=job_labels(self.ctx, self.labels, attempt))
        if self.query.table_definitions:
            job_config.table_definitions = self.query.table_definitions
        try:
            # job_retry=None, deliberately: job_retry re-runs a *failed query job*, which can
            # only work under a new id, and the client cannot do that with a fixed job_id (it
            # warns now, and will refuse). Our attempts are that retry, each with its own
            # derived id. ``retry`` still covers the insert request itself: if a first try
            # reached BigQuery and only its answer was lost, the retry gets 409 Already Exists.
            job = self.client.query(
                self.query.sql,
                job_config=job_config,
                job_id=job_id,
                location=self.location,
                retry=API_RETRY,
                timeout=API_TIMEOUT,
                job_retry=None,
            )
        except gexc.Conflict:
            # Another delivery of this job id (or our own lost answer) inserted it first.
            existing = self.get(job_id)
            if existing is None:
                raise RetryableError(f"BigQuery job {job_id} exists but cannot be read") from None
            self.ctx.logger.info("BigQuery job %s already exists: attached to it", job_id)
            return existing, False
        except API_ERRORS as exc:
            raise api_failure(exc, f"insert BigQuery job {job_id}") from exc
        return job, True

    def pause(self, seconds: float) -> None:
        """Sleep, waking at once when the worker drains or the run is cancelled."""
        deadline = time.monotonic() + seconds
        while not (self.ctx.draining.is_set() or self.ctx.cancelled.is_set()):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self.ctx.cancelled.wait(min(left, 0.25))

    def wait(self, job: bigquery.QueryJob, attempt: int) -> None:
        delay = self.config.poll_min_seconds
        while job.state != "DONE":
            self.check_interrupted(job)
            self.pause(delay)
            self.check_interrupted(job)
            delay = min(delay * 1.5, self.config.poll_max_seconds)
            try:
                job.reload(retry=API_RETRY, timeout=API_TIMEOUT)
            except API_ERRORS as exc:
                raise api_failure(exc, f"poll BigQuery job {job.job_id}") from exc
        if job.error_result:
            last = attempt >= self.config.max_export_attempts
            raise failure(job.error_result, job.job_id, last=last)
        self.ctx.logger.info("BigQuery job %s done", job.job_id)

    def check_interrupted(self, job: bigquery.QueryJob) -> None:
        if self.ctx.draining.is_set():
            # Not a failure and not our job to stop: hand the message back now; whichever
            # worker gets it next re-attaches to this BigQuery job.
            reason = f"worker draining: BigQuery job {job.job_id} left running"
            self.ctx.logger.info("%s; handing the message back", reason)
            raise Defer(reason, delay=0)
        if not self.ctx.cancelled.is_set():
            return
        if not self.ctx.timed_out.is_set():
            # Cancelled early, not by our timeout (our claim was taken over): whoever holds
            # the job id now is attached to this BigQuery job; leave it alone.
            raise RetryableError(f"run cancelled; BigQuery job {job.job_id} left running")
        try:
            self.client.cancel_job(
                job.job_id, location=self.location, retry=API_RETRY, timeout=API_TIMEOUT
            )
        except API_ERRORS as exc:
            log.warning("cancelling BigQuery job %s failed: %s", job.job_id, exc)
        raise RetryableError(
            f"timed out after {self.timeout:g}s: cancelled BigQuery job {job.job_id}"
        )
