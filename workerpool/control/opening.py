"""Opening the cancels beside the idempotency store a URL names."""

from __future__ import annotations

from collections.abc import Callable

from workerpool.control.memory import MemoryCancels
from workerpool.control.sqlite import SqliteCancels
from workerpool.control.store import CancelStore
from workerpool.idempotency.base import DEFAULT_RETENTION
from workerpool.stores import opener


def cancel_opener(
    url: str, *, retention: float = DEFAULT_RETENTION
) -> Callable[[], CancelStore] | None:
    """What opens the cancels beside the idempotency store ``url`` names; None for ``none``.
    Raises ValueError for a URL it does not know, ImportError for a missing extra."""

    def firestore() -> Callable[[str, str], CancelStore]:
        from workerpool.control.firestore import FirestoreCancels

        return lambda project, collection: FirestoreCancels(
            project, f"{collection}-cancels", retention=retention
        )

    return opener(
        url,
        "cancels",
        memory=lambda: MemoryCancels(retention=retention),
        sqlite=lambda path: SqliteCancels(path, retention=retention),
        firestore=firestore,
    )
