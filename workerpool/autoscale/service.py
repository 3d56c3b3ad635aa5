"""``workerpool autoscale``: the autoscaler as a process, until SIGTERM or SIGINT.

It reads the heartbeats from the store the workers share (their ``--idempotency-store``),
probes the subscription while no replica serves, reads Cloud Monitoring where it answers, and
sizes the fleet through one actuator. On a signal it stops deciding; the process actuator then
drains the replicas it started (the cloud ones are left as they are: the platform owns them).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from workerpool.autoscale.actuator import Actuator
from workerpool.autoscale.controller import Autoscaler
from workerpool.autoscale.policy import Policy
from workerpool.autoscale.probe import Probe
from workerpool.autoscale.process import ProcessActuator
from workerpool.autoscale.signals import SignalReader
from workerpool.config import Settings
from workerpool.errors import ConfigError
from workerpool.heartbeats import heartbeat_opener
from workerpool.ops.admin import describe_subscription, subscription_path
from workerpool.ops.monitoring import BacklogReader
from workerpool.stores import StoreError
from workerpool.telemetry import PrometheusReader, telemetry_from_env
from workerpool.telemetry.health import HealthServer
from workerpool.worker.clients import subscriber_client
from workerpool.worker.service import Signals

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AutoscaleOptions:
    settings: Settings  # project, subscription, idempotency store, metrics port
    policy: Policy
    actuator: str
    slots_per_replica: int
    interval: float = 1.0
    worker_args: tuple[str, ...] = ()
    config_file: str | None = None


def worker_command_args(options: AutoscaleOptions) -> list[str]:
    """What each ``workerpool run`` the process actuator starts is given: the autoscaler's
    own project, subscription and store (so the beats land where it reads them), then the
    arguments after ``--``, which may override them."""
    s = options.settings
    args = ["--project", s.project, "--subscription", s.subscription]
    args += ["--idempotency-store", s.idempotency_store]
    if options.config_file:
        args += ["--config", options.config_file]
    return [*args, *options.worker_args]


def _actuator(options: AutoscaleOptions) -> Actuator:
    if options.actuator == "process":
        return ProcessActuator(worker_command_args(options))
    raise ConfigError(f"--actuator {options.actuator}: not available")


def run_autoscaler(options: AutoscaleOptions, signals: Signals | None = None) -> None:
    s = options.settings
    if not s.project or not s.subscription:
        raise ConfigError("project and subscription are required")
    try:
        opener = heartbeat_opener(s.idempotency_store)
    except (ValueError, ImportError) as exc:
        raise ConfigError(f"idempotency_store: {exc}") from None
    if opener is None or s.idempotency_store == "memory://":
        raise ConfigError(
            f"idempotency_store {s.idempotency_store}: the autoscaler reads the workers' "
            "heartbeats from a store they share (sqlite:///PATH or firestore://...)"
        )
    path = subscription_path(s.project, s.subscription)
    subscriber = subscriber_client()
    try:
        describe_subscription(subscriber, path)  # a missing one: exit 2, one line
        heartbeats = opener()
    except StoreError as exc:
        subscriber.close()
        raise ConfigError(f"idempotency_store: {exc}") from None
    except BaseException:
        subscriber.close()
        raise
    reader = SignalReader(
        path,
        heartbeats,
        probe=Probe(subscriber, path),
        backlog=BacklogReader(path),
        slots_per_replica=options.slots_per_replica,
    )
    scrape = PrometheusReader() if s.metrics_port else None
    telemetry = telemetry_from_env(extra_readers=[scrape] if scrape else [])
    scaler = Autoscaler(
        reader,
        _actuator(options),
        options.policy,
        interval=options.interval,
        meter_provider=telemetry.meter_provider,
    )
    signals = signals or Signals()
    signals.install()
    health = None
    if scrape is not None:
        health = HealthServer(s.metrics_port, healthy=lambda: True, ready=lambda: True,
                              metrics=scrape).start()  # fmt: skip
    log.info(
        "autoscaling %s with the %s actuator: %d..%d replicas, target utilisation %.0f%%, "
        "scale-down after %gs",
        path,
        options.actuator,
        options.policy.min_replicas,
        options.policy.max_replicas,
        options.policy.target_utilisation * 100,
        options.policy.scale_down_delay,
    )
    loop = threading.Thread(target=scaler.run, args=(signals.stop,), name="autoscale")
    loop.start()
    while loop.is_alive():
        loop.join(1.0)
    log.info("signal received: the autoscaler stops; draining the replicas it started")
    try:
        scaler.close()
    finally:
        subscriber.close()
        if health is not None:
            health.stop()
        telemetry.shutdown()
