"""The concurrency limits a worker enforces, gathered from the config and the job configs and
checked against every job's key before the worker connects to anything."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from workerpool.errors import ConfigError
from workerpool.registry import JobSpec
from workerpool.slots import slot_store_opener
from workerpool.slots.keys import NO_SHARD_MARK, SHARD_MARK, KeyTemplate, Limits

log = logging.getLogger(__name__)


def declared_limits(
    specs: Iterable[JobSpec],
    job_config: Mapping[str, Any],
    *,
    concurrency: Mapping[str, int],
    bulk: Iterable[str] = (),
    shards: Mapping[str, int] | None = None,
    pool_key: str,
    store_url: str,
) -> Limits | None:
    """The declared limits (``concurrency``, the ``[concurrency]`` table, and the
    ``concurrency_limits`` of job configs: the BigQuery plugin's ``max_concurrent_exports``;
    ``bulk``, the entries leased in shares, ``shards`` how many records each is split into),
    checked to cover every job's key and the pool's key (``ConfigError`` if not); None when no
    job takes slots and none are declared. With limits declared, any run may take a slot for
    part of its run (ctx.slot). A job config's limits hold only where the store
    (``store_url``) can share slots."""
    declared = _limits_of_configs(job_config)
    if declared and not _can_share_slots(store_url):
        # Not a warning: a job that runs without its slots says so itself, when it runs.
        log.info(
            "concurrency limits of job configs (%s) not enforced: idempotency store %s "
            "cannot share slots",
            ", ".join(sorted(declared)),
            store_url,
        )
        declared = {}
    for key, limit in concurrency.items():
        if declared.setdefault(key, limit) != limit:
            raise ConfigError(
                f"concurrency {key!r}: [concurrency] says {limit}, a job's config "
                f"{declared[key]}; declare it once"
            )
    limits = Limits(declared, frozenset(bulk), shards)
    keys = {spec.name: spec.options["concurrency"] for spec in specs
            if spec.options.get("concurrency")}  # fmt: skip
    for job_name, key in keys.items():
        problem = KeyTemplate(key).check(limits)
        if problem:
            raise ConfigError(f"job {job_name}: concurrency key {key!r} {problem}")
    if pool_key and limits.bulk(pool_key):
        raise ConfigError(
            f"pool_concurrency {pool_key!r}: a pool's key is leased per run (its slots are "
            "taken before each pull); declare it without /bulk"
        )
    if pool_key and SHARD_MARK in pool_key:
        raise ConfigError(f"pool_concurrency {pool_key!r}: {NO_SHARD_MARK}")
    if pool_key and (KeyTemplate(pool_key).fields or limits.of(pool_key) is None):
        raise ConfigError(
            f"pool_concurrency {pool_key!r}: a pool's key must be a plain key with a "
            "declared limit (the pool takes its slots before it sees any payload)"
        )
    return limits if keys or limits else None


def _limits_of_configs(job_config: Mapping[str, Any]) -> dict[str, int]:
    declared: dict[str, int] = {}
    for name, config in job_config.items():
        for key, limit in getattr(config, "concurrency_limits", {}).items():
            if declared.setdefault(key, limit) != limit:
                raise ConfigError(
                    f"concurrency {key!r}: job {name}'s config says {limit}, another "
                    f"job's {declared[key]}"
                )
    return declared


def _can_share_slots(store_url: str) -> bool:
    try:
        slot_store_opener(store_url)
    except (ValueError, ImportError):
        return False
    return True
