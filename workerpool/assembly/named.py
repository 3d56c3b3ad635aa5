"""The user's middleware, named in the config: ``middleware`` in ``[worker]`` (or a pool),
``WORKERPOOL_MIDDLEWARE`` (comma separated), ``--middleware`` (repeatable).

A name is an entry point of the ``workerpool.middleware`` group, or a ``module:Name`` path.
Only what is named runs: installing a distribution that advertises a middleware does not turn
it on, since it would then wrap every job of every worker in that environment unasked (a test
tool's, a dependency's). A name points at a ``Middleware`` subclass, made with no arguments,
or at a factory, called with the pool's ``Settings``, that returns one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from workerpool.config import Settings
from workerpool.constants import MIDDLEWARE_ENTRY_POINT_GROUP
from workerpool.errors import ConfigError
from workerpool.worker.middleware import Middleware


def find(name: str) -> Any:
    """What ``name`` points at, its module imported (so the ``@job`` options it declares are
    known); ``ConfigError`` naming it if it points at nothing."""
    found = entry_points(group=MIDDLEWARE_ENTRY_POINT_GROUP, name=name)
    module, colon, attribute = name.partition(":")
    try:
        if found:
            return next(iter(found)).load()
        if not colon or not module or not attribute:
            raise ConfigError(
                f"middleware {name}: no entry point of that name in {MIDDLEWARE_ENTRY_POINT_GROUP}"
                ", and not a module:Name path"
            )
        target: Any = importlib.import_module(module)
    except (ImportError, AttributeError) as exc:  # (an entry point naming nothing: the latter)
        raise ConfigError(f"middleware {name}: cannot import it ({exc})") from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"middleware {name}: {module} has no {attribute}")
        target = getattr(target, part)
    return target


def find_all(settings: Settings) -> None:
    """Import every middleware the pools of ``settings`` name, before the job modules: a job
    may take an option one of them declares. ``ConfigError`` for the first bad name."""
    for pool in settings.pool_settings():
        for name in pool.middleware:
            find(name)


def build(settings: Settings) -> list[Middleware]:
    """The middleware ``settings`` names, made, in order."""
    return [_make(name, find(name), settings) for name in settings.middleware]


def _make(name: str, target: Any, settings: Settings) -> Middleware:
    make: Callable[[], Any]
    if isinstance(target, type) and issubclass(target, Middleware):
        make = target
    elif callable(target) and not isinstance(target, type):
        make = lambda: target(settings)  # noqa: E731 - a factory of the Settings
    else:
        raise ConfigError(
            f"middleware {name}: {target!r} is neither a Middleware subclass nor a factory"
        )
    try:
        made = make()
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"middleware {name}: cannot make it ({exc})") from None
    if not isinstance(made, Middleware):
        raise ConfigError(f"middleware {name}: its factory returned {made!r}, not a Middleware")
    return made
