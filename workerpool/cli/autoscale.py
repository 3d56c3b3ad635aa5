"""``workerpool autoscale``: sizes the worker fleet."""

from __future__ import annotations

from typing import Any

import click

from workerpool.config import load_settings
from workerpool.errors import ConfigError
from workerpool.worker.signals import held


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML file.")
@click.option("--project", help="Google Cloud project.")
@click.option("--subscription", help="The subscription the workers pull.")
@click.option(
    "--idempotency-store", help="The store the workers share: their heartbeats are read there."
)
@click.option(
    "--actuator",
    type=click.Choice(["process", "cloud-run", "kubernetes", "keda"]),
    default="process",
    show_default=True,
    help="What changes the fleet's size: process starts `workerpool run` processes here; "
    "cloud-run sets a worker pool's instance count; kubernetes scales a Deployment; keda "
    "serves KEDA's external scaler with the count.",
)
@click.option(
    "--cloud-run-worker-pool", help="projects/P/locations/REGION/workerPools/NAME (cloud-run)."
)
@click.option("--kubernetes-deployment", help="The worker Deployment's name (kubernetes).")
@click.option("--kubernetes-namespace", help="Its namespace (kubernetes; default: the pod's own).")
@click.option(
    "--keda-address", default="[::]:9090", show_default=True,
    help="Where the external scaler listens (keda).",
)  # fmt: skip
@click.option("--min", "min_replicas", type=click.IntRange(0), default=0, show_default=True)
@click.option("--max", "max_replicas", type=click.IntRange(0), default=30, show_default=True)
@click.option(
    "--target-utilization", type=click.FloatRange(0, 1, min_open=True), default=0.8,
    show_default=True, help="Share of the fleet's slots to keep busy.",
)  # fmt: skip
@click.option(
    "--scale-down-delay", type=click.FloatRange(0), default=90.0, show_default=True,
    help="Seconds of lower demand before replicas are removed.",
)  # fmt: skip
@click.option(
    "--interval", type=click.FloatRange(0.1), default=1.0, show_default=True,
    help="Seconds between decisions.",
)  # fmt: skip
@click.option(
    "--slots-per-replica", type=click.IntRange(1),
    help="Each replica's max-outstanding, until its heartbeat says (default: the setting's).",
)  # fmt: skip
@click.option(
    "--lease-ttl", type=click.FloatRange(1), default=15.0, show_default=True,
    help="Seconds a standby autoscaler of the subscription waits for a silent leader.",
)  # fmt: skip
@click.option("--metrics-port", type=int, help="Serve /metrics on this port.")
@click.argument("worker_args", nargs=-1, type=click.UNPROCESSED)
def autoscale(
    config_file: str | None,
    actuator: str,
    min_replicas: int,
    max_replicas: int,
    target_utilization: float,
    scale_down_delay: float,
    interval: float,
    slots_per_replica: int | None,
    cloud_run_worker_pool: str | None,
    kubernetes_deployment: str | None,
    kubernetes_namespace: str | None,
    keda_address: str,
    lease_ttl: float,
    worker_args: tuple[str, ...],
    **flags: Any,
) -> None:
    """Size the worker fleet from its heartbeats, a probe pull while it is at zero, and Cloud
    Monitoring where it answers. Arguments after -- go to each `workerpool run` the process
    actuator starts (e.g. -- --jobs myjobs --max-outstanding 2)."""
    from workerpool.assembly.service import exit_now
    from workerpool.autoscale.policy import Policy
    from workerpool.autoscale.service import AutoscaleOptions, run_autoscaler

    settings = load_settings(config_file, flags)
    try:
        policy = Policy(target_utilization, scale_down_delay, min_replicas, max_replicas)
    except ValueError as exc:
        raise ConfigError(f"autoscale: {exc}") from None
    options = AutoscaleOptions(
        settings=settings,
        policy=policy,
        actuator=actuator,
        slots_per_replica=slots_per_replica or _max_outstanding(worker_args, settings),
        interval=interval,
        worker_args=worker_args,
        config_file=config_file,
        cloud_run_worker_pool=cloud_run_worker_pool or "",
        kubernetes_deployment=kubernetes_deployment or "",
        kubernetes_namespace=kubernetes_namespace,
        keda_address=keda_address,
        lease_ttl=lease_ttl,
    )
    if worker_args and actuator != "process":
        raise ConfigError(f"--actuator {actuator}: arguments after -- go to the process actuator")
    run_autoscaler(options, held())
    exit_now(0)


def _max_outstanding(worker_args: tuple[str, ...], settings: Any) -> int:
    """The slots each replica will have: the workers' own --max-outstanding when the process
    actuator is given one (the last, as click takes it), else the setting's."""
    found = int(settings.max_outstanding)
    for i, arg in enumerate(worker_args):
        value = arg.partition("=")[2] if arg.startswith("--max-outstanding=") else None
        if arg == "--max-outstanding" and i + 1 < len(worker_args):
            value = worker_args[i + 1]
        if value is not None and value.isdigit() and int(value) > 0:
            found = int(value)
    return found
