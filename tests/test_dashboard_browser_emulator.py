"""The dashboard in a real browser (the system's chromium, driven by Playwright) over real
worker processes on the Pub/Sub emulator sharing an SQLite store: the live replica and what it
runs, a key's holder, a batch and a delayed job, dead letters whose payload and error carry a
script shown as text, and a selection of them replayed from the page, run again, and only
those; then a job's records replayed through the filter, and one deleted. The Running page: a
job's progress advancing live, the job cancelled from the page; a periodic schedule paused,
resumed and triggered from the Schedules page. And the Autoscaler page: a real autoscaler's
decisions, live."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import expect, sync_playwright

from tests.support import dashboard_process, ledger_events, spawn_worker, wait_for, worker_processes
from workerpool import JobMessage, publish, publish_batch
from workerpool.schedule import parse_not_before
from workerpool.testing.pubsub import PubSubResources

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or ""
SCRIPT = "<script>alert(1)</script>"
TOKEN = "open sesame"  # the dashboard's: its actions are confirmed with it
# The jobs published while the first worker, which knows none of them, runs: dead letters.
UNKNOWN = {"r-1": "t1", "r-2": "t2", "r-3": "t3"}


@contextlib.contextmanager
def _dashboard(config: Path, env: PubSubResources, log: Path) -> Iterator[str]:
    environment = {"PUBSUB_EMULATOR_HOST": env.host, "WORKERPOOL_DASHBOARD_TOKEN": TOKEN}
    with dashboard_process(config, log, env=environment) as url:
        yield url


def _fleet(env: PubSubResources, tmp_path: Path, extra: str = "") -> tuple[Path, str, Path]:
    """Provision the topic and subscriptions; the ledger, the SQLite store the fleet shares,
    and the dashboard's config (``extra``: more of it)."""
    env.provision()
    ledger, store = tmp_path / "ledger.jsonl", f"sqlite:///{tmp_path / 'fleet.db'}"
    config = tmp_path / "workerpool.toml"
    config.write_text(
        f'[worker]\nproject = "{env.project}"\nsubscription = "{env.subscription}"\n'
        f'dead_letter_topic = "{env.dead_letter_topic}"\nidempotency_store = "{store}"\n{extra}'
    )
    return ledger, store, config


@pytest.fixture
def browser() -> Iterator[Any]:
    # The system's chromium, never a browser Playwright would download (.ci/run installs it).
    assert CHROMIUM, "chromium is not installed: apt-get install chromium"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()


def test_the_dashboard_shows_the_fleet_and_replays_a_selection(
    pubsub_resources: PubSubResources, tmp_path: Path, browser: Any
) -> None:
    env = pubsub_resources
    ledger, store, config = _fleet(
        env, tmp_path, '\n[concurrency]\n"demo-slots" = 1\n"tenant:*" = 1\n'
    )
    with worker_processes() as workers:
        # Given dead letters: jobs the first worker does not know, one payload and one job
        # name carrying a script
        first = spawn_worker(env, ledger, store=store)
        workers.append(first)
        for job_id, tenant in UNKNOWN.items():
            env.publish("demo.tenant_sleep", {"tenant": SCRIPT + tenant}, job_id=job_id)
        env.publish(SCRIPT, {}, job_id="named-script")
        assert wait_for(lambda: len(_letters(env)) == 4, 60), first.output()
        first.signal(signal.SIGTERM)
        assert first.wait(30) == 0
        # and a worker that knows them running two long jobs, one holding the key's slot
        second = spawn_worker(
            env, ledger, "--jobs", "workerpool_jobs.demo_slots",
            "--concurrency", "demo-slots=1", "--concurrency", "tenant:*=1",
            "--max-outstanding", "4", store=store,
        )  # fmt: skip
        workers.append(second)
        env.publish("demo.slot_sleep", {"seconds": 60}, job_id="holder")
        env.publish("demo.sleep", {"seconds": 60}, job_id="sleeper")
        assert wait_for(lambda: len(ledger_events(ledger, "start", second.pid)) == 2, 30)
        # and a batch of two quick children, and a job delayed by an hour
        children = [JobMessage("demo.sleep", {"seconds": 0.1}, f"child-{i}") for i in (1, 2)]
        publish_batch(env.topic_path, children, on_complete="demo.batch_done", batch_id="b-1",
                      store=store, publisher=env.publisher)  # fmt: skip
        publish(env.topic_path, "demo.sleep", {}, job_id="later", publisher=env.publisher,
                not_before=timedelta(hours=1))  # fmt: skip

        with _dashboard(config, env, tmp_path / "dashboard.log") as url:
            page = browser.new_page()
            dialogs: list[str] = []
            errors: list[str] = []
            page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)

            # Then the Overview shows the replica and its two running jobs, live
            page.goto(url + "/")
            running = page.locator("#replicas td.running")
            running.first.wait_for()
            page.wait_for_function(
                "document.querySelector('#replicas td.running')?.textContent === '2'",
                timeout=15000,
            )
            assert page.locator("#replicas tr[data-replica]").count() == 1
            assert page.locator("#replicas td.free").inner_text() == "2"  # 4 slots, 2 running
            # and a job started after the page loaded shows there with no reload (a beat
            # every 2 s, a refresh every 2 s: the wait allows for a loaded machine)
            page.evaluate("window.loadedOnce = true")
            env.publish("demo.sleep", {"seconds": 60}, job_id="late")
            page.wait_for_function(
                "document.querySelector('#replicas td.running')?.textContent === '3'",
                timeout=15000,
            )
            assert page.evaluate("window.loadedOnce") is True

            # and the Keys page the key's one holder
            page.goto(url + "/keys")
            holders = page.locator('tr[data-key="demo-slots"] td.holders').inner_text()
            assert holders.startswith("1") and second_worker_id(second) in holders

            # and the batch finalized by its last child, and the delayed job
            page.goto(url + "/batches")
            batch = page.locator('#batches tr[data-batch="b-1"]')
            batch.wait_for()
            expect(batch).to_contain_text("finalized by last_child", timeout=15000)
            expect(batch).to_contain_text("100%")
            page.goto(url + "/schedules")
            expect(page.locator("#delayed")).to_contain_text("later", timeout=15000)
            # (the Overview and Keys are taken by the live module's test: failed runs, shares)
            _screenshots(page, url, only=("running", "batches", "schedules", "dead-letters"))

            # and the dead letters show the scripts as text, none of them run
            page.goto(url + "/dead-letters")
            page.locator("#letters tr[data-message]").nth(3).wait_for()
            payloads = page.locator("pre.payload").all_inner_texts()
            assert sum(SCRIPT in text for text in payloads) == 3
            assert any(SCRIPT in t for t in page.locator("td.error-message").all_inner_texts())
            page.wait_for_timeout(500)
            assert dialogs == []

            # When two of them are selected and replayed, through the confirmation page
            for job_id in ("r-1", "r-2"):
                page.locator("#letters tr", has_text=job_id).locator("input").check()
            page.get_by_role("button", name="Replay selected").click()
            assert "Replay the 2 selected record(s)" in page.locator("#question").inner_text()
            _confirm(page)
            assert "2 replayed" in page.locator("#result").inner_text()

            # Then those two run once each, and the others stay dead letters
            assert wait_for(lambda: _done(ledger) == {"r-1", "r-2"}, 30), second.output()
            assert {record["job_id"] for record in _letters(env)} == {"r-3", "named-script"}

            # When every record of a job is replayed through the filter
            page.goto(url + "/dead-letters?job=demo.tenant_sleep")
            assert page.locator("#letters tr[data-message]").count() == 1
            page.get_by_role("button", name="Replay all matching the filter").click()
            assert "every record of job demo.tenant_sleep" in page.locator("#question").inner_text()
            _confirm(page)
            assert "1 replayed" in page.locator("#result").inner_text()
            # and the last one is deleted, confirmed
            page.goto(url + "/dead-letters")
            page.locator("#letters tr", has_text="named-script").locator("input").check()
            page.get_by_role("button", name="Delete selected").click()
            _confirm(page)
            assert "1 deleted" in page.locator("#result").inner_text()
            assert errors == [] and dialogs == []

        # Then that job's record ran too, and none is left
        assert wait_for(lambda: _done(ledger) == set(UNKNOWN), 30), second.output()
        assert _letters(env) == []
        assert len([e for e in ledger_events(ledger, "done") if e["job_id"] in UNKNOWN]) == 3


def test_the_autoscaler_page_shows_the_decisions_of_a_real_autoscaler_live(
    pubsub_resources: PubSubResources, tmp_path: Path, browser: Any
) -> None:
    env = pubsub_resources
    env.provision()
    store = f"sqlite:///{tmp_path / 'fleet.db'}"
    config = tmp_path / "workerpool.toml"
    config.write_text(
        f'[worker]\nproject = "{env.project}"\nsubscription = "{env.subscription}"\n'
        f'idempotency_store = "{store}"\n'
    )
    # Given a real autoscaler (process actuator, at most one replica) on an idle subscription
    log = tmp_path / "autoscale.log"
    environment = {**os.environ, "PUBSUB_EMULATOR_HOST": env.host,
                   "WORKERPOOL_DEMO_LEDGER": str(tmp_path / "ledger.jsonl")}  # fmt: skip
    with open(log, "wb") as out:
        scaler = subprocess.Popen(
            [sys.executable, "-m", "workerpool", "autoscale", "--config", str(config),
             "--max", "1", "--interval", "0.5", "--", "--jobs", "workerpool_jobs.demo",
             "--heartbeat-interval", "0.5"],
            env=environment, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        with _dashboard(config, env, tmp_path / "dashboard.log") as url:
            page = browser.new_page()
            errors: list[str] = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            # When the Autoscaler page is open and a job is published
            page.goto(url + "/autoscaler")
            rows = page.locator("table.decisions tr")
            expect(rows.nth(1)).to_contain_text("no change", timeout=30000)
            page.evaluate("window.loadedOnce = true")
            env.publish("demo.sleep", {"seconds": 30}, job_id="wakes-it")
            # Then the decision to start a replica shows, with no reload: from 0 replicas to
            # 1, the job seen waiting, and what the actuator did; the newest decision on top
            started = page.locator("table.decisions tr", has_text="started 1")
            expect(started).to_have_count(1, timeout=30000)
            cells = started.locator("td").all_inner_texts()
            assert cells[1:3] == ["0", "1"], cells
            assert "waiting 1" in cells[3] or "probe saw 1" in cells[3], cells
            assert page.evaluate("window.loadedOnce") is True
            times = page.locator("table.decisions td:first-child").all_inner_texts()
            assert times == sorted(times, reverse=True)
            assert errors == []
            _screenshots(page, url, only=("autoscaler",))
    finally:
        os.killpg(scaler.pid, signal.SIGTERM)
        assert scaler.wait(60) == 0, log.read_text()[-3000:]


LONG = '#running tr[data-job-id="long"]'  # the long job's row on the Running page
SCHEDULED = """
[[schedules]]
name = "tick"
job = "demo.sleep"
every = "1s"
payload = { seconds = 0.05 }
catch_up = "none"
"""


def test_the_running_page_shows_progress_and_cancels_and_schedules_pause_resume_trigger(
    pubsub_resources: PubSubResources, tmp_path: Path, browser: Any
) -> None:
    env = pubsub_resources
    env.provision(retry_policy=False)
    ledger, store = tmp_path / "ledger.jsonl", f"sqlite:///{tmp_path / 'fleet.db'}"
    config = tmp_path / "workerpool.toml"
    config.write_text(
        f'[worker]\nproject = "{env.project}"\nsubscription = "{env.subscription}"\n'
        f'jobs = ["workerpool_jobs.demo"]\nidempotency_store = "{store}"\n{SCHEDULED}'
    )
    with worker_processes() as workers:
        # Given a worker firing a 1-second schedule and running a job of 600 steps of 0.1 s,
        # reporting its progress after each
        worker = spawn_worker(env, ledger, "--config", str(config), store=store)
        workers.append(worker)
        env.publish("demo.steps", {"steps": 600, "step_seconds": 0.1}, job_id="long")
        with _dashboard(config, env, tmp_path / "dashboard.log") as url:
            page = browser.new_page()
            errors: list[str] = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)

            # Then the Running page shows it, its progress advancing with no reload
            page.goto(url + "/running")
            page.evaluate("window.loadedOnce = true")
            done = page.locator(f"{LONG} span.done")
            done.wait_for(timeout=20000)
            first = _steps(done.inner_text())
            page.wait_for_function(
                f"parseFloat(document.querySelector('{LONG} span.done')?.textContent) > {first}",
                timeout=15000,
            )
            later = _steps(done.inner_text())
            assert page.evaluate("window.loadedOnce") is True
            assert page.locator(f"{LONG} progress").count() == 1

            # When it is cancelled from the page, through the confirmation page
            page.locator(f"{LONG} button").click()
            assert "Cancel 1 job(s): long" in page.locator("#question").inner_text()
            _confirm(page)
            asked = time.monotonic()
            assert "long: cancelled" in page.locator("#result").inner_text()
            # Then its run ends cancelled within a few seconds
            assert wait_for(lambda: _runs(ledger, "cancelled", "long"), 10), worker.output()
            took = time.monotonic() - asked
            print(f"progress {first:g} -> {later:g} live; cancelled run ended {took:.1f} s after")

            # When the schedule is paused from the Schedules page
            assert wait_for(lambda: _ticks(ledger), 30), worker.output()
            _, paused_at = _schedule_action(page, url, "Pause")
            assert "tick: paused" in page.locator("#result").inner_text()
            time.sleep(5)
            # Then no tick after the pause runs
            resumed_at, _ = _schedule_action(page, url, "Resume")
            assert [t for t in _ticks(ledger) if paused_at < t < resumed_at] == []
            # and once resumed, its ticks run again
            assert wait_for(lambda: any(t > resumed_at for t in _ticks(ledger)), 20)
            # and a trigger runs it once, under a job id of its own
            _schedule_action(page, url, "Trigger")
            job_id = page.locator("#result").inner_text().rsplit("job id ", 1)[1].strip()
            assert wait_for(lambda: _runs(ledger, "done", job_id), 20), worker.output()
            page.goto(url + "/schedules")
            expect(page.locator('tr[data-schedule="tick"] td.state')).to_have_text("active")
            assert errors == []
        time.sleep(2)
    # And the cancelled job never ran again, the triggered one once
    assert len(_runs(ledger, "resume", "long")) == 1
    assert len(_runs(ledger, "done", job_id)) == 1
    print(f"paused {resumed_at - paused_at:.1f} s with no tick; trigger ran {job_id} once")


def _steps(text: str) -> float:
    return float(text.split("/", 1)[0])


def _runs(ledger: Path, outcome: str, job_id: str) -> list[dict[str, Any]]:
    return [e for e in ledger_events(ledger, outcome) if e["job_id"] == job_id]


def _schedule_action(page: Any, url: str, button: str) -> tuple[float, float]:
    """Click ``button`` on the schedule's row and confirm it: the times just before it was
    confirmed and once it was carried out."""
    page.goto(url + "/schedules")
    page.locator('tr[data-schedule="tick"]').get_by_role("button", name=button).click()
    assert "schedule tick" in page.locator("#question").inner_text()
    before = time.time()
    _confirm(page)
    page.locator("#result").wait_for()
    return before, time.time()


def _ticks(ledger: Path) -> list[float]:
    """The ticks of the schedule that ran to the end, by the jobs' own ledger."""
    prefix = "periodic:tick:"
    return [parse_not_before(e["job_id"][len(prefix) :])
            for e in ledger_events(ledger, "done") if e["job_id"].startswith(prefix)]  # fmt: skip


PAGES = {"overview": "/", "running": "/running", "keys": "/keys", "batches": "/batches",
         "schedules": "/schedules", "dead-letters": "/dead-letters",
         "autoscaler": "/autoscaler"}  # fmt: skip


def _screenshots(page: Any, url: str, only: tuple[str, ...]) -> None:
    """Each page as a picture, where WORKERPOOL_DASHBOARD_SCREENSHOTS names a folder (the
    docs' pictures are made so)."""
    folder = os.environ.get("WORKERPOOL_DASHBOARD_SCREENSHOTS")
    if not folder:
        return
    for name in only:
        page.goto(url + PAGES[name])
        if name == "dead-letters":  # it reloads itself until its first read is done
            page.locator("#letters").wait_for()
        page.wait_for_load_state("networkidle")
        page.screenshot(path=str(Path(folder) / f"{name}.png"), full_page=True)


def _confirm(page: Any) -> None:
    page.locator("#token").fill(TOKEN)
    page.locator("#confirm").click()


def _done(ledger: Path) -> set[str]:
    return {e["job_id"] for e in ledger_events(ledger, "done")} & set(UNKNOWN)


def second_worker_id(worker: Any) -> str:
    """The start of a worker's id (``host-pid-random``): its host and pid."""
    return f"-{worker.pid}-"


def _letters(env: PubSubResources) -> list[dict[str, str]]:
    from workerpool.ops.dlq import peek

    return [
        {"job_id": record.job_id}
        for record in peek(env.subscriber, env.dead_letter_subscription_path, limit=50)
    ]
