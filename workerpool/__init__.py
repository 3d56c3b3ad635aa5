"""workerpool: run jobs from a Pub/Sub pull subscription as a bounded, well-behaved pool."""

from workerpool.context import JobContext
from workerpool.errors import ConfigError, PermanentError, RetryableError
from workerpool.registry import JobSpec, job, registry

__all__ = [
    "ConfigError",
    "JobContext",
    "JobSpec",
    "PermanentError",
    "RetryableError",
    "job",
    "registry",
]
