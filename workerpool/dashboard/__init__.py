"""The web dashboard: the fleet's replicas, concurrency keys, batches, schedules and dead
letters, read from the stores the workers share and from Pub/Sub, with safe actions on dead
letters (``workerpool dashboard``; needs ``workerpool[dashboard]``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from workerpool.config import Settings


def create_app(settings: Settings, **options: Any) -> Starlette:
    """The dashboard's ASGI app (``workerpool.dashboard.app.create_app``, which says what
    ``options`` it takes), imported only when asked for: the ``workerpool`` command loads
    this package without the dashboard's extra."""
    from workerpool.dashboard.app import create_app as make

    return make(settings, **options)
