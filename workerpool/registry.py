"""Job registration and discovery.

``@job(name, ...)`` registers ``handler(ctx, payload)``. Options no middleware declared
(``workerpool.options``) are rejected at registration, so a typo is an import-time error
instead of a silently ignored setting.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

from workerpool import options as job_options
from workerpool.constants import DEFAULT_MAX_ATTEMPTS, DEFAULT_TIMEOUT_SECONDS, ENTRY_POINT_GROUP
from workerpool.errors import ConfigError
from workerpool.payload import PayloadError, convert

log = logging.getLogger(__name__)

Handler = Callable[..., Any]


@dataclass(frozen=True)
class JobSpec:
    name: str
    handler: Handler
    timeout: float = DEFAULT_TIMEOUT_SECONDS
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    payload: type[Any] | None = None
    options: dict[str, Any] = field(default_factory=dict)
    # An ``async def`` handler: it runs as a task on the pool's event loop.
    is_async: bool = False
    # The dataclass its ``[jobs."NAME"]`` section is converted to when the worker starts.
    config: type[Any] | None = None


class Registry:
    """The jobs a worker can run, by name. Thread-safe; re-registering a name is an error."""

    def __init__(self) -> None:
        self._jobs: dict[str, JobSpec] = {}
        self._lock = threading.Lock()

    def add(self, spec: JobSpec) -> None:
        with self._lock:
            existing = self._jobs.get(spec.name)
            if existing is not None and existing.handler is not spec.handler:
                raise ValueError(f"job {spec.name!r} is already registered by {existing.handler}")
            self._jobs[spec.name] = spec

    def get(self, name: str) -> JobSpec | None:
        return self._jobs.get(name)

    def names(self) -> list[str]:
        return sorted(self._jobs)

    def specs(self) -> list[JobSpec]:
        return [self._jobs[name] for name in self.names()]

    def configs(self, sections: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
        """Each job's ``[jobs."NAME"]`` section, converted to its ``config`` dataclass (a job
        without one gets its section as it is); ``ConfigError`` naming the first setting that
        is unknown or of the wrong type, or a section that names no job, so a typo stops the
        worker at start instead of failing every message."""
        unknown = sorted(set(sections) - set(self._jobs))
        if unknown:
            raise ConfigError(f'[jobs."{unknown[0]}"]: no job of that name is registered')
        configs: dict[str, Any] = {}
        for spec in self.specs():
            section = sections.get(spec.name, {})
            if spec.config is None:
                configs[spec.name] = section
                continue
            try:
                configs[spec.name] = convert(spec.config, dict(section))
            except PayloadError as exc:
                setting = exc.path or "the section"
                problem = str(exc).removeprefix(f"{exc.path or 'payload'}: ")
                raise ConfigError(f'[jobs."{spec.name}"] {setting}: {problem}') from None
        return configs

    def job(
        self,
        name: str,
        *,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        payload: type[Any] | None = None,
        config: type[Any] | None = None,
        **options: Any,
    ) -> Callable[[Handler], Handler]:
        """Register ``handler(ctx, payload)`` as the job ``name``.

        ``timeout`` (seconds) bounds one run and its lease; ``max_attempts`` counts deliveries
        before the failure is recorded on the dead-letter topic; ``payload`` is an optional
        dataclass the JSON object is converted to (a mismatch is a permanent error);
        ``config`` an optional dataclass the job's ``[jobs."NAME"]`` section is converted to
        once, when the worker starts (a mismatch stops it), and handed over as ``ctx.config``.
        """
        job_options.check(name, options)
        if not name:
            raise ValueError("a job needs a non-empty name")
        if timeout <= 0:
            raise ValueError(f"job {name!r}: timeout must be positive, got {timeout}")
        if max_attempts < 1:
            raise ValueError(f"job {name!r}: max_attempts must be at least 1, got {max_attempts}")
        for option, value in (("payload", payload), ("config", config)):
            if value is not None and not dataclasses.is_dataclass(value):
                raise TypeError(f"job {name!r}: {option} must be a dataclass, got {value!r}")

        def register(handler: Handler) -> Handler:
            is_async = _check_handler(name, handler)
            self.add(
                JobSpec(
                    name, handler, float(timeout), max_attempts, payload, dict(options),
                    is_async=is_async, config=config,
                )
            )  # fmt: skip
            return handler

        return register


def _check_handler(name: str, handler: Handler) -> bool:
    """True for an ``async def`` handler (or an object whose ``__call__`` is one). A handler
    whose call only builds a generator would be acked as done without its body ever running:
    refuse it here, where the mistake is made."""
    if not callable(handler):
        raise TypeError(f"job {name!r}: the handler must be callable, got {handler!r}")
    call = getattr(handler, "__call__", None)  # noqa: B004 - an object's async __call__
    for target in (handler, call):
        if inspect.isgeneratorfunction(target) or inspect.isasyncgenfunction(target):
            raise TypeError(
                f"job {name!r}: {_name_of(handler)} is a generator function (it yields), so "
                "calling it would not run its body; return instead of yielding"
            )
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(call)


def _name_of(handler: Handler) -> str:
    return getattr(handler, "__qualname__", None) or repr(handler)


# The process-wide registry that ``@workerpool.job`` and plugins register into.
registry = Registry()
job = registry.job


def load_entry_points() -> list[str]:
    """Import every module advertised under the ``workerpool.jobs`` entry-point group."""
    loaded = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except Exception as exc:  # a broken third-party plugin must not hide the others
            log.warning("job plugin %s (%s) failed to load: %s", ep.name, ep.value, exc)
            continue
        loaded.append(ep.value)
    return loaded


def import_job_modules(modules: Iterable[str]) -> None:
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(f"--jobs {module}: cannot import it ({exc})") from exc
        except (TypeError, ValueError) as exc:  # what @job raises for a bad registration
            raise ConfigError(f"--jobs {module}: {exc}") from exc
