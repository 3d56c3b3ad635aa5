"""``workerpool autoscale``: the autoscaler as a process, until SIGTERM or SIGINT.

It reads the heartbeats from the store the workers share (their ``--idempotency-store``),
probes the subscription while no replica serves, reads Cloud Monitoring where it answers, and
sizes the fleet through one actuator. Of several autoscalers of one subscription, the one
holding its lease (in the same store) acts; the others stand by. On a signal it stops
deciding; the process actuator then drains the replicas it started (the cloud ones are left as
they are: the platform owns them), and the lease is given up.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from workerpool.autoscale.actuator import Actuator
from workerpool.autoscale.controller import Autoscaler
from workerpool.autoscale.keda import KedaScaler, KedaTarget
from workerpool.autoscale.leader import LEASE_TTL, Leader
from workerpool.autoscale.policy import Policy
from workerpool.autoscale.probe import Probe
from workerpool.autoscale.process import ProcessActuator
from workerpool.autoscale.signals import SignalReader
from workerpool.config import Settings
from workerpool.errors import ConfigError
from workerpool.heartbeats import HeartbeatStore, heartbeat_opener
from workerpool.leadership import LeadershipStore, leadership_opener
from workerpool.ops.monitoring import BacklogReader
from workerpool.pubsub import describe_subscription, subscriber_client, subscription_path
from workerpool.stores import StoreError
from workerpool.telemetry import PrometheusReader, telemetry_from_env
from workerpool.telemetry.health import HealthServer
from workerpool.worker.signals import Signals

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
    cloud_run_worker_pool: str = ""  # projects/P/locations/REGION/workerPools/NAME
    kubernetes_deployment: str = ""
    kubernetes_namespace: str | None = None  # default: the pod's own
    keda_address: str = "[::]:9090"
    lease_ttl: float = LEASE_TTL


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
    """The actuator ``--actuator`` names, built before anything connects: a missing setting
    or extra is a ConfigError (exit 2, one line)."""
    if options.actuator == "process":
        return ProcessActuator(worker_command_args(options))
    if options.actuator == "cloud-run":
        if not options.cloud_run_worker_pool:
            raise ConfigError("--actuator cloud-run needs --cloud-run-worker-pool")
        from workerpool.autoscale.cloudrun import CloudRunActuator

        return CloudRunActuator(options.cloud_run_worker_pool)
    if options.actuator == "kubernetes":
        if not options.kubernetes_deployment:
            raise ConfigError("--actuator kubernetes needs --kubernetes-deployment")
        from workerpool.autoscale.kubernetes import KubernetesActuator

        return KubernetesActuator(options.kubernetes_deployment, options.kubernetes_namespace)
    if options.actuator == "keda":
        return KedaTarget()
    raise ConfigError(
        f"--actuator {options.actuator}: expected process, cloud-run, kubernetes or keda"
    )


def run_autoscaler(options: AutoscaleOptions, signals: Signals | None = None) -> None:
    s = options.settings
    if not s.project or not s.subscription:
        raise ConfigError("project and subscription are required")
    open_heartbeats = _shared(s.idempotency_store, heartbeat_opener)
    open_leadership = _shared(s.idempotency_store, leadership_opener)
    actuator = _actuator(options)  # before connecting: its configuration errors come first
    path = subscription_path(s.project, s.subscription)
    subscriber = subscriber_client()
    try:
        describe_subscription(subscriber, path)  # a missing one: exit 2, one line
        heartbeats = open_heartbeats()
        leader = Leader(open_leadership(), path, ttl=options.lease_ttl)
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
        max_replicas=options.policy.max_replicas,
    )
    keda = _keda_server(actuator, options.keda_address)
    scrape = PrometheusReader() if s.metrics_port else None
    telemetry = telemetry_from_env(extra_readers=[scrape] if scrape else [])
    scaler = Autoscaler(
        reader,
        actuator,
        options.policy,
        interval=options.interval,
        meter_provider=telemetry.meter_provider,
        on_decision=actuator.decided if isinstance(actuator, KedaTarget) else None,
        leader=leader,
    )
    signals = signals or Signals()
    signals.install()
    health = None
    if scrape is not None:
        health = HealthServer(s.metrics_port, healthy=lambda: True, ready=lambda: True,
                              metrics=scrape).start()  # fmt: skip
    p = options.policy
    log.info(
        "autoscaling %s with the %s actuator: %d..%d replicas, target utilisation %.0f%%, "
        "scale-down after %gs",
        path, options.actuator, p.min_replicas, p.max_replicas, p.target_utilisation * 100,
        p.scale_down_delay,
    )  # fmt: skip
    loop = threading.Thread(target=_rounds, args=(scaler, signals), name="autoscale")
    loop.start()
    while loop.is_alive():
        loop.join(1.0)
    try:
        if keda is not None:
            keda.stop()
    finally:
        subscriber.close()
        if health is not None:
            health.stop()
        telemetry.shutdown()


def _rounds(scaler: Autoscaler, signals: Signals) -> None:
    """The rounds until a signal, then the close, in one thread: the process actuator's
    replicas get SIGTERM when the thread that started them ends, so it drains them itself."""
    scaler.run(signals.stop)
    log.info("signal received: the autoscaler stops (the process actuator drains its replicas)")
    scaler.close()


Store = TypeVar("Store", HeartbeatStore, LeadershipStore)


def _shared(url: str, opener: Callable[[str], Callable[[], Store] | None]) -> Callable[[], Store]:
    """What opens a store the fleet shares beside ``url`` (``opener`` of heartbeats or
    leadership): a ConfigError for one no other process can see."""
    try:
        opened = opener(url)
    except (ValueError, ImportError) as exc:
        raise ConfigError(f"idempotency_store: {exc}") from None
    if opened is None or url == "memory://":
        raise ConfigError(
            f"idempotency_store {url}: the autoscaler reads the workers' heartbeats from a "
            "store they share (sqlite:///PATH or firestore://PROJECT/COLLECTION)"
        )
    return opened


def _keda_server(actuator: Actuator, address: str) -> KedaScaler | None:
    """With the KEDA actuator, the external scaler KEDA asks, answering from its decisions."""
    if not isinstance(actuator, KedaTarget):
        return None
    return KedaScaler(actuator.estimate, address).start()
