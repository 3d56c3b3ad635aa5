"""The test kit: ``run_job`` runs one job in a unit test as a worker would (``jobs``), with
fakes for Pub/Sub (``fakes``); ``pubsub_emulator`` finds an emulator for tests
(``PUBSUB_EMULATOR_HOST`` if set; else testcontainers when a Docker engine answers; else the
installed gcloud emulator as a local process group, ``emulator``)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator

from workerpool.testing.emulator import LocalEmulator
from workerpool.testing.jobs import JobResult, run_job
from workerpool.testing.pubsub import PubSubResources, wait_settled

__all__ = [
    "JobResult",
    "LocalEmulator",
    "PubSubResources",
    "pubsub_emulator",
    "run_job",
    "wait_settled",
]

EMULATOR_IMAGE = "gcr.io/google.com/cloudsdktool/google-cloud-cli:emulators"


def docker_engine_answers() -> bool:
    try:
        result = subprocess.run(["docker", "info"], capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0


@contextlib.contextmanager
def _container(project: str) -> Iterator[str]:
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.waiting_utils import wait_for_logs

    command = f"gcloud beta emulators pubsub start --host-port=0.0.0.0:8085 --project={project}"
    with DockerContainer(EMULATOR_IMAGE).with_command(command).with_exposed_ports(8085) as c:
        wait_for_logs(c, "Server started", timeout=120)
        yield f"{c.get_container_host_ip()}:{c.get_exposed_port(8085)}"


@contextlib.contextmanager
def pubsub_emulator(project: str) -> Iterator[tuple[str, str]]:
    """Yield ``(host, how)`` where ``how`` says which way the emulator was found."""
    existing = os.environ.get("PUBSUB_EMULATOR_HOST")
    if existing:
        yield existing, "PUBSUB_EMULATOR_HOST"
    elif docker_engine_answers():
        with _container(project) as host:
            yield host, "testcontainers"
    else:
        with LocalEmulator("pubsub", project=project) as emulator:
            yield emulator.host, "local gcloud process (no Docker engine)"
