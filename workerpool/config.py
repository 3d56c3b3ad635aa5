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
from workerpool.errors import ConfigError

DEFAULT_CONFIG_FILE = "workerpool.toml"
ENV_PREFIX = "WORKERPOOL_"


@dataclass(frozen=True)
class Settings:
    project: str = ""
    subscription: str = ""
    dead_letter_topic: str = ""
    max_outstanding: int = 10
    prefetch: int = c.DEFAULT_PREFETCH
    max_bytes: int = 100 * 1024 * 1024
    max_payload_bytes: int = c.MAX_MESSAGE_BYTES
    drain_timeout: float = c.DEFAULT_DRAIN_TIMEOUT
    lease_extension: float = 30.0
    min_backoff: float = 2.0
    max_backoff: float = 600.0
    jobs: tuple[str, ...] = ()
    idempotency_store: str = "sqlite:///workerpool-idempotency.db"
    claim_ttl: float = 60.0
    # Plugin sections, ``[jobs."name"]`` in the TOML file, passed to plugins as they are.
    job_config: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def validate(self) -> Settings:
        positive = (
            "max_outstanding",
            "max_bytes",
            "max_payload_bytes",
            "lease_extension",
            "claim_ttl",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("prefetch", "drain_timeout", "min_backoff"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must not be negative, got {getattr(self, name)}")
        if not 10 <= self.lease_extension <= 600:
            raise ConfigError(f"lease_extension must be 10..600 s, got {self.lease_extension}")
        if self.max_backoff < self.min_backoff:
            raise ConfigError("max_backoff must be at least min_backoff")
        return self


_FIELDS = {f.name: f for f in dataclasses.fields(Settings) if f.name != "job_config"}


def _coerce(name: str, value: Any, source: str) -> Any:
    kind = _FIELDS[name].type
    try:
        if kind == "int" and not isinstance(value, bool):
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


def _from_file(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    try:
        document = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: {exc}") from exc
    worker = document.get("worker", {})
    unknown = sorted(set(worker) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"config file {path}: unknown setting worker.{unknown[0]}")
    values = {k: _coerce(k, v, str(path)) for k, v in worker.items()}
    return values, dict(document.get("jobs", {}))


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
    job_config: dict[str, Any] = {}
    if config_file or path.exists():
        values, job_config = _from_file(path)
    values.update(_from_env(env))
    for name, value in (flags or {}).items():
        if value is not None and value != ():
            values[name] = _coerce(name, value, f"--{name.replace('_', '-')}")
    return Settings(**values, job_config=job_config).validate()
