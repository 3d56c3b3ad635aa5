"""Every external name in one place: message attributes, failure-record attributes, defaults."""

from enum import StrEnum
from typing import Final

# Message contract (publisher <-> worker).
ATTR_JOB: Final = "job"
ATTR_JOB_ID: Final = "job_id"
ATTR_TRACEPARENT: Final = "traceparent"
ATTR_TRACESTATE: Final = "tracestate"
# RFC 3339 time in UTC before which the job must not start (a delayed job).
ATTR_NOT_BEFORE: Final = "not_before"
# In a delayed job's schedule entry only: the ordering key it is published again with.
ATTR_ORDERING_KEY: Final = "ordering_key"
# On a delayed job published again by the schedule once due: when, by the firer's clock
# (RFC 3339). Such a copy is never scheduled again, whatever the clock of the worker it meets.
ATTR_FIRED_AT: Final = "fired_at"
# On a copy published on a message's last delivery (``worker.renewal``): the id of the message
# it is a copy of (the first, across copies of copies), under which claims know them all; and
# the one subscription it was made for (the topic's other subscriptions get it too).
ATTR_COPY_OF: Final = "copy_of"
ATTR_COPY_FOR: Final = "copy_for"
# The batch a child job belongs to (``workerpool.publish_batch``).
ATTR_BATCH_ID: Final = "batch_id"
# On a batch's completion job: the W3C traceparent of the batch's publisher, which the
# completion's span links to (a fan-in has many causes: a link, not a parent).
ATTR_LINKED_TRACEPARENT: Final = "linked_traceparent"

# Failure record attributes added to the original attributes on the dead-letter topic.
ATTR_ERROR_TYPE: Final = "error_type"
ATTR_ERROR_MESSAGE: Final = "error_message"
ATTR_DELIVERY_ATTEMPT: Final = "delivery_attempt"
ATTR_SOURCE_SUBSCRIPTION: Final = "source_subscription"
ATTR_SOURCE_TOPIC: Final = "source_topic"
ATTR_WORKER: Final = "worker"
ATTR_FAILED_AT: Final = "failed_at"
# The length of the original data, on a record whose data was cut to fit a publish request.
ATTR_DATA_CUT: Final = "data_cut_from"
FAILURE_ATTRIBUTES: Final = (
    ATTR_ERROR_TYPE,
    ATTR_ERROR_MESSAGE,
    ATTR_DELIVERY_ATTEMPT,
    ATTR_SOURCE_SUBSCRIPTION,
    ATTR_SOURCE_TOPIC,
    ATTR_WORKER,
    ATTR_FAILED_AT,
    ATTR_DATA_CUT,
)

# error_type values for input that never reaches a handler.
ERR_NOT_JSON: Final = "not_json"
ERR_NOT_OBJECT: Final = "not_object"
ERR_MISSING_JOB: Final = "missing_job"
ERR_UNKNOWN_JOB: Final = "unknown_job"
ERR_INVALID_PAYLOAD: Final = "invalid_payload"
ERR_OVERSIZE: Final = "oversize"
ERR_PERMANENT: Final = "permanent_error"
ERR_ATTEMPTS_EXHAUSTED: Final = "attempts_exhausted"
# A handler returned a coroutine or generator instead of running its body.
ERR_HANDLER_RETURNED_AWAITABLE: Final = "handler_returned_awaitable"
# The job ran past its own ``timeout`` and ended by being cancelled (an async job's task).
ERR_TIMED_OUT: Final = "timed_out"
# A templated concurrency key rendered to a key no declared limit covers.
ERR_UNKNOWN_CONCURRENCY_KEY: Final = "unknown_concurrency_key"
# The not_before attribute is not an RFC 3339 time with a timezone, or is over a year ahead.
ERR_INVALID_NOT_BEFORE: Final = "invalid_not_before"

# Pub/Sub limits.
MAX_MESSAGE_BYTES: Final = 10 * 1024 * 1024
# The largest publish request google-cloud-pubsub sends (its _SERVER_PUBLISH_MAX_BYTES, the
# backend's limit); it refuses a bigger one with MessageTooLargeError before sending it.
MAX_PUBLISH_REQUEST_BYTES: Final = 10_000_000
MAX_ATTRIBUTES: Final = 100
MAX_ATTRIBUTE_VALUE_BYTES: Final = 1024
# The longest ack deadline, which also bounds a delay expressed as modify_ack_deadline.
MAX_ACK_DEADLINE_SECONDS: Final = 600

# Defaults of the worker's settings, used by Settings and by each part that has the setting.
DEFAULT_MAX_OUTSTANDING: Final = 10
DEFAULT_MAX_HELD_BYTES: Final = 100 * 1024 * 1024
DEFAULT_MAX_ATTEMPTS: Final = 5
DEFAULT_TIMEOUT_SECONDS: Final = 3600.0
# An async handler that holds the event loop this long (a blocking call in an ``async def``)
# is logged by name: asyncio debug mode's slow-callback figure is 0.1 s, but that mode costs
# every task; half a second is surely a blocking call, not a busy loop.
LOOP_BLOCKED_AFTER_SECONDS: Final = 0.5
# Messages held beyond N, unless set: N // 4, and never fewer than this. Enough to start runs
# while a pull refills the pool (at N = 64 with 50 ms jobs a wave of ends waited 10-12 ms for
# its pull, store and claims; BENCHMARKS.md), few enough that a pool of long jobs (small N)
# leaves the backlog to other replicas.
MIN_DEFAULT_PREFETCH: Final = 2
PREFETCH_SHARE_OF_N: Final = 4
# On an ordered subscription: the default prefetch per slot (``Settings.prefetch_for``).
ORDERED_PREFETCH_PER_SLOT: Final = 2
# On an ordered subscription one key holds at most this share of what a worker holds: half,
# so however deep one key's backlog, the other keys have room for the other half (with the
# default prefetch 1.5 N, enough to feed every other slot and keep a pull's worth waiting).
# A third made pulls smaller than the pool's usual batch: 0.70-0.90 of the slots busy with 20
# keys at N = 8, against 0.83-0.91 with half or no cap (measured).
ORDERED_KEY_SHARE_OF_HOLD: Final = 2
# On an ordered subscription a keyed message is given back by this short a lease, never by a
# nack: the emulator redelivers a key from its first lapsed message, in order, but a nacked one
# after the key's messages never delivered yet (measured). Pub/Sub does the former either way.
ORDERED_GIVE_BACK_SECONDS: Final = 1.0
DEFAULT_DRAIN_TIMEOUT: Final = 25.0
DEFAULT_LEASE_EXTENSION: Final = 30.0
DEFAULT_MIN_BACKOFF: Final = 2.0
DEFAULT_MAX_BACKOFF: Final = float(MAX_ACK_DEADLINE_SECONDS)
DEFAULT_CLAIM_TTL: Final = 60.0
# Concurrency slots: a holder killed outright frees its slot after the TTL; a run waits this
# long for a free slot, then defers its message.
DEFAULT_SLOT_TTL: Final = 60.0
DEFAULT_SLOT_WAIT: Final = 30.0
# How a key's slots are leased (its ``[concurrency]`` entry, ``"20/bulk"``): one lease per run,
# or shares leased to replicas and renewed once a SLOT_SHARE_PERIOD (seconds) by each.
LEASES_PER_RUN: Final = "per_run"
LEASES_BULK: Final = "bulk"
SLOT_SHARE_PERIOD: Final = 1.0
# A bulk key split into shards (``"200/bulk/25"``) has its shards' parts of the limit
# rebalanced this often (seconds), by one replica at a time.
SLOT_SHARD_REBALANCE: Final = 10.0
# Each replica writes its heartbeat (what it runs and holds, for the autoscaler) this often.
DEFAULT_HEARTBEAT_INTERVAL: Final = 2.0
ENTRY_POINT_GROUP: Final = "workerpool.jobs"
# Middleware a worker may name in its config (``middleware``): installed is not turned on.
MIDDLEWARE_ENTRY_POINT_GROUP: Final = "workerpool.middleware"


class Label(StrEnum):
    """How a message left the pool, as counted in ``Processor.stats`` and
    ``workerpool.jobs.finished``: every message that leaves gets exactly one."""

    DONE = "done"
    RETRIED = "retried"
    DEAD_LETTERED = "dead_lettered"
    DEFERRED = "deferred"
    DRAINED = "drained"
    DUPLICATE = "duplicate"
    ACK_FAILED = "ack_failed"
    # Given back before it started: beyond the bound, or held when the pool drained.
    RELEASED = "released"
    # Not due yet (not_before): kept in the schedule, to be published again when due.
    SCHEDULED = "scheduled"
    # Cancelled by job id (``workerpool cancel``): never started, or stopped while it ran.
    CANCELLED = "cancelled"


# Labels that mean this run failed (its span's status is ERROR, its end log line a warning).
FAILED_LABELS: Final = frozenset({Label.RETRIED, Label.DEAD_LETTERED, Label.ACK_FAILED})

# OpenTelemetry: instrument names (every one under the ``workerpool.`` prefix) and attributes.
INSTRUMENTATION_NAME: Final = "workerpool"
METRIC_JOBS_STARTED: Final = "workerpool.jobs.started"
METRIC_JOBS_FINISHED: Final = "workerpool.jobs.finished"
METRIC_JOB_DURATION: Final = "workerpool.job.duration"
METRIC_QUEUE_LATENCY: Final = "workerpool.job.queue_latency"
METRIC_IN_FLIGHT: Final = "workerpool.pool.in_flight"
METRIC_KEYS_BLOCKED: Final = "workerpool.ordering.keys_blocked"
METRIC_POOL_LIMIT: Final = "workerpool.pool.limit"
METRIC_HELD: Final = "workerpool.pool.held"
METRIC_LEASE_EXTENSIONS: Final = "workerpool.lease.extensions"
METRIC_RATE_LIMIT_WAIT: Final = "workerpool.rate_limit.wait"
METRIC_DRAIN_DURATION: Final = "workerpool.drain.duration"
METRIC_MESSAGES_RENEWED: Final = "workerpool.messages.renewed"
METRIC_PERIODIC_LATENESS: Final = "workerpool.periodic.lateness"
METRIC_PERIODIC_TICKS: Final = "workerpool.periodic.ticks"
LABEL_JOB: Final = "job"
LABEL_OUTCOME: Final = "outcome"
LABEL_POOL: Final = "pool"
LABEL_LIMITER: Final = "limiter"
LABEL_SCHEDULE: Final = "schedule"
# The job label of a message whose job is missing or not registered (bounds label values).
UNKNOWN_JOB_LABEL: Final = "(unknown)"
SPAN_MESSAGING_SYSTEM: Final = "messaging.system"
SPAN_MESSAGING_DESTINATION: Final = "messaging.destination.name"
SPAN_MESSAGING_OPERATION: Final = "messaging.operation.type"
SPAN_MESSAGING_MESSAGE_ID: Final = "messaging.message.id"
SPAN_DELIVERY_ATTEMPT: Final = "messaging.gcp_pubsub.message.delivery_attempt"
SPAN_JOB_ID: Final = "workerpool.job_id"
SPAN_OUTCOME: Final = "workerpool.outcome"
MESSAGING_SYSTEM: Final = "gcp_pubsub"

# Structured logs: job line fields and the Cloud Logging special keys.
LOG_JOB: Final = "job"
LOG_JOB_ID: Final = "job_id"
LOG_MESSAGE_ID: Final = "message_id"
LOG_ATTEMPT: Final = "attempt"
LOG_DURATION: Final = "duration"
LOG_OUTCOME: Final = "outcome"
LOG_ERROR_TYPE: Final = "error_type"
LOG_RENEWED: Final = "renewed"
LOG_TRACE: Final = "logging.googleapis.com/trace"
LOG_SPAN_ID: Final = "logging.googleapis.com/spanId"
LOG_TRACE_SAMPLED: Final = "logging.googleapis.com/trace_sampled"
LOG_SOURCE_LOCATION: Final = "logging.googleapis.com/sourceLocation"

# Health endpoint paths (``--metrics-port``).
PATH_METRICS: Final = "/metrics"
PATH_HEALTHZ: Final = "/healthz"
PATH_READYZ: Final = "/readyz"

# Attributes Pub/Sub itself adds when its dead-letter policy forwards a message.
ATTR_PUBSUB_DEAD_LETTER_PREFIX: Final = "CloudPubSubDeadLetter"
ATTR_PUBSUB_DELIVERY_COUNT: Final = "CloudPubSubDeadLetterSourceDeliveryCount"
ATTR_PUBSUB_SOURCE_SUBSCRIPTION: Final = "CloudPubSubDeadLetterSourceSubscription"
ATTR_PUBSUB_SOURCE_PROJECT: Final = "CloudPubSubDeadLetterSourceSubscriptionProject"
# error_type shown for such a message: the subscription's max delivery attempts ran out.
ERR_DELIVERY_LIMIT: Final = "max_delivery_attempts"

# Autoscaling: names that Kubernetes and KEDA read.
# The annotation a ReplicaSet reads to choose which pods a scale-in removes (lowest first).
ANNOTATION_POD_DELETION_COST: Final = "controller.kubernetes.io/pod-deletion-cost"
# The one metric the KEDA external scaler serves: the replicas the fleet should have (KEDA
# prefixes it with the trigger's index, "s0-", and strips that again before asking).
KEDA_METRIC: Final = "workerpool-replicas"
