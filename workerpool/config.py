"""Worker settings: defaults < TOML file < ``WORKERPOOL_*`` environment < command-line flags.

Every problem is a ``ConfigError`` whose message names the setting and where it came from,
which the CLI prints as one line with exit code 2.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workerpool import constants as c
from workerpool.constants import LEASES_BULK, LEASES_PER_RUN
from workerpool.errors import ConfigError
from workerpool.periodic.spec import Periodic, parse_schedules
from workerpool.ratelimit import RateSpec, parse_rate
from workerpool.slots.keys import NO_SHARD_MARK, SHARD_MARK

DEFAULT_CONFIG_FILE = "workerpool.toml"
ENV_PREFIX = "WORKERPOOL_"


@dataclass(frozen=True)
class Settings:
    project: str = ""
    subscription: str = ""
    dead_letter_topic: str = ""
    max_outstanding: int = c.DEFAULT_MAX_OUTSTANDING
    prefetch: int | None = None  # not set: ``held_beyond_n`` says how many
    max_bytes: int = c.DEFAULT_MAX_HELD_BYTES
    max_payload_bytes: int = c.MAX_MESSAGE_BYTES
    drain_timeout: float = c.DEFAULT_DRAIN_TIMEOUT
    lease_extension: float = c.DEFAULT_LEASE_EXTENSION
    min_backoff: float = c.DEFAULT_MIN_BACKOFF
    max_backoff: float = c.DEFAULT_MAX_BACKOFF
    jobs: tuple[str, ...] = ()
    # Middleware to add after the defaults, innermost: entry-point names of the
    # ``workerpool.middleware`` group or ``module:Name`` paths (workerpool.assembly.named).
    middleware: tuple[str, ...] = ()
    idempotency_store: str = "sqlite:///workerpool-idempotency.db"
    claim_ttl: float = c.DEFAULT_CLAIM_TTL
    # Concurrency slots: a dead holder's slot frees after slot_ttl; a run waits up to
    # slot_wait for one, then defers its message.
    slot_ttl: float = c.DEFAULT_SLOT_TTL
    slot_wait: float = c.DEFAULT_SLOT_WAIT
    # A key every job of the pool holds a slot of; the pool pulls only while one is free
    # (``[[pools]] concurrency = "KEY"``).
    pool_concurrency: str = ""
    # Write this replica's heartbeat (for the autoscaler) this often, seconds; 0: never.
    heartbeat_interval: float = c.DEFAULT_HEARTBEAT_INTERVAL
    # Serve /metrics, /healthz and /readyz on this port; 0: nothing listens.
    metrics_port: int = 0
    # Plugin sections, ``[jobs."name"]`` in the TOML file, passed to plugins as they are.
    job_config: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # ``[rate_limits]`` NAME = "RATE/s:BURST", shared by every pool of the process.
    rate_limits: Mapping[str, RateSpec] = field(default_factory=dict)
    # ``[concurrency]`` KEY = LIMIT (or "PREFIX*" = LIMIT, per key): slots shared by the fleet.
    concurrency: Mapping[str, int] = field(default_factory=dict)
    # How each key's slots are leased, where its entry says (``KEY = "20/bulk"``): "bulk"
    # (shares leased to replicas, for fast jobs) or "per_run" (the default).
    concurrency_leases: Mapping[str, str] = field(default_factory=dict)
    # How many records a bulk key's shares are split into, where more than one
    # (``KEY = "200/bulk/25"``: ``slots.sharding``).
    concurrency_shards: Mapping[str, int] = field(default_factory=dict)
    # ``[[pools]]``: one pool per subscription, each overriding the settings above.
    pools: tuple[Mapping[str, Any], ...] = ()
    # ``[[schedules]]``: periodic jobs, each fired by the pool its ``pool`` names (default the
    # first) to its topic; a pool's Settings keep its own (``pool_settings``).
    schedules: tuple[Periodic, ...] = ()

    def validate(self) -> Settings:
        positive = (
            "max_outstanding",
            "max_bytes",
            "max_payload_bytes",
            "lease_extension",
            "claim_ttl",
            "slot_ttl",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("prefetch", "drain_timeout", "min_backoff", "slot_wait", "heartbeat_interval"):
            if (getattr(self, name) or 0) < 0:
                raise ConfigError(f"{name} must not be negative, got {getattr(self, name)}")
        if not 10 <= self.lease_extension <= 600:
            raise ConfigError(f"lease_extension must be 10..600 s, got {self.lease_extension}")
        if self.max_backoff < self.min_backoff:
            raise ConfigError("max_backoff must be at least min_backoff")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must be 0..65535, got {self.metrics_port}")
        if self.pools and not all(pool.subscription for pool in self.pool_settings()):
            raise ConfigError("every [[pools]] entry needs a subscription")
        subscriptions = [pool.subscription for pool in self.pool_settings()]
        for schedule in self.schedules:
            if schedule.pool and schedule.pool not in subscriptions:
                raise ConfigError(
                    f"schedule {schedule.name!r}: pool {schedule.pool!r} is not the "
                    "subscription of a pool (" + ", ".join(subscriptions) + ")"
                )
        return self

    @property
    def held_beyond_n(self) -> int:
        """The prefetch: as set, or else a quarter of N and at least 2."""
        if self.prefetch is not None:
            return self.prefetch
        return max(c.MIN_DEFAULT_PREFETCH, self.max_outstanding // c.PREFETCH_SHARE_OF_N)

    def prefetch_for(self, *, ordered: bool) -> int:
        """The prefetch on a subscription ``ordered`` or not: on an ordered one, unless set,
        twice N. A key's next message waits behind the one running, so fewer messages held
        than that left slots idle (measured on the emulator at N = 8 with 20 keys: 0.70 of
        the slots busy with the default prefetch, 0.84 with N, 0.91-0.97 with 2 N)."""
        if ordered and self.prefetch is None:
            return c.ORDERED_PREFETCH_PER_SLOT * self.max_outstanding
        return self.held_beyond_n

    def pool_settings(self) -> list[Settings]:
        """One Settings per pool: the ``[[pools]]`` entries over these, or just these."""
        if not self.pools:
            return [self]
        pools = [
            dataclasses.replace(self, pools=(), **_pool_values(i, pool))
            for i, pool in enumerate(self.pools)
        ]
        return [
            dataclasses.replace(pool, schedules=tuple(
                s for s in self.schedules if s.pool == pool.subscription or (not s.pool and i == 0)
            )).validate()
            for i, pool in enumerate(pools)
        ]  # fmt: skip


def _pool_values(index: int, pool: Mapping[str, Any]) -> dict[str, Any]:
    pool = dict(pool)
    if "concurrency" in pool:  # in a pool, the key its jobs share, not a table of limits
        key = pool.pop("concurrency")
        if not isinstance(key, str):
            raise ConfigError(
                f"pools[{index}]: concurrency names the key the pool's jobs share (a string); "
                "declare limits in the top-level [concurrency] table"
            )
        pool["pool_concurrency"] = key
    unknown = sorted(set(pool) - set(_FIELDS) - {"jobs"})
    if unknown:
        raise ConfigError(f"pools[{index}]: unknown setting {unknown[0]}")
    return {k: _coerce(k, v, f"pools[{index}]") for k, v in pool.items()}


_STRUCTURED = (
    "job_config", "rate_limits", "concurrency", "concurrency_leases", "concurrency_shards",
    "pools", "schedules",
)  # fmt: skip
_FIELDS = {f.name: f for f in dataclasses.fields(Settings) if f.name not in _STRUCTURED}


def _coerce(name: str, value: Any, source: str) -> Any:
    kind = _FIELDS[name].type
    try:
        if kind in ("int", "int | None") and not isinstance(value, bool):
            return int(value)
        if kind == "float" and not isinstance(value, bool):
            return float(value)
        if kind == "str":
            return str(value)
        if kind == "tuple[str, ...]":
            items = value.split(",") if isinstance(value, str) else list(value)
            return tuple(str(item).strip() for item in items if str(item).strip())
    except (TypeError, ValueError):
        pass
    raise ConfigError(f"{name} (from {source}) must be {kind}, got {value!r}")


def _rate_limits(entries: Mapping[str, Any], source: str) -> dict[str, RateSpec]:
    limits = {}
    for name, text in entries.items():
        try:
            limits[name] = parse_rate(str(text))
        except ValueError as exc:
            raise ConfigError(f"rate limit {name} (from {source}): {exc}") from None
    return limits


def _rate_limit_flags(entries: str | tuple[str, ...], source: str) -> dict[str, RateSpec]:
    """``NAME=RATE/s[:BURST]`` items, comma-separated in the environment."""
    return _rate_limits(_pairs(entries, source, "rate limit", "NAME=RATE/s[:BURST]"), source)


def _concurrency(entries: Mapping[str, Any], source: str) -> dict[str, tuple[int, str, int]]:
    """``KEY = LIMIT`` or ``KEY = "LIMIT/MODE"`` (MODE ``bulk`` or ``per_run``), or
    ``"LIMIT/bulk/SHARDS"``: the limit, how its slots are leased, and how many records a bulk
    key's shares are split into (``slots.sharding``)."""
    limits = {}
    for key, raw in entries.items():
        if SHARD_MARK in key:
            raise ConfigError(f"concurrency {key!r} (from {source}): {NO_SHARD_MARK}")
        text, mode, shards = (*str(raw).strip().split("/"), "", "")[:3]
        mode = mode.strip() or LEASES_PER_RUN
        shards = shards.strip() or "1"
        if (
            isinstance(raw, bool)
            or str(raw).count("/") > 2
            or not text.strip().isdigit()
            or int(text) < 1
            or "*" in key[:-1]
            or mode not in (LEASES_PER_RUN, LEASES_BULK)
            or not shards.isdigit()
            or not 1 <= int(shards) <= int(text)
            or (int(shards) > 1 and mode != LEASES_BULK)
        ):
            raise ConfigError(
                f"concurrency {key!r} (from {source}): the limit must be a positive integer, "
                "optionally /bulk or /per_run, a bulk key's shards /bulk/S (1 to the limit), "
                f"and a key may only end in *, got {raw!r}"
            )
        limits[key] = (int(text), mode, int(shards))
    return limits


def _concurrency_flags(
    entries: str | tuple[str, ...], source: str
) -> dict[str, tuple[int, str, int]]:
    """``KEY=LIMIT[/MODE[/SHARDS]]`` items, comma-separated in the environment."""
    return _concurrency(_pairs(entries, source, "concurrency", "KEY=LIMIT[/MODE[/SHARDS]]"), source)


def _split_concurrency(
    values: dict[str, Any], declared: Mapping[str, tuple[int, str, int]]
) -> dict[str, Any]:
    """Settings' ``concurrency`` (limits), ``concurrency_leases`` (the bulk keys) and
    ``concurrency_shards`` (the bulk keys split into shards)."""
    values["concurrency"] = {key: limit for key, (limit, _, _) in declared.items()}
    values["concurrency_leases"] = {
        key: mode for key, (_, mode, _) in declared.items() if mode == LEASES_BULK
    }
    values["concurrency_shards"] = {
        key: shards for key, (_, _, shards) in declared.items() if shards > 1
    }
    return values


def _pairs(entries: str | tuple[str, ...], source: str, what: str, form: str) -> dict[str, str]:
    items = entries.split(",") if isinstance(entries, str) else entries
    pairs = {}
    for item in (i.strip() for i in items if i.strip()):
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ConfigError(f"{what} {item!r} (from {source}) is not {form}")
        pairs[name.strip()] = value.strip()
    return pairs


def _from_file(path: Path) -> dict[str, Any]:
    try:
        document = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: {exc}") from exc
    tables = {"worker", "jobs", "rate_limits", "concurrency", "pools", "schedules"}
    unknown_tables = sorted(set(document) - tables)
    if unknown_tables:
        raise ConfigError(f"config file {path}: unknown table [{unknown_tables[0]}]")
    worker = document.get("worker", {})
    unknown = sorted(set(worker) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"config file {path}: unknown setting worker.{unknown[0]}")
    values = {k: _coerce(k, v, str(path)) for k, v in worker.items()}
    values["job_config"] = dict(document.get("jobs", {}))
    values["rate_limits"] = _rate_limits(document.get("rate_limits", {}), str(path))
    values["concurrency"] = _concurrency(document.get("concurrency", {}), str(path))
    values["pools"] = tuple(document.get("pools", ()))
    values["schedules"] = parse_schedules(document.get("schedules", ()), str(path))
    return values


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    values = {}
    for name in _FIELDS:
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is not None and raw != "":
            values[name] = _coerce(name, raw, ENV_PREFIX + name.upper())
    return values


def load_settings(
    config_file: str | None = None,
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> Settings:
    """Merge the sources; ``flags`` holds only the options given on the command line."""
    env = os.environ if env is None else env
    path = Path(config_file) if config_file else Path(DEFAULT_CONFIG_FILE)
    values: dict[str, Any] = {}
    if config_file or path.exists():
        values = _from_file(path)
    values.update(_from_env(env))
    limits = dict(values.get("rate_limits", {}))
    if env.get(ENV_PREFIX + "RATE_LIMITS"):
        limits.update(_rate_limit_flags(env[ENV_PREFIX + "RATE_LIMITS"], "WORKERPOOL_RATE_LIMITS"))
    flags = dict(flags or {})
    limits.update(_rate_limit_flags(flags.pop("rate_limit", None) or (), "--rate-limit"))
    values["rate_limits"] = limits
    slots = dict(values.get("concurrency", {}))
    if env.get(ENV_PREFIX + "CONCURRENCY"):
        slots.update(_concurrency_flags(env[ENV_PREFIX + "CONCURRENCY"], "WORKERPOOL_CONCURRENCY"))
    slots.update(_concurrency_flags(flags.pop("concurrency", None) or (), "--concurrency"))
    _split_concurrency(values, slots)
    for name, value in flags.items():
        if value is not None and value != ():
            values[name] = _coerce(name, value, f"--{name.replace('_', '-')}")
    return Settings(**values).validate()
