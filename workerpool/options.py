"""The ``@job`` options beyond the core ones, each with the middleware that reads it.

``@job`` refuses an option nobody declared, so a typo is an import-time error rather than a
silently ignored setting. The table lives here, below both: middleware modules import the
registry (for ``JobSpec``), so the registry must not import them to learn their options. The
built-in options are declared below; any other middleware class declares its ``options`` as
it is defined (``Middleware.__init_subclass__``), so the worker imports the middleware it is
configured with before the job modules.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from workerpool.periodic.ticks import cron_expression
from workerpool.slots.keys import KeyTemplate

CONCURRENCY = "concurrency"
RATE_LIMIT = "rate_limit"
SCHEDULE = "schedule"
ORDERED_EXHAUSTED = "ordered_exhausted"
# What every job takes, read by the worker itself.
CORE = frozenset({"timeout", "max_attempts", "payload", "config"})


def _concurrency_key(job: str, key: Any) -> None:
    if not isinstance(key, str) or not key:
        raise TypeError(f"job {job!r}: concurrency must name a key, got {key!r}")
    KeyTemplate(key)  # a malformed template fails here, where it is written


def _ordered_exhausted(job: str, choice: Any) -> None:
    if choice not in ("record", "block"):
        raise ValueError(
            f"job {job!r}: ordered_exhausted must be 'record' or 'block', got {choice!r}"
        )


def _cron(job: str, text: Any) -> None:
    if not isinstance(text, str):
        raise TypeError(f"job {job!r}: schedule must be a cron expression, got {text!r}")
    try:
        cron_expression(text)
    except ValueError as exc:
        raise ValueError(f"job {job!r}: {exc}") from None


# Option -> the middleware that reads it (for messages) and a check of its value, if any.
_READERS: dict[str, str] = {
    CONCURRENCY: "workerpool.slots.middleware.Concurrency",
    RATE_LIMIT: "workerpool.worker.middleware.RateLimit",
    SCHEDULE: "workerpool.periodic.firing.Periodics",
    ORDERED_EXHAUSTED: "workerpool.ordering.middleware.KeyBlocks",
}
_CHECKS: dict[str, Callable[[str, Any], None]] = {
    CONCURRENCY: _concurrency_key,
    SCHEDULE: _cron,
    ORDERED_EXHAUSTED: _ordered_exhausted,
}
_LOCK = threading.Lock()


def declare(reader: str, options: Iterable[str]) -> None:
    """``reader`` (a middleware's dotted name) reads these ``@job`` options."""
    with _LOCK:
        for option in options:
            _READERS.setdefault(option, reader)


def declared() -> dict[str, str]:
    """Every option declared so far, with the middleware that declared it first."""
    with _LOCK:
        return dict(_READERS)


def check(job: str, options: Mapping[str, Any]) -> None:
    """``TypeError`` naming the first option of ``job`` that no middleware declared, or whose
    value its middleware refuses."""
    known = declared()
    unknown = sorted(set(options) - set(known))
    if unknown:
        names = ", ".join(sorted({*CORE, *known}))
        raise TypeError(
            f"job {job!r}: unknown option(s) {', '.join(unknown)} (known: {names}; a "
            "middleware's own options are known once its module is imported)"
        )
    for option, value in options.items():
        value_check = _CHECKS.get(option)
        if value_check is not None and value is not None:
            value_check(job, value)
