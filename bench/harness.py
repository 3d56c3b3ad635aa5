"""The benchmark's side of the emulator: fresh resources, a fast publisher, an outside observer,
and consumer processes (``bench.consumer``) started and read back.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from google.api_core import exceptions as gexc
from google.cloud import pubsub_v1
from google.pubsub_v1 import PubsubMessage

from bench.consumer import ACK_DEADLINE, JOB
from workerpool.config import Settings
from workerpool.ops.admin import ProvisionRequest, provision
from workerpool.pubsub import subscription_path, topic_path
from workerpool.testing.emulator import free_port

_PUBLISH_BATCH = 1000  # messages per Publish call
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Resources:
    project: str
    topic: str
    subscription: str
    dead_letter_topic: str
    run: str  # unique per run: job ids start with it, so no two runs share one

    @property
    def topic_path(self) -> str:
        return topic_path(self.project, self.topic)

    @property
    def subscription_path(self) -> str:
        return subscription_path(self.project, self.subscription)


def revision_tree(workdir: Path, ref: str) -> Path:
    """A directory under ``workdir`` for ``PYTHONPATH`` where ``workerpool`` (and the job
    plugins) are git revision ``ref``'s and ``bench`` is this one: the same consumer, the old
    worker."""
    tree = workdir / f"ref-{ref}"
    if not tree.exists():
        source = tree / "source"
        source.mkdir(parents=True)
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", ref, "workerpool", "jobs"],
            capture_output=True,
            check=True,
        )
        subprocess.run(["tar", "-x", "-C", str(source)], input=archive.stdout, check=True)
        for name in ("workerpool", "jobs"):
            (tree / name).symlink_to(source / name)
        (tree / "bench").symlink_to(ROOT / "bench")
    return tree


class Bench:
    def __init__(self, project: str, workdir: Path) -> None:
        self.project = project
        self.workdir = workdir
        self.publisher = pubsub_v1.PublisherClient()
        self.admin = pubsub_v1.SubscriberClient()
        # The observer is a client of its own, never a consumer's.
        self.observer = pubsub_v1.SubscriberClient()

    def tree(self, ref: str) -> Path:
        return revision_tree(self.workdir, ref)

    def close(self) -> None:
        self.observer.close()
        self.admin.close()
        self.publisher.stop()

    @contextlib.contextmanager
    def resources(self, label: str, ack_deadline: int = ACK_DEADLINE) -> Iterator[Resources]:
        """A topic and subscription for one run: ack deadline 60 s, no retry policy, and a
        dead-letter policy (workerpool needs its topic; it also sets ``delivery_attempt``)."""
        suffix = uuid.uuid4().hex[:6]
        res = Resources(
            self.project, f"t-{label}-{suffix}", f"s-{label}-{suffix}", f"d-{suffix}", suffix
        )
        provision(
            self.publisher,
            self.admin,
            ProvisionRequest(
                project=self.project,
                topic=res.topic,
                subscription=res.subscription,
                dead_letter_topic=res.dead_letter_topic,
                ack_deadline=ack_deadline,
                # The probes give messages back; stay far from the dead-letter limit.
                max_delivery_attempts=100,
                retry_policy=False,
            ),
        )
        try:
            yield res
        finally:
            self._delete(res)

    def _delete(self, res: Resources) -> None:
        subs = [
            res.subscription_path,
            subscription_path(self.project, f"{res.dead_letter_topic}-sub"),
        ]
        for sub in subs:
            with contextlib.suppress(gexc.GoogleAPICallError):
                self.admin.delete_subscription(request={"subscription": sub}, timeout=30)
        for topic in (res.topic_path, topic_path(self.project, res.dead_letter_topic)):
            with contextlib.suppress(gexc.GoogleAPICallError):
                self.publisher.delete_topic(request={"topic": topic}, timeout=30)

    def publish(self, res: Resources, count: int) -> list[str]:
        """``count`` jobs in Publish calls of 1,000 from four threads: the batching client's
        per-message futures made publishing the 200,000-message soak take minutes."""
        ids = [f"{res.run}-{i:07d}" for i in range(count)]
        batches = [ids[i : i + _PUBLISH_BATCH] for i in range(0, count, _PUBLISH_BATCH)]

        def send(batch: list[str]) -> None:
            messages = [
                PubsubMessage(data=b"{}", attributes={"job": JOB, "job_id": i}) for i in batch
            ]
            self.publisher.api.publish(topic=res.topic_path, messages=messages, timeout=60)

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(send, batches))
        return ids

    def pull(self, res: Resources, timeout: float) -> list[Any]:
        try:
            response = self.observer.pull(
                request={"subscription": res.subscription_path, "max_messages": 1000},
                timeout=timeout,
            )
        except gexc.DeadlineExceeded:
            return []
        return list(response.received_messages)

    def settle(self, res: Resources, received: list[Any], *, ack: bool) -> None:
        ack_ids = [r.ack_id for r in received]
        if not ack_ids:
            return
        if ack:
            self.observer.acknowledge(
                request={"subscription": res.subscription_path, "ack_ids": ack_ids}
            )
        else:
            self.observer.modify_ack_deadline(
                request={
                    "subscription": res.subscription_path,
                    "ack_ids": ack_ids,
                    "ack_deadline_seconds": 0,
                }
            )

    def probe_available(self, res: Resources, seconds: float) -> set[str]:
        """Job ids a second consumer can get within ``seconds``; each is given back at once,
        so what it cannot get is what the worker holds."""
        seen: set[str] = set()
        deadline = time.monotonic() + seconds
        while (remaining := deadline - time.monotonic()) > 0:
            received = self.pull(res, timeout=max(0.2, min(1.0, remaining)))
            self.settle(res, received, ack=False)
            ids = {job_id(r) for r in received}
            if not ids - seen:
                time.sleep(0.1)  # given-back messages come round again: walked the backlog
            seen |= ids
        return seen


class Collector:
    """Another replica: pulls and acks everything, noting when each job id first arrived."""

    def __init__(self, bench: Bench, res: Resources) -> None:
        self.seen: dict[str, float] = {}
        self._bench, self._res = bench, res
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            received = self._bench.pull(self._res, timeout=0.5)
            now = time.monotonic()
            for message in received:
                self.seen.setdefault(job_id(message), now)
            self._bench.settle(self._res, received, ack=True)
            if not received:
                self._stop.wait(0.01)  # an empty answer can come at once: do not spin

    def wait_for(self, ids: set[str], deadline: float) -> None:
        while ids - self.seen.keys() and time.monotonic() < deadline:
            time.sleep(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def job_id(received: Any) -> str:
    return str(received.message.attributes.get("job_id") or received.message.message_id)


class Consumer:
    """A ``bench.consumer`` process; its stdout says when the first job started."""

    running: ClassVar[set[Consumer]] = set()

    @classmethod
    def kill_all(cls) -> None:
        """For an interrupted bench: no consumer outlives it, pulling from a dead emulator."""
        for consumer in list(cls.running):
            consumer.process.kill()

    def __init__(
        self,
        bench: Bench,
        impl: str,
        res: Resources,
        *,
        n: int,
        expect: int,
        seconds: float = 0.0,
        sample_ms: float = 0.0,
        intervals: bool = False,
        rate_limit: str = "",
        ledger: bool = False,
    ) -> None:
        name = f"{impl}-{res.subscription}"
        self.report_path = bench.workdir / f"{name}.json"
        self.log_path = bench.workdir / f"{name}.log"
        command = [
            sys.executable,
            "-m",
            "bench.consumer",
            impl,
            f"--project={res.project}",
            f"--subscription={res.subscription}",
            f"--n={n}",
            f"--expect={expect}",
            f"--seconds={seconds}",
            f"--report={self.report_path}",
            f"--sample-ms={sample_ms}",
            f"--metrics-port={free_port()}",
            # workerpool's default prefetch, given explicitly so that a baseline revision runs
            # with the same one
            f"--prefetch={Settings(max_outstanding=n).held_beyond_n}",
        ]
        if intervals:
            command.append("--intervals")
        if rate_limit:
            command.append(f"--rate-limit={rate_limit}")
        if ledger:
            command.append(f"--ledger={bench.workdir / f'{name}.ledger.jsonl'}")
        self.first_start = threading.Event()
        self.first_start_at = 0.0  # the consumer's own clock reading; monotonic is system-wide
        self.exited = threading.Event()
        self.exited_at = 0.0
        _, at, ref = impl.partition("@")
        path = bench.tree(ref) if at else ROOT
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=log,
                cwd=bench.workdir,
                env={**os.environ, "PYTHONPATH": str(path)},
                text=True,
            )
        Consumer.running.add(self)
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("first-start"):
                self.first_start_at = float(line.split()[1])
                self.first_start.set()
        self.process.wait()
        self.exited_at = time.monotonic()
        Consumer.running.discard(self)
        self.exited.set()

    def terminate(self) -> float:
        self.process.terminate()
        return time.monotonic()

    def wait(self, timeout: float) -> dict[str, Any]:
        """The report, once the process has exited (asked to after ``timeout``); a
        RuntimeError naming the log if it wrote none."""
        if not self.exited.wait(timeout):
            # Stuck short of its count (lost acks, say): stop it, keep what it reports.
            self.terminate()
            if not self.exited.wait(60):
                self.process.kill()
                self.process.wait()
                raise RuntimeError(f"consumer ignored SIGTERM; see {self.log_path}")
        code = self.process.returncode
        if code != 0 or not self.report_path.exists():
            raise RuntimeError(f"consumer exited with {code}; see {self.log_path}")
        report: dict[str, Any] = json.loads(self.report_path.read_text())
        return report
