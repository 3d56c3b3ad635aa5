"""The Cloud Run worker pool actuator, with google-auth's AuthorizedSession (anonymous
credentials) against a local server giving the Cloud Run Admin API v2's answers: no Google API
is reachable here. The answers are shaped as the API's own (WorkerPool, Operation, and its
error body) from google/cloud/run/v2/worker_pool.proto and the REST reference."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
from google.auth.credentials import AnonymousCredentials
from google.auth.transport.requests import AuthorizedSession

from tests.canned_api import Answer, CannedApi, Request
from tests.fakes import beat
from workerpool.autoscale.cloudrun import CloudRunActuator
from workerpool.errors import ActuatorError, ConfigError

POOL = "projects/ads-prod/locations/europe-west1/workerPools/jobs-workers"
PATH = f"/v2/{POOL}"


def worker_pool(count: int | None) -> dict[str, Any]:
    """A WorkerPool as workerPools.get returns it (scaling is absent until a count is set)."""
    revision = f"{POOL}/revisions/jobs-workers-00004-kix"
    return {
        "name": POOL,
        "uid": "5c1b0f8e-9a43-4f5e-8b7d-0c2f3e4a5b6c",
        "generation": "4",
        "createTime": "2026-10-01T08:12:44.123456Z",
        "updateTime": "2026-11-30T17:02:10.654321Z",
        "creator": "deployer@ads-prod.iam.gserviceaccount.com",
        "lastModifier": "autoscaler@ads-prod.iam.gserviceaccount.com",
        "launchStage": "GA",
        "template": {
            "serviceAccount": "workers@ads-prod.iam.gserviceaccount.com",
            "containers": [{
                "image": "europe-west1-docker.pkg.dev/ads-prod/images/workerpool:1.4.2",
                "args": ["run", "--subscription", "jobs-sub", "--max-outstanding", "4"],
                "resources": {"limits": {"cpu": "1", "memory": "512Mi"}},
            }],
        },
        "instanceSplits": [{"type": "INSTANCE_SPLIT_ALLOCATION_TYPE_LATEST", "percent": 100}],
        **({"scaling": {"manualInstanceCount": count}} if count is not None else {}),
        "observedGeneration": "4",
        "terminalCondition": {
            "type": "Ready",
            "state": "CONDITION_SUCCEEDED",
            "lastTransitionTime": "2026-11-30T17:02:31.009876Z",
        },
        "latestReadyRevision": revision,
        "latestCreatedRevision": revision,
        "instanceSplitStatuses": [
            {"type": "INSTANCE_SPLIT_ALLOCATION_TYPE_LATEST", "percent": 100}
        ],
        "etag": '"CLrF4L0GEOD2+OYC/cHJvamVjdHMvYWRzLXByb2Q"',
    }  # fmt: skip


def api_error(code: int, status: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "status": status}}


class FakeRunApi:
    """workerPools.get and workerPools.patch (scaling.manualInstanceCount only) on one pool."""

    def __init__(self, count: int | None) -> None:
        self.count = count

    def __call__(self, request: Request) -> Answer:
        if request.path != PATH:
            return 404, api_error(404, "NOT_FOUND", f"Resource '{request.path}' not found.")
        if request.method == "GET":
            return 200, worker_pool(self.count)
        assert request.method == "PATCH" and request.query == {
            "updateMask": "scaling.manualInstanceCount"
        }
        self.count = request.body["scaling"]["manualInstanceCount"]
        operation = f"projects/ads-prod/locations/europe-west1/operations/{'3f6c2a51' * 4}"
        metadata = {"@type": "type.googleapis.com/google.cloud.run.v2.WorkerPool"}
        return 200, {"name": operation, "metadata": {**metadata, **worker_pool(self.count)}}


def one_line(error: BaseException) -> bool:
    """Logged, it is its own line: no chained exception ("During handling of ...") under it."""
    return error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)


def session() -> AuthorizedSession:
    return AuthorizedSession(AnonymousCredentials())  # type: ignore[no-untyped-call]


@pytest.fixture
def run_api() -> Iterator[tuple[FakeRunApi, CannedApi]]:
    fake = FakeRunApi(count=None)
    with CannedApi(fake) as api:
        yield fake, api


def actuator(api: CannedApi, timeout: float = 5.0) -> CloudRunActuator:
    return CloudRunActuator(POOL, session=session(), endpoint=api.url, timeout=timeout)


def test_current_reads_the_manual_instance_count(run_api: tuple[FakeRunApi, CannedApi]) -> None:
    fake, api = run_api
    assert actuator(api).current() == 0  # never set: the field is absent
    fake.count = 3
    assert actuator(api).current() == 3
    assert [(r.method, r.path) for r in api.requests] == [("GET", PATH)] * 2


def test_a_higher_count_is_set_at_once_whatever_runs(run_api: tuple[FakeRunApi, CannedApi]) -> None:
    fake, api = run_api
    fake.count = 2
    line = actuator(api).scale(5, [beat("a", 4), beat("b", 4)])
    assert line == "Cloud Run worker pool jobs-workers: raised from 2 to 5 instances"
    get, patch = api.requests
    assert (get.method, get.path) == ("GET", PATH)
    assert (patch.method, patch.path, patch.query) == (
        "PATCH",
        PATH,
        {"updateMask": "scaling.manualInstanceCount"},
    )
    assert patch.content_type == "application/json"
    assert patch.body == {"scaling": {"manualInstanceCount": 5}}
    assert fake.count == 5


def test_a_lower_count_is_set_when_the_running_jobs_fit_the_replicas_left(
    run_api: tuple[FakeRunApi, CannedApi],
) -> None:
    # 5 replicas of 4 slots running 1 + 3 + 0 + 0 + 0 jobs: 4 jobs fit in 1 replica
    fake, api = run_api
    fake.count = 5
    beats = [beat("a", 1), beat("b", 3), beat("c", 0), beat("d", 0), beat("e", 0)]
    assert actuator(api).scale(1, beats) == (
        "Cloud Run worker pool jobs-workers: lowered from 5 to 1 instances"
    )
    assert api.requests[-1].body == {"scaling": {"manualInstanceCount": 1}}


def test_a_lower_count_stops_where_the_running_jobs_would_no_longer_fit(
    run_api: tuple[FakeRunApi, CannedApi],
) -> None:
    # Given 5 replicas of 4 slots running 11 jobs (one replica draining, its 2 jobs counted)
    fake, api = run_api
    fake.count = 5
    beats = [beat("a", 4), beat("b", 3), beat("c", 2), beat("d", 0), beat("e", 2, draining=True)]
    # When the policy asks for 1, Then the count goes to 3 only: 11 jobs need 3 x 4 slots
    line = actuator(api).scale(1, beats)
    assert line == (
        "Cloud Run worker pool jobs-workers: lowered from 5 to 3 instances, not 1: 11 jobs "
        "running need 3 replicas of 4 slots (Cloud Run picks the instances it stops)"
    )
    assert api.requests[-1].body == {"scaling": {"manualInstanceCount": 3}}
    # and when no replica can go yet, nothing is sent but the read
    api.requests.clear()
    line = actuator(api).scale(1, [beat("a", 4), beat("b", 4), beat("c", 1)])
    assert line.endswith("kept 3 instances, not 1: 9 jobs running need 3 replicas of 4 slots "
                         "(Cloud Run picks the instances it stops)")  # fmt: skip
    assert [r.method for r in api.requests] == ["GET"] and fake.count == 3
    # replicas of two sizes (a deploy changing --max-outstanding): the smaller one is assumed
    line = actuator(api).scale(1, [beat("a", 8, slots=8), beat("b", 8, slots=8), beat("c", 9)])
    assert "kept 3 instances, not 1: 25 jobs running need 7 replicas of 4 slots" in line


def test_the_same_count_sends_no_update(run_api: tuple[FakeRunApi, CannedApi]) -> None:
    fake, api = run_api
    fake.count = 2
    assert actuator(api).scale(2, []).endswith(": 2 instances, unchanged")
    assert [r.method for r in api.requests] == ["GET"]


DENIED = (
    f"Permission 'run.workerpools.get' denied on resource '{POOL}' (or resource may not exist)."
)
MISSING = (
    "Resource 'jobs-workers' of kind 'WORKER_POOL' in region 'europe-west1' in project "
    "'ads-prod' does not exist."
)
DOWN = "The service is currently unavailable."


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (
            403,
            api_error(403, "PERMISSION_DENIED", DENIED),
            f"403 PERMISSION_DENIED {DENIED} (the autoscaler's identity needs "
            "run.workerpools.get and run.workerpools.update)",
        ),
        (
            404,
            api_error(404, "NOT_FOUND", MISSING),
            f"404 NOT_FOUND {MISSING} (no such worker pool: check its project, region and name)",
        ),
        (503, api_error(503, "UNAVAILABLE", DOWN), f"503 UNAVAILABLE {DOWN}"),
        (
            502,
            b"<html><body>502 Bad Gateway</body></html>",
            "502",
        ),  # a proxy's page, not the API's JSON
    ],
)
def test_a_refusal_is_one_line_naming_the_pool_and_the_answer(
    status: int, body: Any, expected: str
) -> None:
    with CannedApi(lambda request: (status, body)) as api, pytest.raises(ActuatorError) as caught:
        actuator(api).scale(3, [])
    assert str(caught.value) == f"Cloud Run worker pool {POOL}: read: {expected}"
    assert one_line(caught.value)


def test_an_update_refused_after_the_read_says_so(run_api: tuple[FakeRunApi, CannedApi]) -> None:
    fake, api = run_api
    fake.count = 1
    denied = api_error(403, "PERMISSION_DENIED", "Permission 'run.workerpools.update' denied.")
    api.answer = lambda r: (200, worker_pool(1)) if r.method == "GET" else (403, denied)
    with pytest.raises(ActuatorError, match=r"jobs-workers: update: 403 PERMISSION_DENIED"):
        actuator(api).scale(4, [])


def test_a_silent_or_absent_api_is_one_line_too() -> None:
    def slow(request: Request) -> Answer:
        time.sleep(0.5)
        return 200, worker_pool(1)

    with CannedApi(slow) as api, pytest.raises(ActuatorError) as caught:
        actuator(api, timeout=0.2).current()
    assert str(caught.value) == f"Cloud Run worker pool {POOL}: read: no answer within 0.2 s"
    assert one_line(caught.value)
    with CannedApi(slow) as closed:
        pass  # its port now refuses connections
    with pytest.raises(ActuatorError, match=r"read: cannot connect: .*Connection refused$"):
        actuator(closed).current()


def test_a_worker_pool_name_not_in_its_full_form_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="projects/PROJECT/locations/REGION/workerPools/NAME"):
        CloudRunActuator("jobs-workers", session=session())


REAL_POOL = os.environ.get("WORKERPOOL_TEST_CLOUD_RUN_POOL", "")


@pytest.mark.skipif(
    not REAL_POOL,
    reason="no Google API is reachable here; the Cloud Run actuator is tested against canned "
    "Cloud Run Admin API answers in tests/test_autoscale_cloudrun.py (set "
    "WORKERPOOL_TEST_CLOUD_RUN_POOL=projects/P/locations/REGION/workerPools/NAME, with "
    "credentials allowed run.workerpools.get and update, to run this against a real pool)",
)
def test_against_a_real_worker_pool_reads_and_keeps_its_count() -> None:
    pool = CloudRunActuator(REAL_POOL)
    count = pool.current()
    assert pool.scale(count, []).endswith(f": {count} instances, unchanged")
    pool.close()
