"""The Running and Schedules pages' actions: cancel running jobs by job id (through
``workerpool.cancel``, as ``workerpool cancel`` does), and pause, resume or trigger a periodic
schedule of the config (through ``workerpool.periodic.control``, as ``workerpool schedule``
does). Plain data and calls, no HTML."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from workerpool.config import Settings
from workerpool.control.cancel import cancel
from workerpool.dashboard.stores import opened
from workerpool.errors import ConfigError
from workerpool.periodic import Marks, Periodic
from workerpool.periodic.control import Control
from workerpool.stores import StoreError

# Each page's actions, and the page its confirmation goes back to.
ACTIONS: dict[str, tuple[str, ...]] = {
    "running": ("cancel",),
    "schedules": ("pause", "resume", "trigger"),
}


@dataclass(frozen=True)
class Order:
    """An action of a page on its targets: job ids (Running) or one schedule's name."""

    page: str
    action: str
    targets: tuple[str, ...]

    def describe(self) -> str:
        if self.page == "running":
            return f"{len(self.targets)} job(s): {', '.join(self.targets)}"
        return f"schedule {self.targets[0]}"


def order(page: str, action: str, targets: list[str]) -> Order | str:
    """The order a form asks for, or why it is refused (one line)."""
    if action not in ACTIONS.get(page, ()):
        return f"unknown action {action!r}"
    if not targets:
        return "nothing selected"
    if page == "schedules" and len(targets) != 1:
        return "one schedule at a time"
    return Order(page, action, tuple(targets))


def carry_out(
    settings: Settings,
    schedules: Sequence[Periodic],
    marks: Callable[[], Marks] | None,
    asked: Order,
    who: str,
) -> list[str]:
    """Carry out ``asked`` for ``who`` (on one of ``schedules``, the Schedules page's): what
    came of it, a line per target."""
    try:
        if asked.page == "running":
            answers = cancel(list(asked.targets), reason=f"from the dashboard by {who}",
                             store=settings)  # fmt: skip
            return [answer.line() for answer in answers]
        return [_on_schedule(settings, schedules, marks, asked.action, asked.targets[0])]
    except (ConfigError, StoreError) as exc:
        return [f"refused: {exc}"]


def _on_schedule(
    settings: Settings,
    schedules: Sequence[Periodic],
    marks: Callable[[], Marks] | None,
    action: str,
    name: str,
) -> str:
    with opened(marks) as store:
        if store is None:
            raise ConfigError(f"idempotency_store {settings.idempotency_store}: keeps no ticks")
        control = Control(schedules, store)
        if action == "trigger":
            return f"{name}: triggered, job id {control.trigger(name)}"
        control.pause(name, action == "pause")
        return f"{name}: {action}d"
