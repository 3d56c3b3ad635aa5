"""The Kubernetes actuator, with the official client (Configuration.host) against a local server
giving an API server's answers: no Kubernetes API is reachable here. The answers are the
autoscaling/v1 Scale, v1 PodList, v1 Pod and v1 Status objects an API server returns."""

from __future__ import annotations

import copy
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from tests.canned_api import Answer, CannedApi, Request
from tests.fakes import beat
from workerpool.autoscale import kubernetes as k8s_actuator
from workerpool.autoscale.kubernetes import KubernetesActuator
from workerpool.constants import ANNOTATION_POD_DELETION_COST
from workerpool.errors import ActuatorError, ConfigError

SCALE_PATH = "/apis/apps/v1/namespaces/jobs/deployments/workers/scale"
PODS_PATH = "/api/v1/namespaces/jobs/pods"
COST = ANNOTATION_POD_DELETION_COST


def scale_object(replicas: int) -> dict[str, Any]:
    return {
        "kind": "Scale",
        "apiVersion": "autoscaling/v1",
        "metadata": {
            "name": "workers",
            "namespace": "jobs",
            "uid": "0b7c6a9e-3c1f-4a57-9d7e-5f3c2b1a0e9d",
            "resourceVersion": "884211",
            "creationTimestamp": "2026-10-01T08:12:44Z",
        },
        "spec": {"replicas": replicas},
        "status": {"replicas": replicas, "selector": "app=workers"},
    }


def pod(name: str, cost: str | None = None, terminating: bool = False) -> dict[str, Any]:
    """A running, ready pod of the Deployment's ReplicaSet (``cost``: its annotation now)."""
    metadata: dict[str, Any] = {
        "name": name,
        "generateName": "workers-7d9c8b6f5d-",
        "namespace": "jobs",
        "uid": f"9f1e2d3c-{name[-5:]}-4b5a-8c7d-6e5f4a3b2c1d",
        "resourceVersion": "884102",
        "creationTimestamp": "2026-11-30T17:02:10Z",
        "labels": {"app": "workers", "pod-template-hash": "7d9c8b6f5d"},
        "ownerReferences": [{
            "apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "workers-7d9c8b6f5d",
            "uid": "2a4c6e8f-1b3d-4f5a-9c7e-0d2f4b6a8c1e", "controller": True,
            "blockOwnerDeletion": True,
        }],
    }  # fmt: skip
    if cost is not None:
        metadata["annotations"] = {COST: cost}
    if terminating:
        metadata["deletionTimestamp"] = "2026-12-01T09:00:00Z"
        metadata["deletionGracePeriodSeconds"] = 30
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": metadata,
        "spec": {
            "containers": [{
                "name": "worker",
                "image": "europe-west1-docker.pkg.dev/ads-prod/images/workerpool:1.4.2",
                "args": ["run", "--subscription", "jobs-sub", "--max-outstanding", "4"],
                "resources": {"limits": {"cpu": "1", "memory": "512Mi"}},
            }],
            "restartPolicy": "Always",
            "terminationGracePeriodSeconds": 30,
            "serviceAccountName": "workers",
            "nodeName": "gke-ads-prod-pool-1-3f6c2a51-x7kq",
        },
        "status": {
            "phase": "Running",
            "conditions": [
                {"type": "Ready", "status": "True", "lastTransitionTime": "2026-11-30T17:02:31Z"}
            ],
            "podIP": "10.12.3.17",
            "startTime": "2026-11-30T17:02:10Z",
        },
    }  # fmt: skip


class FakeApiServer:
    """The Deployment's scale subresource and its pods, patched as an API server would."""

    def __init__(self, replicas: int, pods: list[dict[str, Any]]) -> None:
        self.replicas = replicas
        self.pods = {p["metadata"]["name"]: p for p in pods}

    def __call__(self, request: Request) -> Answer:
        if request.path == SCALE_PATH and request.method == "GET":
            return 200, scale_object(self.replicas)
        if request.path == SCALE_PATH and request.method == "PATCH":
            self.replicas = request.body["spec"]["replicas"]
            return 200, scale_object(self.replicas)
        if request.path == PODS_PATH and request.method == "GET":
            assert request.query["labelSelector"] == "app=workers"
            items = list(self.pods.values())
            return 200, {"kind": "PodList", "apiVersion": "v1",
                         "metadata": {"resourceVersion": "884215"}, "items": items}  # fmt: skip
        name = request.path.removeprefix(PODS_PATH + "/")
        if request.method == "PATCH" and name in self.pods:
            patched = copy.deepcopy(self.pods[name])
            annotations = request.body["metadata"]["annotations"]
            patched["metadata"].setdefault("annotations", {}).update(annotations)
            self.pods[name] = patched
            return 200, patched
        return 404, status_object(404, "NotFound", f'pods "{name}" not found')


def status_object(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}  # fmt: skip


def api_client(url: str) -> Any:
    configuration = kubernetes.client.Configuration()
    configuration.host = url
    configuration.retries = 0  # as the actuator's in-cluster client has it
    return kubernetes.client.ApiClient(configuration)


def actuator(api: CannedApi, timeout: float = 5.0) -> KubernetesActuator:
    return KubernetesActuator("workers", "jobs", api_client=api_client(api.url), timeout=timeout)


PODS = ["workers-7d9c8b6f5d-abcde", "workers-7d9c8b6f5d-fghij", "workers-7d9c8b6f5d-klmno",
        "workers-7d9c8b6f5d-pqrst", "workers-7d9c8b6f5d-uvwxy"]  # fmt: skip


@pytest.fixture
def cluster() -> Iterator[tuple[FakeApiServer, CannedApi]]:
    pods = [pod(PODS[0]), pod(PODS[1], cost="2"), pod(PODS[2]), pod(PODS[3])]
    fake = FakeApiServer(4, [*pods, pod(PODS[4], terminating=True)])  # that one not counted
    with CannedApi(fake) as api:
        yield fake, api


def test_a_scale_in_ranks_the_pods_by_running_jobs_before_it_patches_the_scale(
    cluster: tuple[FakeApiServer, CannedApi],
) -> None:
    # Given 4 replicas: pod 0 running 4 jobs (in two worker processes), pod 1 running 2 (its
    # cost already 2), pod 2 one, pod 3 no beat (starting); and pod 4 terminating
    fake, api = cluster
    beats = [beat(PODS[0], 3), beat(PODS[0], 1), beat(PODS[1], 2), beat(PODS[2], 1)]
    beats.append(beat(PODS[4], 3, draining=True))
    # When the policy asks for 2
    line = actuator(api).scale(2, beats)
    # Then the pods whose cost changed are annotated first, then the scale is patched
    assert [(r.method, r.path) for r in api.requests] == [
        ("GET", SCALE_PATH),
        ("GET", PODS_PATH),
        ("PATCH", f"{PODS_PATH}/{PODS[0]}"),
        ("PATCH", f"{PODS_PATH}/{PODS[2]}"),
        ("PATCH", f"{PODS_PATH}/{PODS[3]}"),
        ("PATCH", SCALE_PATH),
    ]
    patches = api.requests[2:5]
    assert [r.body for r in patches] == [
        {"metadata": {"annotations": {COST: "4"}}},
        {"metadata": {"annotations": {COST: "1"}}},
        {"metadata": {"annotations": {COST: "0"}}},
    ]
    assert api.requests[-1].body == {"spec": {"replicas": 2}}
    # as strategic merge patches (a merge of the one annotation, the others kept)
    assert {r.content_type for r in api.requests if r.method == "PATCH"} == {
        "application/strategic-merge-patch+json"
    }
    assert fake.replicas == 2 and COST not in fake.pods[PODS[4]]["metadata"].get("annotations", {})
    # and the line says what the ReplicaSet is expected to remove: pods 3 and 2, 1 job
    assert line == (
        "Deployment jobs/workers: lowered from 4 to 2 replicas; pod-deletion-cost set on 3 of 4 "
        "pods; jobs running on the 2 to go: 1 (handed back by their drain)"
    )


def test_a_scale_out_or_no_change_touches_no_pod(cluster: tuple[FakeApiServer, CannedApi]) -> None:
    _, api = cluster
    assert actuator(api).scale(4, []) == "Deployment jobs/workers: 4 replicas, unchanged"
    assert actuator(api).scale(8, [beat(PODS[0], 4)]) == (
        "Deployment jobs/workers: raised from 4 to 8 replicas"
    )
    assert [(r.method, r.path) for r in api.requests] == [
        ("GET", SCALE_PATH),
        ("GET", SCALE_PATH),
        ("PATCH", SCALE_PATH),
    ]
    assert api.requests[-1].body == {"spec": {"replicas": 8}} and actuator(api).current() == 8


def test_a_refusal_is_one_line_with_what_to_check(cluster: tuple[FakeApiServer, CannedApi]) -> None:
    _, api = cluster
    forbidden = status_object(
        403,
        "Forbidden",
        'pods "workers-7d9c8b6f5d-abcde" is forbidden: User '
        '"system:serviceaccount:jobs:autoscaler" cannot patch resource "pods" in API group "" '
        'in the namespace "jobs"',
    )
    fake = api.answer
    api.answer = lambda r: (403, forbidden) if r.method == "PATCH" else fake(r)
    with pytest.raises(ActuatorError) as caught:
        actuator(api).scale(1, [beat(PODS[0], 4)])
    assert str(caught.value) == (
        f"Deployment jobs/workers: annotate pod {PODS[0]}: 403 Forbidden {forbidden['message']} "
        "(the service account needs get and patch on deployments/scale, list and patch on pods)"
    )
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
    assert not [r for r in api.requests if r.path == SCALE_PATH and r.method == "PATCH"]


def test_a_missing_deployment_or_a_silent_api_server_is_one_line() -> None:
    missing = status_object(404, "NotFound", 'deployments.apps "workers" not found')
    with CannedApi(lambda request: (404, missing)) as api, pytest.raises(ActuatorError) as caught:
        actuator(api).current()
    assert str(caught.value) == (
        'Deployment jobs/workers: read scale: 404 Not Found deployments.apps "workers" not '
        "found (no such Deployment in that namespace)"
    )

    def slow(request: Request) -> Answer:
        time.sleep(0.5)
        return 200, scale_object(1)

    with (
        CannedApi(slow) as api,
        pytest.raises(ActuatorError, match=r"read scale: no answer within 0.2 s$"),
    ):
        actuator(api, timeout=0.2).current()
    with CannedApi(slow) as closed:
        pass  # its port now refuses connections
    with pytest.raises(ActuatorError, match=r"read scale: cannot connect: .*Connection refused$"):
        actuator(closed).current()


def test_a_scale_without_a_pod_selector_annotates_nothing() -> None:
    # (a Deployment's always has one; without it the list would be the whole namespace's pods)
    bare = scale_object(3)
    del bare["status"]["selector"]
    with CannedApi(lambda request: (200, bare)) as api, pytest.raises(ActuatorError) as caught:
        actuator(api).scale(1, [])
    assert str(caught.value).endswith("its scale subresource names no pod selector")
    assert [r.method for r in api.requests] == ["GET"]


def test_outside_a_cluster_or_without_the_extra_it_says_what_is_missing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setattr(k8s_actuator, "NAMESPACE_FILE", tmp_path / "namespace")
    with pytest.raises(ConfigError, match="no in-cluster configuration"):
        KubernetesActuator("workers", "jobs")
    with pytest.raises(ConfigError, match="give the Deployment's namespace"):
        KubernetesActuator("workers", api_client=api_client("http://127.0.0.1:1"))
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"pip install 'workerpool\[kubernetes\]'"):
        KubernetesActuator("workers", "jobs")


REAL_DEPLOYMENT = os.environ.get("WORKERPOOL_TEST_KUBERNETES_DEPLOYMENT", "")


@pytest.mark.skipif(
    not REAL_DEPLOYMENT,
    reason="no Kubernetes API is reachable here; the Kubernetes actuator is tested against "
    "canned API server answers in tests/test_autoscale_kubernetes.py (set "
    "WORKERPOOL_TEST_KUBERNETES_DEPLOYMENT=NAMESPACE/NAME, with a kubeconfig allowed to get "
    "deployments/scale, to run this against a real cluster)",
)
def test_against_a_real_deployment_reads_and_keeps_its_count() -> None:
    namespace, name = REAL_DEPLOYMENT.split("/")
    client = kubernetes.config.new_client_from_config()
    deployment = KubernetesActuator(name, namespace, api_client=client)
    count = deployment.current()
    assert deployment.scale(count, []).endswith(f": {count} replicas, unchanged")
    deployment.close()
