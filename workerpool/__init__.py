"""workerpool: run jobs from a Pub/Sub pull subscription as a bounded, well-behaved pool.

What a job needs (``job``, the contexts, the errors, ``publish``, ``publish_batch``) and what
a middleware needs (``Middleware``, the ``Run`` it wraps, the ``Settled`` it hears); the test
kit is ``workerpool.testing`` (``run_job``).
"""

# First, before the imports below take their second or more: a SIGTERM meanwhile must not
# kill the workerpool command (see workerpool/worker/signals.py; only that command holds).
from workerpool.worker import signals as _signals

_signals.hold_if_command()

from workerpool.context import AsyncJobContext, JobContext, RunContext
from workerpool.errors import ConfigError, Defer, PermanentError, RateLimitedError, RetryableError
from workerpool.publishing import JobMessage, publish_batch
from workerpool.publishing import publish_job as publish
from workerpool.registry import JobSpec, job, registry
from workerpool.worker.middleware import Middleware
from workerpool.worker.run import Run, Settled

__all__ = [
    "AsyncJobContext",
    "ConfigError",
    "Defer",
    "JobContext",
    "JobMessage",
    "JobSpec",
    "Middleware",
    "PermanentError",
    "RateLimitedError",
    "RetryableError",
    "Run",
    "RunContext",
    "Settled",
    "job",
    "publish",
    "publish_batch",
    "registry",
]
