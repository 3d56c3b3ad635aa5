"""workerpool: run jobs from a Pub/Sub pull subscription as a bounded, well-behaved pool.

What a job needs (``job``, the contexts, the errors, ``publish``, ``publish_batch``) and what
a middleware needs (``Middleware``, the ``Run`` it wraps, the ``Settled`` it hears), and what
runs a worker from code (``Settings``, ``Launcher`` for one pool, ``Fleet`` for the pools of a
config); the test kit is ``workerpool.testing`` (``run_job``).
"""

# First, before the imports below take their second or more: a SIGTERM meanwhile must not
# kill the workerpool command (see workerpool/worker/signals.py; only that command holds).
from workerpool.worker import signals as _signals

_signals.hold_if_command()

import importlib
from typing import TYPE_CHECKING, Any

from workerpool.config import Settings, load_settings
from workerpool.context import AsyncJobContext, JobContext, RunContext
from workerpool.errors import ConfigError, Defer, PermanentError, RateLimitedError, RetryableError
from workerpool.publishing import JobMessage, publish_batch
from workerpool.publishing import publish_job as publish
from workerpool.registry import JobSpec, job, registry
from workerpool.worker.middleware import Middleware
from workerpool.worker.run import Run, Settled

if TYPE_CHECKING:
    from workerpool.assembly.fleet import Fleet
    from workerpool.assembly.launcher import Launcher
    from workerpool.control.cancel import cancel

__all__ = [
    "AsyncJobContext",
    "ConfigError",
    "Defer",
    "Fleet",
    "JobContext",
    "JobMessage",
    "JobSpec",
    "Launcher",
    "Middleware",
    "PermanentError",
    "RateLimitedError",
    "RetryableError",
    "Run",
    "RunContext",
    "Settings",
    "Settled",
    "cancel",
    "job",
    "load_settings",
    "publish",
    "publish_batch",
    "registry",
]

# Imported on first use: the launcher brings the whole worker (clients, stores, exporters),
# which made ``import workerpool`` take 1.1-1.3 s instead of 0.15-0.4 s (measured), a cost a
# process that only publishes jobs need not pay.
_LAZY = {
    "Fleet": "workerpool.assembly.fleet",
    "Launcher": "workerpool.assembly.launcher",
    "cancel": "workerpool.control.cancel",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'workerpool' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
