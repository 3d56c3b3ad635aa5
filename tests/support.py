"""Test helpers around the emulator: fresh resources, publishing, reading dead letters."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workerpool.config import Settings
from workerpool.idempotency import IdempotencyStore
from workerpool.ops.admin import ProvisionRequest, provision, subscription_path, topic_path
from workerpool.registry import Registry
from workerpool.telemetry import Telemetry
from workerpool.worker.clients import Clients, publisher_client, subscriber_client
from workerpool.worker.launcher import Launcher


@dataclass
class Record:
    data: bytes
    attributes: dict[str, str]


class PubSubEnv:
    def __init__(self, project: str, host: str, test_name: str) -> None:
        self.project = project
        self.host = host
        suffix = uuid.uuid4().hex[:8]
        self.topic = f"t-{suffix}"
        self.subscription = f"s-{suffix}"
        self.dead_letter_topic = f"dlq-{suffix}"
        # Clients' channels: the library's emulator channel cannot receive over 4 MiB
        self.publisher = publisher_client()
        self.subscriber = subscriber_client()

    @property
    def topic_path(self) -> str:
        return topic_path(self.project, self.topic)

    @property
    def subscription_path(self) -> str:
        return subscription_path(self.project, self.subscription)

    @property
    def dead_letter_subscription_path(self) -> str:
        return subscription_path(self.project, f"{self.dead_letter_topic}-sub")

    def provision(self, **overrides: Any) -> None:
        request = {
            "project": self.project,
            "topic": self.topic,
            "subscription": self.subscription,
            "dead_letter_topic": self.dead_letter_topic,
            "ack_deadline": 10,
            "max_delivery_attempts": 20,
            "min_backoff": 1,
            "max_backoff": 10,
            **overrides,
        }
        provision(self.publisher, self.subscriber, ProvisionRequest(**request))

    def publish(self, job: str, data: Any = None, *, job_id: str = "", **attributes: str) -> str:
        body = json.dumps({} if data is None else data).encode()
        return self.publish_raw(
            body, {"job": job, **({"job_id": job_id} if job_id else {}), **attributes}
        )

    def publish_raw(self, data: bytes, attributes: dict[str, str]) -> str:
        message_id: str = self.publisher.publish(self.topic_path, data, **attributes).result(30)
        return message_id

    def publish_many(self, job: str, payloads: list[tuple[str, Any]]) -> None:
        futures = [
            self.publisher.publish(
                self.topic_path, json.dumps(data).encode(), job=job, job_id=job_id
            )
            for job_id, data in payloads
        ]
        for future in futures:
            future.result(30)

    def dead_letters(self, expected: int, timeout: float = 30.0) -> list[Record]:
        """Pull and ack failure records until ``expected`` arrived or ``timeout`` passed."""
        records: list[Record] = []
        deadline = time.monotonic() + timeout
        while len(records) < expected and time.monotonic() < deadline:
            response = self.subscriber.pull(
                request={"subscription": self.dead_letter_subscription_path, "max_messages": 100},
                timeout=10,
            )
            if not response.received_messages:
                time.sleep(0.2)
                continue
            self.subscriber.acknowledge(
                request={
                    "subscription": self.dead_letter_subscription_path,
                    "ack_ids": [m.ack_id for m in response.received_messages],
                }
            )
            records.extend(
                Record(bytes(m.message.data), dict(m.message.attributes))
                for m in response.received_messages
            )
        return records

    def settings(self, **overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "project": self.project,
            "subscription": self.subscription,
            "max_outstanding": 4,
            "min_backoff": 1.0,
            "max_backoff": 10.0,
            "drain_timeout": 10.0,
            "idempotency_store": "memory://",
            **overrides,
        }
        return Settings(**values).validate()

    @contextlib.contextmanager
    def worker(
        self,
        jobs: Registry,
        *,
        store: IdempotencyStore | None = None,
        telemetry: Telemetry | None = None,
        **overrides: Any,
    ) -> Iterator[Launcher]:
        settings = self.settings(**overrides)
        launcher = Launcher(
            settings, jobs=jobs, clients=Clients(), store=store, telemetry=telemetry
        ).start()
        try:
            yield launcher
        finally:
            launcher.stop(time.monotonic() + launcher.settings.drain_timeout)

    def close(self) -> None:
        self.subscriber.close()
        self.publisher.stop()


def http_get(url: str) -> tuple[int, str]:
    """(status, body) of a GET; (0, "") when nothing listens."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""  # not listening (yet, or any more)


def wait_for(predicate: Any, timeout: float, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` passes; return its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def worker_command(env: PubSubEnv, ledger: Path, *args: str, store: str = "") -> list[str]:
    """A ``workerpool run`` command on ``env``'s subscription, running jobs.demo. Workers of
    one test share an SQLite idempotency store beside the ledger unless ``store`` names
    another."""
    store = store or f"sqlite:///{ledger.parent / 'claims.db'}"
    return [
        sys.executable, "-m", "workerpool", "run",
        "--project", env.project,
        "--subscription", env.subscription,
        "--jobs", "jobs.demo",
        "--min-backoff", "1",
        "--idempotency-store", store,
        *args,
    ]  # fmt: skip


@dataclass
class WorkerProcess:
    """A real worker process whose output goes to a file (a pipe nobody reads could fill up)."""

    process: subprocess.Popen[bytes]
    log: Path
    launched: float  # time.time() just before the process was started

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def ready(self) -> bool:
        """The worker has started its puller (the launcher logs "pulling" then)."""
        return " pulling " in self.output()

    def alive(self) -> bool:
        return self.process.poll() is None

    def signal(self, signum: int) -> float:
        """Send ``signum``; return the monotonic time it was sent."""
        self.process.send_signal(signum)
        return time.monotonic()

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout)

    def kill(self) -> None:
        """SIGKILL the process if it still runs, and reap it."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)


def spawn_worker(
    env: PubSubEnv,
    ledger: Path,
    *args: str,
    store: str = "",
    extra_env: dict[str, str] | None = None,
    starts: bool = True,
) -> WorkerProcess:
    """Like ``start_worker``, but the output goes to a log file beside the ledger, ``extra_env``
    is added to the environment, and (``starts``) jobs.demo also writes "start" ledger lines."""
    log = ledger.parent / f"worker-{uuid.uuid4().hex[:8]}.log"
    environment = {
        **os.environ,
        "PUBSUB_EMULATOR_HOST": env.host,
        "WORKERPOOL_DEMO_LEDGER": str(ledger),
        "WORKERPOOL_DEMO_LEDGER_STARTS": "1" if starts else "0",
        **(extra_env or {}),
    }
    launched = time.time()
    with open(log, "wb") as out:
        process = subprocess.Popen(
            worker_command(env, ledger, *args, store=store),
            env=environment,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return WorkerProcess(process, log, launched)


@contextlib.contextmanager
def worker_processes() -> Iterator[list[WorkerProcess]]:
    """Collects the workers a test spawns; any still alive at the end is SIGKILLed."""
    workers: list[WorkerProcess] = []
    try:
        yield workers
    finally:
        for worker in workers:
            with contextlib.suppress(Exception):
                worker.kill()


def read_ledger(path: Path) -> list[dict[str, Any]]:
    """The ledger jobs.demo writes; for one still being written, a last line without its
    newline yet is left out rather than parsed half-written."""
    if not path.exists():
        return []
    text = path.read_text()
    complete = text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]


def ledger_events(path: Path, outcome: str, pid: int | None = None) -> list[dict[str, Any]]:
    """Ledger lines with ``outcome`` ("start", "done", "cancelled", ...), of ``pid`` if given."""
    return [
        r for r in read_ledger(path) if r["outcome"] == outcome and (pid is None or r["pid"] == pid)
    ]
