"""Concurrency keys and their limits.

A limit is declared for a key (``bigquery-exports = 2``) or for every key with a prefix
(``"partner:*" = 2``: each tenant's key gets 2 slots of its own). A job names its key with
``@job(..., concurrency="bigquery-exports")``, or a template over payload fields,
``concurrency="partner:{partner_id}"``, so one tenant's flood cannot take another's slots.
"""

from __future__ import annotations

import string
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from workerpool.errors import ConfigError

# Marks a split key's shard records (``KEY#0``): no declared or rendered key contains it.
SHARD_MARK = "#"
NO_SHARD_MARK = f"a key may not contain {SHARD_MARK} (it marks a split key's shard records)"


class Limits:
    """The declared limits; ``of(key)`` is the exact key's, else the longest matching
    prefix pattern's, else None. ``bulk`` names the entries whose slots are leased to
    replicas in shares (``"20/bulk"``); a key's mode is that of the entry giving its limit.
    ``shards``: how many records a bulk entry's keys are split into, where more than one."""

    def __init__(
        self,
        declared: Mapping[str, int],
        bulk: Collection[str] = (),
        shards: Mapping[str, int] | None = None,
    ) -> None:
        for key, limit in declared.items():
            if not key or "*" in key[:-1]:
                raise ConfigError(f"concurrency key {key!r}: a pattern may only end in *")
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
                raise ConfigError(f"concurrency {key}: the limit must be a positive integer")
        self.declared = dict(declared)
        self.bulk_entries = frozenset(bulk) & set(declared)
        self.split = {k: n for k, n in (shards or {}).items() if k in self.bulk_entries}
        self._exact = {k: v for k, v in declared.items() if not k.endswith("*")}
        # Longest first: "partner:eu:*" wins over "partner:*".
        self._prefixes = sorted(
            ((k[:-1], v) for k, v in declared.items() if k.endswith("*")),
            key=lambda item: -len(item[0]),
        )

    def entry(self, key: str) -> str | None:
        """The declared entry that gives ``key`` its limit (the key, or a pattern)."""
        if key in self._exact:
            return key
        for prefix, _ in self._prefixes:
            if key.startswith(prefix):
                return prefix + "*"
        return None

    def of(self, key: str) -> int | None:
        entry = self.entry(key)
        return None if entry is None else self.declared[entry]

    def bulk(self, key: str) -> bool:
        """Whether ``key``'s slots are leased in shares (``slots.shares``)."""
        return self.entry(key) in self.bulk_entries

    def shards(self, key: str) -> int:
        """How many records ``key``'s shares are split into (1: its own record)."""
        return self.split.get(self.entry(key) or "", 1)

    def cover(self, head: str) -> bool:
        """A prefix pattern gives a limit to every key that starts with ``head``."""
        return any(head.startswith(prefix) for prefix, _ in self._prefixes)

    def __bool__(self) -> bool:
        return bool(self.declared)


class BadPayloadKey(Exception):
    """The payload cannot name a key by the template: it lacks a field the template names,
    or a field's value puts ``#`` in the key (which names a split key's shard records,
    ``KEY#0``: a tenant named so would count against, and write, another key's shard)."""


@dataclass(frozen=True)
class KeyTemplate:
    """``"partner:{partner_id}"``: literal text and top-level payload field names."""

    text: str

    def __post_init__(self) -> None:
        try:
            parsed = list(string.Formatter().parse(self.text))
        except ValueError as exc:
            raise ConfigError(f"concurrency key {self.text!r}: {exc}") from None
        for _, name, spec, conversion in parsed:
            if name is not None and (not name.isidentifier() or spec or conversion):
                raise ConfigError(
                    f"concurrency key {self.text!r}: {{{name}}} must name a payload field"
                )

    @property
    def fields(self) -> list[str]:
        return [name for _, name, _, _ in string.Formatter().parse(self.text) if name]

    @property
    def head(self) -> str:
        """The literal text before the first field: every key it renders starts with it."""
        return next(iter(string.Formatter().parse(self.text)), ("", None, None, None))[0]

    def render(self, payload: Any) -> str:
        """The key for one payload: a JSON object, or the job's payload class."""
        values = {}
        for name in self.fields:
            if isinstance(payload, Mapping):
                value = payload.get(name)
            else:
                value = getattr(payload, name, None)
            if value is None or isinstance(value, dict | list):
                raise BadPayloadKey(
                    f"concurrency key {self.text} needs payload field {name!r} "
                    "(a string or a number)"
                )
            values[name] = value
        key = self.text.format_map(values)
        if SHARD_MARK in key:
            raise BadPayloadKey(
                f"concurrency key {self.text}: the payload renders {key!r}, and {NO_SHARD_MARK}"
            )
        return key

    def check(self, limits: Limits) -> str | None:
        """Why a key this renders may not be used (no declared limit covers it, or it could
        name a shard record), or None if every one may."""
        if SHARD_MARK in self.text:  # (a declared pattern may cover it: "tenant:*", "tenant:a#0")
            return NO_SHARD_MARK
        if not self.fields:
            return None if limits.of(self.text) is not None else "has no declared limit"
        if limits.cover(self.head):
            return None
        return f'has no declared limit: declare "{self.head}*" (one limit per rendered key)'
