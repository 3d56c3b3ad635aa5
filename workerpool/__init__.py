"""workerpool: run jobs from a Pub/Sub pull subscription as a bounded, well-behaved pool."""

from workerpool.context import AsyncJobContext, JobContext
from workerpool.errors import ConfigError, Defer, PermanentError, RetryableError
from workerpool.publishing import publish_job as publish
from workerpool.registry import JobSpec, job, registry

__all__ = [
    "AsyncJobContext",
    "ConfigError",
    "Defer",
    "JobContext",
    "JobSpec",
    "PermanentError",
    "RetryableError",
    "job",
    "publish",
    "registry",
]
