"""Scale a Kubernetes Deployment through its scale subresource, with the official client
(``pip install 'workerpool[kubernetes]'``) and the pod's service account (in-cluster config).

    GET   /apis/apps/v1/namespaces/NS/deployments/NAME/scale -> spec.replicas, status.selector
    GET   /api/v1/namespaces/NS/pods?labelSelector=SELECTOR -> the Deployment's pods
    PATCH /api/v1/namespaces/NS/pods/POD          {"metadata": {"annotations": {COST: "N"}}}
    PATCH /apis/apps/v1/namespaces/NS/deployments/NAME/scale  {"spec": {"replicas": N}}

Before a scale-in, each pod of the Deployment gets the annotation
``controller.kubernetes.io/pod-deletion-cost`` = the jobs its replica runs now (the beat whose
host is the pod's name; a pod without one costs 0): the ReplicaSet removes the pods of lowest
cost first, so idle pods go and the busiest stay. The cost is a snapshot: a job that starts on a
pod after it is taken goes back through the pod's drain (keep the pod's
terminationGracePeriodSeconds above the worker's --drain-timeout). Pods already terminating are
left alone, and a pod whose cost is already right is not patched again.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import urllib3

from workerpool.autoscale.actuator import Actuator, Beat
from workerpool.constants import ANNOTATION_POD_DELETION_COST
from workerpool.errors import ActuatorError, ConfigError

# Where a pod finds the namespace of its service account.
NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
# What an operator can do about a refusal, by HTTP status.
_HINTS = {
    403: "the service account needs get and patch on deployments/scale, list and patch on pods",
    404: "no such Deployment in that namespace",
}


def _client_module() -> Any:
    try:
        import kubernetes
    except ImportError:
        raise ConfigError(
            "the Kubernetes actuator needs the kubernetes client: "
            "pip install 'workerpool[kubernetes]'"
        ) from None
    return kubernetes


def _in_cluster_client() -> Any:
    kubernetes = _client_module()
    configuration = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=configuration)
    except kubernetes.config.ConfigException as exc:
        raise ConfigError(f"Kubernetes actuator: no in-cluster configuration: {exc}") from None
    # No retries inside a call: the autoscaler's next decision is the retry, so a call that
    # fails does so within its timeout rather than four times it.
    configuration.retries = 0
    return kubernetes.client.ApiClient(configuration)


def _own_namespace() -> str:
    try:
        return NAMESPACE_FILE.read_text().strip()
    except OSError:
        raise ConfigError(
            f"Kubernetes actuator: give the Deployment's namespace ({NAMESPACE_FILE} is not there)"
        ) from None


class KubernetesActuator(Actuator):
    """``deployment`` in ``namespace`` (default: the pod's own). ``api_client``: a
    ``kubernetes.client.ApiClient`` (default: in-cluster configuration)."""

    name = "kubernetes"

    def __init__(
        self,
        deployment: str,
        namespace: str | None = None,
        *,
        api_client: Any = None,
        timeout: float = 10.0,
    ) -> None:
        kubernetes = _client_module()
        self.deployment = deployment
        self.namespace = namespace or _own_namespace()
        self._api_client = api_client or _in_cluster_client()
        self._apps = kubernetes.client.AppsV1Api(self._api_client)
        self._core = kubernetes.client.CoreV1Api(self._api_client)
        self._api_error = kubernetes.client.ApiException
        self._timeout = timeout
        self._where = f"Deployment {self.namespace}/{deployment}"

    def current(self) -> int:
        return int(self._read_scale().spec.replicas or 0)

    def scale(self, desired: int, beats: Sequence[Beat]) -> str:
        scale = self._read_scale()
        now = int(scale.spec.replicas or 0)
        if desired == now:
            return f"{self._where}: {now} replicas, unchanged"
        verb = "raised" if desired > now else "lowered"
        line = f"{self._where}: {verb} from {now} to {desired} replicas"
        if desired < now:
            line += self._rank_pods(scale.status.selector, now - desired, beats)
        patch = self._apps.patch_namespaced_deployment_scale
        self._call(
            "patch scale", patch, self.deployment, self.namespace, {"spec": {"replicas": desired}}
        )
        return line

    def close(self) -> None:
        self._api_client.close()

    def _read_scale(self) -> Any:
        read = self._apps.read_namespaced_deployment_scale
        return self._call("read scale", read, self.deployment, self.namespace)

    def _rank_pods(self, selector: str, leaving: int, beats: Sequence[Beat]) -> str:
        """Set each live pod's deletion cost to its running jobs; say what the ``leaving``
        pods of lowest cost run."""
        if not selector:  # without one, the list would be every pod of the namespace
            raise ActuatorError(f"{self._where}: its scale subresource names no pod selector")
        listed = self._call(
            "list pods", self._core.list_namespaced_pod, self.namespace, label_selector=selector
        )
        running: Counter[str] = Counter()
        for beat in beats:  # a pod may run several worker processes, each with its beat
            running[beat.host] += beat.running
        pods = [pod for pod in listed.items if pod.metadata.deletion_timestamp is None]
        costs = {pod.metadata.name: running[pod.metadata.name] for pod in pods}
        patched = 0
        for pod in pods:
            name, cost = pod.metadata.name, str(costs[pod.metadata.name])
            if (pod.metadata.annotations or {}).get(ANNOTATION_POD_DELETION_COST) != cost:
                body = {"metadata": {"annotations": {ANNOTATION_POD_DELETION_COST: cost}}}
                patch = self._core.patch_namespaced_pod
                self._call(f"annotate pod {name}", patch, name, self.namespace, body)
                patched += 1
        lost = sum(sorted(costs.values())[:leaving])
        return (
            f"; pod-deletion-cost set on {patched} of {len(pods)} pods; jobs running on the "
            f"{leaving} to go: {lost} (handed back by their drain)"
        )

    def _call(self, verb: str, method: Any, *args: Any, **kwargs: Any) -> Any:
        """The API's answer; any failure is one ActuatorError line (no chained trace)."""
        # (connect, read): kubernetes 31's client ignores a timeout given as one float.
        timeout = (self._timeout, self._timeout)
        try:
            return method(*args, _request_timeout=timeout, **kwargs)
        except urllib3.exceptions.HTTPError as exc:
            raise ActuatorError(f"{self._where}: {verb}: {self._no_answer(exc)}") from None
        except self._api_error as exc:
            raise ActuatorError(f"{self._where}: {verb}: {_refusal(exc)}") from None

    def _no_answer(self, exc: urllib3.exceptions.HTTPError) -> str:
        error: Exception = exc
        if isinstance(exc, urllib3.exceptions.MaxRetryError) and exc.reason:
            error = exc.reason  # with retries off, the one error behind urllib3's wrapper
        # A refused connection is a NewConnectionError, which urllib3 derives from its timeouts.
        silent = isinstance(error, urllib3.exceptions.TimeoutError)
        if silent and not isinstance(error, urllib3.exceptions.NewConnectionError):
            return f"no answer within {self._timeout:g} s"
        return f"cannot connect: {error}"


def _refusal(exc: Any) -> str:
    """An ApiException: its status, reason, and the API server's Status message."""
    status = exc.status
    try:
        answer = json.loads(exc.body or "{}")
    except ValueError:  # not the API server's JSON: a proxy's page
        answer = None
    message = answer.get("message", "") if isinstance(answer, dict) else ""
    text = " ".join(f"{status} {exc.reason or ''} {message}".split())
    hint = _HINTS.get(status)
    return text + (f" ({hint})" if hint else "")
