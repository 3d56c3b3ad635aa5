"""What the stores built on SQLite and Firestore (idempotency claims, concurrency slots, the
schedule, batches) share: their errors, opening a connection, translating a backend's errors,
atomic writes of one document or several.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Literal, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T")
R = TypeVar("R", bound="DataclassInstance")


def known_fields(record: type[R], data: Mapping[str, Any]) -> R:
    """A ``record`` from what a store returned, leaving out the fields it does not have: a
    later workerpool may write one more, and a worker of this one reading it in a rolling
    deploy must not fail on it. (The other way round, a field a release adds needs a
    default: what an earlier release wrote lacks it.)"""
    return record(**{f.name: data[f.name] for f in fields(record) if f.name in data})


class StoreError(Exception):
    """The store could not do what was asked, and trying again soon will not help
    (permission denied, a corrupt file, a bug). The caller neither runs nor acks. Every
    failure of a store call is a ``StoreError``: nothing else escapes one."""


class StoreUnavailable(StoreError):
    """The backend could not be reached, was busy or timed out: try again later."""


def guarded(store: object, call: Callable[[], T]) -> T:
    """``call()``, with any failure but a ``StoreError`` turned into one naming ``store``."""
    try:
        return call()
    except StoreError:
        raise
    except Exception as exc:  # a backend's unclassified error, or a bug: still a store error
        raise StoreError(f"{type(store).__name__}: {type(exc).__name__}: {exc}") from exc


EXPECTED_URL = "expected sqlite:///PATH, firestore://PROJECT/COLLECTION, memory:// or none"


@dataclass(frozen=True)
class Location:
    """Where a store URL points: ``sqlite:///relative.db`` or ``sqlite:////absolute.db`` (as
    SQLAlchemy spells them), ``firestore://PROJECT/COLLECTION``, ``memory://`` (this process
    only), or ``none``."""

    kind: Literal["none", "memory", "sqlite", "firestore"]
    path: str = ""
    project: str = ""
    collection: str = ""

    @classmethod
    def parse(cls, url: str) -> Location:
        """Raises ValueError for a URL it does not know."""
        if url == "none":
            return cls("none")
        if url == "memory://":
            return cls("memory")
        scheme, sep, rest = url.partition("://")
        if sep and scheme == "sqlite" and rest.startswith("/") and rest != "/":
            return cls("sqlite", path=rest[1:])
        if sep and scheme == "firestore":
            project, _, collection = rest.partition("/")
            if project and collection and "/" not in collection:
                return cls("firestore", project=project, collection=collection)
        raise ValueError(f"unsupported store URL {url!r}: {EXPECTED_URL}")


def require_shared(url: str, what: str) -> None:
    """ConfigError unless another process sees ``what`` written to the store ``url`` names:
    ``memory://`` is the writing process's alone, and a command writing there would report
    what no worker ever sees. (Check ``url`` with ``opener`` first.)"""
    if Location.parse(url).kind == "memory":
        from workerpool.errors import ConfigError  # (errors imports nothing of the stores)

        raise ConfigError(f"idempotency_store {url}: no other process can see its {what}")


S = TypeVar("S")


def opener(
    url: str,
    what: str,
    *,
    memory: Callable[[], S],
    sqlite: Callable[[str], S],
    firestore: Callable[[], Callable[[str, str], S]],
) -> Callable[[], S] | None:
    """What opens ``what`` (a store named in errors) beside the store ``url`` names, checked
    now and opened later; None for ``none``. ``sqlite`` takes the file's path; ``firestore``
    imports its backend (google-cloud-firestore is an extra) and returns what takes the
    project and the collection. Raises ValueError for a URL it does not know, ImportError
    for a missing extra."""
    where = Location.parse(url)
    if where.kind == "none":
        return None
    if where.kind == "memory":
        return memory
    if where.kind == "sqlite":
        return lambda: sqlite(where.path)
    try:
        make = firestore()
    except ImportError as exc:
        raise firestore_extra_missing(what) from exc
    return lambda: make(where.project, where.collection)


def firestore_extra_missing(what: str) -> ImportError:
    return ImportError(
        f"firestore:// {what} needs google-cloud-firestore: pip install 'workerpool[firestore]'"
    )
