"""Every external name in one place: message attributes, failure-record attributes, defaults."""

from typing import Final

# Message contract (publisher <-> worker).
ATTR_JOB: Final = "job"
ATTR_JOB_ID: Final = "job_id"
ATTR_TRACEPARENT: Final = "traceparent"
ATTR_TRACESTATE: Final = "tracestate"

# Failure record attributes added to the original attributes on the dead-letter topic.
ATTR_ERROR_TYPE: Final = "error_type"
ATTR_ERROR_MESSAGE: Final = "error_message"
ATTR_DELIVERY_ATTEMPT: Final = "delivery_attempt"
ATTR_SOURCE_SUBSCRIPTION: Final = "source_subscription"
ATTR_SOURCE_TOPIC: Final = "source_topic"
ATTR_WORKER: Final = "worker"
ATTR_FAILED_AT: Final = "failed_at"
FAILURE_ATTRIBUTES: Final = (
    ATTR_ERROR_TYPE,
    ATTR_ERROR_MESSAGE,
    ATTR_DELIVERY_ATTEMPT,
    ATTR_SOURCE_SUBSCRIPTION,
    ATTR_SOURCE_TOPIC,
    ATTR_WORKER,
    ATTR_FAILED_AT,
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

# Pub/Sub limits.
MAX_MESSAGE_BYTES: Final = 10 * 1024 * 1024
MAX_ATTRIBUTES: Final = 100
MAX_ATTRIBUTE_VALUE_BYTES: Final = 1024

# Defaults.
DEFAULT_MAX_ATTEMPTS: Final = 5
DEFAULT_TIMEOUT_SECONDS: Final = 3600.0
DEFAULT_PREFETCH: Final = 2
DEFAULT_DRAIN_TIMEOUT: Final = 25.0
ENTRY_POINT_GROUP: Final = "workerpool.jobs"
