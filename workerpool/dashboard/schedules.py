"""The periodic schedules the dashboard shows and operates: those the fleet fires, as
``workerpool run`` reads them."""

from __future__ import annotations

from workerpool.assembly.named import find_all
from workerpool.config import Settings
from workerpool.periodic import Periodic
from workerpool.periodic.control import declared
from workerpool.registry import import_job_modules, load_entry_points, registry


def load_job_modules(settings: Settings) -> None:
    """Import the job modules ``settings`` name (and the plugins'), as ``workerpool run``
    does, so their ``@job`` schedules show; ConfigError for one that cannot be imported."""
    find_all(settings)  # first: a job may take an option one of them declares
    load_entry_points()
    import_job_modules(settings.jobs)


def fleet_schedules(settings: Settings) -> tuple[Periodic, ...]:
    """The config's ``[[schedules]]`` and those declared on ``@job(schedule=)`` by the jobs
    this process registered: ``workerpool dashboard`` imports the job modules the config's
    ``jobs`` and its ``--jobs`` name, as ``workerpool run`` does; a service mounting the app
    has imported its own. With no job registered, the config's alone (nothing to check them
    against: the workers do)."""
    if not registry.specs():
        return tuple(settings.schedules)
    return declared(settings.schedules, registry)
