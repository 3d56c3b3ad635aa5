"""``workerpool autoscale --actuator keda`` on the Pub/Sub emulator: KEDA's side of the wire (a
real gRPC client, as KEDA's external-push trigger) sees a fleet at zero wake on one message."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc  # type: ignore[import-untyped,unused-ignore]

from tests.support import wait_for
from workerpool.autoscale import externalscaler_pb2 as pb
from workerpool.autoscale import externalscaler_pb2_grpc as pb_grpc
from workerpool.constants import KEDA_METRIC
from workerpool.testing.emulator import free_port
from workerpool.testing.pubsub import PubSubResources


def test_keda_is_pushed_active_and_one_replica_when_a_message_waits(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given the autoscaler serving KEDA's external scaler, and an idle subscription
    pubsub_resources.provision(retry_policy=False)
    port, log = free_port(), tmp_path / "autoscale.log"
    command = [
        sys.executable, "-m", "workerpool", "autoscale", "--actuator", "keda",
        "--keda-address", f"127.0.0.1:{port}",
        "--project", pubsub_resources.project, "--subscription", pubsub_resources.subscription,
        "--idempotency-store", f"sqlite:///{tmp_path / 'fleet.db'}", "--interval", "0.5",
    ]  # fmt: skip
    env = {**os.environ, "PUBSUB_EMULATOR_HOST": pubsub_resources.host}
    with open(log, "wb") as out:
        scaler = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    pushed: queue.Queue[tuple[float, bool]] = queue.Queue()
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        keda = pb_grpc.ExternalScalerStub(channel)
        ref = pb.ScaledObjectRef(name="workers", namespace="jobs")

        def answered() -> bool:
            try:
                keda.IsActive(ref, timeout=2)
            except grpc.RpcError:
                return False  # not listening yet, or no decision yet
            return True

        assert wait_for(answered, timeout=30), log.read_text()
        stream = keda.StreamIsActive(ref)

        def listen() -> None:
            try:
                for response in stream:
                    pushed.put((time.time(), response.result))
            except grpc.RpcError:
                pass  # cancelled at the end

        threading.Thread(target=listen, daemon=True).start()
        first = pushed.get(timeout=10)
        idle_metric = keda.GetMetrics(
            pb.GetMetricsRequest(scaledObjectRef=ref, metricName=KEDA_METRIC)
        )
        # When one message is published
        published = time.time()
        pubsub_resources.publish("demo.sleep", {"seconds": 0.1}, job_id="wake")
        woke = pushed.get(timeout=15)
        busy_metric = keda.GetMetrics(
            pb.GetMetricsRequest(scaledObjectRef=ref, metricName=KEDA_METRIC)
        )
        stream.cancel()
        scaler.send_signal(signal.SIGTERM)
        code = scaler.wait(30)
    finally:
        if scaler.poll() is None:
            scaler.kill()
    print(f"\nKEDA pushed active {woke[0] - published:.2f}s after the publish")
    # Then KEDA was told inactive and 0 replicas while idle, then pushed active within a few
    # seconds of the message, and asked for 1 replica; the autoscaler exits cleanly
    assert first[1] is False
    assert [v.metricValue for v in idle_metric.metricValues] == [0]
    assert woke[1] is True and woke[0] - published <= 5.0
    assert [v.metricValue for v in busy_metric.metricValues] == [1]
    assert code == 0, log.read_text()[-2000:]
