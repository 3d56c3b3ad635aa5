"""The dashboard's pages over in-process stores (what each page reads and how it shows it),
the CSRF and confirmation rules of its actions, and the store counts its chart draws."""

from __future__ import annotations

import importlib
import re
import sys
import time
import warnings
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Mount
from starlette.testclient import TestClient

from tests.support import split_key_in_use
from workerpool.batches import MemoryBatches
from workerpool.config import Settings
from workerpool.dashboard import app as dashboard_app
from workerpool.dashboard import create_app
from workerpool.dashboard.chart import NOT_COUNTED
from workerpool.dashboard.command import parse_bind
from workerpool.dashboard.letters import Selection
from workerpool.dashboard.stores import Openers
from workerpool.errors import ConfigError
from workerpool.heartbeats import Beat, MemoryHeartbeats
from workerpool.idempotency import MemoryStore, SqliteStore
from workerpool.leadership import MemoryLeadership, Noted
from workerpool.ops.dlq import FailureRecord
from workerpool.progress import MemoryJobState, Report
from workerpool.schedule import Entry, MemorySchedule
from workerpool.slots import MemorySlots
from workerpool.slots.allocation import ShareAsk, lease_shares

SUBSCRIPTION = "projects/p/subscriptions/jobs"
TOKEN = "sesame"


def _no_backlog(subscription: str) -> list[tuple[str, str]]:
    return [("backlog", "unknown here")]


@pytest.fixture
def client() -> TestClient:
    now = time.time()
    beats, slots = MemoryHeartbeats(), MemorySlots()
    beats.beat(Beat("host-1-abc", SUBSCRIPTION, "host", 1, 8, 3, 2, 1.0, False, False,
                    now - 1, now + 30))  # fmt: skip
    slots.acquire("exports", "host-1-abc", 2, 30.0)
    # A key leased in bulk: two replicas' shares of its 10 slots
    lease_shares(slots, [ShareAsk("reports", "host-1-abc", 10, 0, 6)], 30.0)
    lease_shares(slots, [ShareAsk("reports", "host-2-def", 10, 0, 2)], 30.0)
    batches, schedule, done = MemoryBatches(), MemorySchedule(), MemoryStore()
    batches.create("b-1", "projects/p/topics/jobs", "done.job", ["c-1", "c-2"], now + 600)
    batches.commit("b-1")
    batches.record("b-1", "c-1", True)
    schedule.add(Entry("projects/p/topics/jobs", "later-1", now + 3600, b"{}", {"job": "j.x"}))
    done.claim("j-1", "w", "m-1", 30.0)
    done.complete("j-1", "w", "m-1")
    done.count_failed(2)  # two runs failed
    lead = MemoryLeadership()
    lead.note(SUBSCRIPTION, Noted(now - 60, 0, 2, "waiting 12", "<b>12 waiting</b>", "started 2"))
    lead.note(SUBSCRIPTION, Noted(now, 2, 1, "waiting 0", "idle", "stopped 1"))
    progress = MemoryJobState()
    progress.report([Report("host-1-abc/run-1", "j.export", "run-1", "host-1-abc", now - 5, 57,
                            100, "<b>row</b> 57", now, now + 30)])  # fmt: skip
    openers = Openers(
        heartbeats=lambda: beats, slots=lambda: slots, batches=lambda: batches,
        schedule=lambda: schedule, completions=lambda: done, leadership=lambda: lead,
        progress=lambda: progress,
    )  # fmt: skip
    settings = Settings(project="p", subscription="jobs", concurrency={"exports": 2, "reports": 10},
                        concurrency_leases={"reports": "bulk"})  # fmt: skip
    app = create_app(settings, openers=openers, dead_letter_subscription="dlq-sub", token=TOKEN)
    return TestClient(app)


@pytest.fixture(autouse=True)
def _emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    # The backlog is then "unavailable on the emulator", said without asking Cloud Monitoring.
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", "localhost:1")


def test_overview_shows_each_replica_and_the_chart_without_any_script(client: TestClient) -> None:
    page = client.get("/").text
    assert '<td class="running">3</td>' in page
    assert '<td class="held">2</td>' in page
    assert '<td class="free">5</td>' in page
    assert "unavailable on the emulator" in page
    assert '<img id="jobs-chart" src="http://testserver/chart/jobs.svg"' in page
    chart = client.get("/chart/jobs.svg")
    assert chart.headers["content-type"] == "image/svg+xml" and "<svg" in chart.text
    # a bar a minute for the last hour: the job done and the two failed runs, this minute
    done, failed = chart_series(chart.text)
    assert done == [0] * 59 + [1] and failed == [0] * 59 + [2]
    assert not re.findall(r"(?:src|href)=\"(?:https?:)?//", chart.text)  # loads nothing
    # The page's only script is its own, served by the app: nothing from the internet.
    assert page.count("<script") == 1
    assert 'src="http://testserver/static/live.js"' in page
    assert client.get("/static/live.js").status_code == 200
    fragment = client.get("/?fragment=1").text
    assert '<td class="running">3</td>' in fragment and "<nav>" not in fragment


def test_keys_batches_and_schedules_pages(client: TestClient) -> None:
    keys = client.get("/keys").text
    assert '<td class="holders">1<br>host-1-abc (token 1,' in keys
    # and each replica's share of the key leased in bulk
    shares = re.findall(r'<span data-replica="([^"]+)">[^:]+: (\d+) \(wants (\d+),', keys)
    assert shares == [("host-1-abc", "6", "6"), ("host-2-def", "2", "2")]
    assert '<td class="shares">8 in shares<br>' in keys
    batches = client.get("/batches").text
    assert "50%" in batches and "<td>c-2</td>" in batches and "open" in batches
    schedules = client.get("/schedules").text
    assert "later-1" in schedules and "j.x" in schedules
    assert client.get("/nowhere").status_code == 404


def test_the_keys_page_shows_a_split_key_once_with_its_shards_and_their_shares() -> None:
    # Given "tenant:*" = "20/bulk/2" with tenant:a in use by w1 (shard 0) and w4 (shard 1)
    slots = MemorySlots()
    split_key_in_use(slots, "tenant:a", {"w1": 3, "w4": 4})
    settings = Settings(project="p", subscription="jobs", concurrency={"tenant:*": 20},
                        concurrency_leases={"tenant:*": "bulk"},
                        concurrency_shards={"tenant:*": 2})  # fmt: skip
    app = create_app(settings, openers=Openers(slots=lambda: slots), token=TOKEN)
    # When the Keys page is read
    keys = TestClient(app).get("/keys").text
    # Then tenant:a is one row (no row of its shard records), its shards in it, each with
    # its part and the shares of the replicas writing it
    assert re.findall(r'<tr data-key="([^"]+)">', keys) == ["tenant:a"]
    shard = (r'<div class="shard" data-shard="(\d)">#\d: part (\d+), (\d+) in shares'
             r'<br><span data-replica="(\w+)">\w+: (\d+) \(wants (\d+),')  # fmt: skip
    shards = re.findall(shard, keys)
    assert shards == [("0", "10", "3", "w1", "3", "3"), ("1", "10", "4", "w4", "4", "4")]


def test_the_keys_page_shows_a_patterns_first_keys_and_how_many_more_there_are() -> None:
    # Given "tenant:*" with 150 keys ever used (their records stay once let go)
    slots = MemorySlots()
    for i in range(150):
        slots.acquire(f"tenant:{i:03d}", "w1", 1, 30.0)
        slots.release(f"tenant:{i:03d}", "w1", held_for=1.0, limit=1, ttl=30.0)
    settings = Settings(project="p", subscription="jobs", concurrency={"tenant:*": 1})
    app = create_app(settings, openers=Openers(slots=lambda: slots), token=TOKEN)
    # When the Keys page is read, Then it shows the first 100 and says 50 more are not shown
    keys = TestClient(app).get("/keys?fragment=1").text
    assert len(re.findall(r'<tr data-key="', keys)) == 100
    assert '<tr data-key="tenant:099">' in keys and "tenant:100" not in keys
    assert "tenant:*: 50 more key(s), not shown (the first 100 in key order are)" in keys


def test_the_autoscaler_page_shows_its_decisions_newest_first_as_text(
    client: TestClient,
) -> None:
    page = client.get("/autoscaler").text
    assert f"<h2>{SUBSCRIPTION}</h2>" in page
    rows = re.findall(r"<tr><td>[^<]*</td><td>(\d+)</td><td>(\d+)</td>", page)
    assert rows == [("2", "1"), ("0", "2")]
    assert "&lt;b&gt;12 waiting&lt;/b&gt;" in page and "<b>" not in page


def test_actions_need_the_csrf_token_a_confirmation_and_a_post(client: TestClient) -> None:
    form = {"action": "replay", "scope": "selected", "id": "m-1", "confirmed": "yes",
            "token": TOKEN}  # fmt: skip
    assert client.post("/dead-letters/confirm", data=form).status_code == 403
    assert client.post("/dead-letters/apply", data=form).status_code == 403
    token = client.get("/keys").cookies["workerpool_csrf"]
    forged = {**form, "csrf_token": "not-the-cookie"}
    assert client.post("/dead-letters/apply", data=forged).status_code == 403
    other_site = client.post(
        "/dead-letters/apply", data={**form, "csrf_token": token},
        headers={"origin": "http://evil.example"},
    )  # fmt: skip
    assert other_site.status_code == 403
    asked = client.post("/dead-letters/confirm", data={**form, "csrf_token": token})
    assert asked.status_code == 200 and "Replay the 1 selected record(s)" in asked.text
    unconfirmed = {**form, "csrf_token": token, "confirmed": "no"}
    assert client.post("/dead-letters/apply", data=unconfirmed).status_code == 400
    wrong_token = {**form, "csrf_token": token, "token": "guess"}
    assert client.post("/dead-letters/apply", data=wrong_token).status_code == 403
    nothing = {"action": "delete", "scope": "selected", "csrf_token": token}
    assert client.post("/dead-letters/confirm", data=nothing).status_code == 400
    assert client.get("/dead-letters/apply").status_code == 405


def test_a_csrf_token_of_any_characters_is_refused_not_an_error(client: TestClient) -> None:
    client.get("/keys")  # the cookie
    form = {"action": "replay", "scope": "selected", "id": "m-1", "csrf_token": "\u00e9"}
    assert client.post("/dead-letters/confirm", data=form).status_code == 403
    asked = {"page": "running", "action": "cancel", "one": "run-1", "csrf_token": "\u00e9"}
    assert client.post("/control/confirm", data=asked).status_code == 403


def test_without_credentials_the_dead_letters_page_says_so_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_credentials() -> None:
        raise ConfigError("no Google Cloud credentials found")

    monkeypatch.setattr("workerpool.dashboard.app.connect", no_credentials)
    settings = Settings(project="p", subscription="jobs", idempotency_store="none")
    app = create_app(settings, dead_letter_subscription="dlq-sub")
    with TestClient(app, raise_server_exceptions=False) as client:
        page = client.get("/dead-letters")
    assert page.status_code == 200
    assert "cannot read: no Google Cloud credentials found" in page.text


def test_the_running_page_shows_each_run_and_its_cancel_asks_for_a_confirmation(
    client: TestClient,
) -> None:
    running = client.get("/running?fragment=1").text
    assert '<tr data-job-id="run-1">' in running and "57/100 (57%)" in running
    assert '<progress value="57" max="100">' in running and "&lt;b&gt;row&lt;/b&gt; 57" in running
    form = {"page": "running", "action": "cancel", "id": ["run-1", "run-2"]}
    assert client.post("/control/confirm", data=form).status_code == 403  # no CSRF token
    token = client.get("/running").cookies["workerpool_csrf"]
    asked = client.post("/control/confirm", data={**form, "csrf_token": token})
    assert asked.status_code == 200 and "Cancel 2 job(s): run-1, run-2?" in asked.text
    wrong_token = {**form, "csrf_token": token, "confirmed": "yes", "token": "guess"}
    assert client.post("/control/apply", data=wrong_token).status_code == 403
    unknown = {"page": "running", "action": "delete", "one": "run-1", "csrf_token": token}
    assert client.post("/control/confirm", data=unknown).status_code == 400
    two = {"page": "schedules", "action": "pause", "id": ["a", "b"], "csrf_token": token}
    assert client.post("/control/confirm", data=two).status_code == 400


def test_the_running_page_counts_every_run_and_says_when_it_shows_only_the_oldest() -> None:
    # Given 250 runs in the fleet
    now, progress = time.time(), MemoryJobState()
    progress.report([
        Report(f"r/run-{i:03d}", "j.export", f"run-{i:03d}", "r", now - 500 + i, None, None, "",
               now, now + 30)
        for i in range(250)
    ])  # fmt: skip
    settings = Settings(project="p", subscription="jobs", idempotency_store="none")
    app = create_app(settings, openers=Openers(progress=lambda: progress), token=TOKEN)
    page = TestClient(app).get("/running?fragment=1").text
    # Then the page counts all 250 and says it lists the 100 oldest
    assert "250 job(s) running; the 100 oldest shown." in page
    assert page.count("<tr data-job-id=") == 100 and 'data-job-id="run-000"' in page


def test_an_actions_audit_line_names_the_address_it_came_from_beside_what_iap_claims() -> None:
    def who(headers: list[tuple[bytes, bytes]]) -> str:
        scope = {"type": "http", "headers": headers, "client": ("10.0.0.7", 5123)}
        return dashboard_app._who(Request(scope))

    # Any client can send the header where no IAP stands in front: the address is said too
    claimed = [(b"x-goog-authenticated-user-email", b"accounts.google.com:alice@example.com")]
    assert who(claimed) == "accounts.google.com:alice@example.com (IAP header) at 10.0.0.7"
    assert who([]) == "10.0.0.7"


def chart_series(svg: str) -> list[list[int]]:
    """The figures of each series of a chart the dashboard drew, in order (pygal writes
    each bar's value in a <desc class="value">)."""
    groups = re.split(r'<g class="series serie-\d+ [^"]*">', svg)[1:]
    return [[int(v) for v in re.findall(r'<desc class="value">(\d+)</desc>', g)] for g in groups]


def _record(job: str, error_type: str, message_id: str) -> FailureRecord:
    return FailureRecord("ack", message_id, b"{}", {"job": job, "error_type": error_type})


def test_a_selection_takes_its_job_error_type_and_ids() -> None:
    records = [_record("a", "bad_payload", "1"), _record("a", "permanent", "2"),
               _record("b", "permanent", "3")]  # fmt: skip
    assert [r.message_id for r in records if Selection(job="a")(r)] == ["1", "2"]
    assert [r.message_id for r in records if Selection(error_type="permanent")(r)] == ["2", "3"]
    assert [r.message_id for r in records if Selection(ids=frozenset({"3"}))(r)] == ["3"]
    assert Selection(job="a", error_type="permanent").describe() == (
        "every record of job a and error type permanent"
    )


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_completions_are_counted_by_the_minute(kind: str, tmp_path: Path) -> None:
    clock = [600.0]
    store = (
        MemoryStore(clock=lambda: clock[0])
        if kind == "memory"
        else SqliteStore(tmp_path / "s.db", clock=lambda: clock[0])
    )
    for job_id, at in (("a", 600.0), ("b", 630.0), ("c", 700.0), ("d", 1000.0)):
        clock[0] = at
        store.claim(job_id, "w", "m", 30.0)
        store.complete(job_id, "w", "m")
    store.claim("running", "w", "m", 30.0)  # claimed, not completed: not counted
    assert store.completed_per_minute(620.0) == {10: 1, 11: 1, 16: 1}
    store.close()


def test_bind_is_host_and_port() -> None:
    assert parse_bind("0.0.0.0:9000") == ("0.0.0.0", 9000)
    assert parse_bind("[::1]:8080") == ("::1", 8080)
    for bad in ("8080", "host:", "host:99999", ":80"):
        with pytest.raises(ConfigError):
            parse_bind(bad)


def test_without_a_dead_letter_topic_the_page_says_where_to_set_one() -> None:
    settings = Settings(project="p", subscription="jobs", idempotency_store="none")
    page = TestClient(create_app(settings)).get("/dead-letters")
    assert page.status_code == 200 and "No dead-letter subscription" in page.text


def test_a_store_that_does_not_count_completions_says_so_in_the_chart() -> None:
    settings = Settings(project="p", subscription="jobs", idempotency_store="none")
    chart = TestClient(create_app(settings)).get("/chart/jobs.svg")
    assert chart.status_code == 200 and NOT_COUNTED in chart.text


def test_mounted_under_a_path_its_links_stay_under_it() -> None:
    settings = Settings(project="p", subscription="jobs", idempotency_store="none")
    outer = Starlette(routes=[Mount("/workerpool", create_app(settings))])
    page = TestClient(outer).get("/workerpool/keys")
    assert page.status_code == 200
    links = re.findall(r'(?:href|src|action)="http://testserver([^"]*)"', page.text)
    assert links and all(link.startswith("/workerpool/") for link in links)
    assert "No concurrency limit declared" in page.text


def test_without_a_token_it_is_read_only() -> None:
    settings = Settings(project="p", subscription="jobs", idempotency_store="none")
    client = TestClient(create_app(settings, dead_letter_subscription="dlq-sub"))
    token = client.get("/keys").cookies["workerpool_csrf"]
    form = {"action": "replay", "scope": "filter", "confirmed": "yes", "csrf_token": token,
            "token": ""}  # fmt: skip
    assert client.post("/dead-letters/confirm", data=form).status_code == 403
    assert client.post("/dead-letters/apply", data=form).status_code == 403
    assert client.post("/control/apply", data={**form, "page": "running"}).status_code == 403
    assert "Read-only" in client.get("/running").text


def test_the_chart_package_leaves_the_process_imports_as_they_were() -> None:
    # pygal's own import hook warned on every import that missed, anywhere in the process
    assert "workerpool.dashboard.chart" in sys.modules
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("no_such_module_anywhere")
