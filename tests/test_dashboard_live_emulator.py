"""The dashboard in a real browser over real worker processes on the Pub/Sub emulator, what
the first browser module leaves out: a job that never reports progress shows on the Running
page within 3 s of its publish, with no reload; twenty dead letters of a job, filtered and
replayed from the page, each run once and the others not at all; and the Overview's and Keys
page's figures equal what the store says at that moment, with the fleet steady."""

from __future__ import annotations

import contextlib
import re
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tests.support import ledger_events, spawn_worker, wait_for, worker_processes
from tests.test_dashboard_browser_emulator import (
    _confirm,
    _dashboard,
    _fleet,
    _letters,
    _screenshots,
    browser,
)
from tests.test_dashboard_views import chart_series
from workerpool.heartbeats import heartbeat_opener
from workerpool.idempotency import store_opener
from workerpool.slots import slot_store_opener
from workerpool.testing.pubsub import PubSubResources

__all__ = ["browser"]  # the fixture, shared with the first browser module

# Jobs of the second worker's module (workerpool_jobs.demo_slots), which the first worker
# does not know: published while it runs, they become dead letters.
SLOTS = ("--jobs", "workerpool_jobs.demo_slots", "--concurrency", "demo-slots=4",
         "--concurrency", "tenant:*=1")  # fmt: skip


def test_a_job_that_reports_no_progress_shows_on_running_within_3_s_with_no_reload(
    pubsub_resources: PubSubResources, tmp_path: Path, browser: Any
) -> None:
    env = pubsub_resources
    ledger, store, config = _fleet(env, tmp_path)
    with worker_processes() as workers:
        # Given a worker running a job, and the Running page open on it
        worker = spawn_worker(env, ledger, store=store)
        workers.append(worker)
        env.publish("demo.sleep", {"seconds": 60}, job_id="first")
        with _dashboard(config, env, tmp_path / "dashboard.log") as url:
            page = browser.new_page()
            errors: list[str] = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto(url + "/running")
            page.locator('#running tr[data-job-id="first"]').wait_for(timeout=20000)
            page.evaluate("window.loadedOnce = true")
            # When a job that never calls ctx.progress is published
            seen = []
            for job_id in ("late-1", "late-2", "late-3"):
                published = time.monotonic()
                env.publish("demo.sleep", {"seconds": 60}, job_id=job_id)
                # Then its row shows within 3 s of the publish, with no reload
                page.locator(f'#running tr[data-job-id="{job_id}"]').wait_for(timeout=15000)
                seen.append(time.monotonic() - published)
            assert page.evaluate("window.loadedOnce") is True
            assert errors == []
        print("shown on Running after", ", ".join(f"{s:.2f} s" for s in seen))
        assert max(seen) < 3.0, seen


def test_twenty_filtered_dead_letters_replayed_from_the_page_each_run_once(
    pubsub_resources: PubSubResources, tmp_path: Path, browser: Any
) -> None:
    env = pubsub_resources
    ledger, store, config = _fleet(env, tmp_path)
    replayed = {f"t-{i}" for i in range(20)}
    others = {f"s-{i}" for i in range(5)}
    with worker_processes() as workers:
        # Given 25 dead letters: 20 of one job, 5 of another, neither known to the worker
        first = spawn_worker(env, ledger, store=store)
        workers.append(first)
        env.publish_many(
            "demo.tenant_sleep", [(j, {"tenant": j, "seconds": 0.05}) for j in sorted(replayed)]
        )
        env.publish_many("demo.slot_sleep", [(j, {"seconds": 0.05}) for j in sorted(others)])
        assert wait_for(lambda: len(_letters(env)) == 25, 60), first.output()
        first.signal(signal.SIGTERM)
        assert first.wait(30) == 0
        # and a worker that knows both
        second = spawn_worker(env, ledger, *SLOTS, store=store)
        workers.append(second)
        with _dashboard(config, env, tmp_path / "dashboard.log") as url:
            page = browser.new_page()
            # When the 20 of the first job are filtered and all replayed, confirmed
            page.goto(url + "/dead-letters?job=demo.tenant_sleep")
            page.locator("#letters").wait_for()  # the page reloads itself until it is read
            assert page.locator("#letters tr[data-message]").count() == 20
            page.get_by_role("button", name="Replay all matching the filter").click()
            assert "every record of job demo.tenant_sleep" in page.locator("#question").inner_text()
            _confirm(page)
            assert "20 replayed" in page.locator("#result").inner_text()
        # Then each of the 20 runs to the end, once
        assert wait_for(lambda: _done(ledger) >= replayed, 60), second.output()
        time.sleep(3)  # time for a second run of any of them to show
        runs = Counter(e["job_id"] for e in ledger_events(ledger, "start"))
        assert {job_id: runs[job_id] for job_id in replayed} == dict.fromkeys(replayed, 1)
        assert Counter(e["job_id"] for e in ledger_events(ledger, "done")) == Counter(replayed)
        # and the other job's 5 never ran, and are dead letters still
        assert not others & set(runs)
        assert {record["job_id"] for record in _letters(env)} == others


def _done(ledger: Path) -> set[str]:
    return {e["job_id"] for e in ledger_events(ledger, "done")}


def test_the_overview_and_keys_figures_equal_the_store_at_that_moment(
    pubsub_resources: PubSubResources, tmp_path: Path, browser: Any
) -> None:
    env = pubsub_resources
    ledger, store, config = _fleet(env, tmp_path, BULK)
    with worker_processes() as workers:
        # Given a worker that has done 4 jobs and failed 3 runs (two jobs dead-lettered, one
        # retried), and runs 4 long jobs: two
        # on shares of a key leased in bulk, two holding a tenant's key each
        worker = spawn_worker(env, ledger, *BULK_FLAGS, store=store)
        workers.append(worker)
        env.publish_many("demo.sleep", [(f"ok-{i}", {"seconds": 0.05}) for i in range(3)])
        env.publish_many("demo.sleep", [(f"bad-{i}", {"seconds": 0.05, "fail": "permanent"})
                                        for i in range(2)])  # fmt: skip
        env.publish(
            "demo.sleep", {"seconds": 0.05, "fail": "retryable", "fail_until": 2}, job_id="retried"
        )  # fails its first run, is done on its second
        assert wait_for(lambda: len(_letters(env)) == 2, 60), worker.output()
        assert wait_for(lambda: len(ledger_events(ledger, "done")) == 4, 60), worker.output()
        env.publish_many("demo.slot_sleep", [(f"bulk-{i}", {"seconds": 60}) for i in range(2)])
        env.publish_many(
            "demo.tenant_sleep", [(f"tenant-{t}", {"seconds": 60, "tenant": t}) for t in "ab"]
        )
        assert wait_for(lambda: len(ledger_events(ledger, "start")) == 11, 30), worker.output()
        with _dashboard(config, env, tmp_path / "dashboard.log") as url:
            page = browser.new_page()
            # When the Overview shows the fleet steady (4 running), read right after a refresh
            page.goto(url + "/")
            page.wait_for_function(
                "document.querySelector('#replicas td.running')?.textContent === '4'",
                timeout=20000,
            )
            shown, stored = _at_one_moment(page, lambda: _overview(page, url),
                                           lambda: _overview_stored(env, store))  # fmt: skip
            # Then each figure on it is the store's
            assert shown == stored
            (replica,) = shown["replicas"]
            assert replica[1:] == ("4", "0", "2", "no")  # 6 slots, 4 running, none held
            # and the chart's are the runs that happened: 4 done, 3 failed, by the ledger
            assert sum(shown["done"]) == len(ledger_events(ledger, "done")) == 4
            failed = ledger_events(ledger, "permanent") + ledger_events(ledger, "retryable")
            assert sum(shown["failed"]) == len(failed) == 3
            # and so are the Keys page's, each replica's share of the bulk key among them
            page.goto(url + "/keys")
            page.locator('tr[data-key="tenant:b"]').wait_for(timeout=15000)
            keys, stored_keys = _at_one_moment(page, lambda: _keys(page),
                                               lambda: _keys_stored(store))  # fmt: skip
            assert keys == stored_keys
            assert keys["demo-slots"]["shares"] == [(replica[0], "2", "2")]
            assert [len(keys[k]["holders"]) for k in ("tenant:a", "tenant:b")] == [1, 1]
            _screenshots(page, url, only=("overview", "keys"))


BULK = '\n[concurrency]\n"demo-slots" = "4/bulk"\n"tenant:*" = 1\n'
BULK_FLAGS = ("--jobs", "workerpool_jobs.demo_slots", "--concurrency", "demo-slots=4/bulk",
              "--concurrency", "tenant:*=1", "--max-outstanding", "6")  # fmt: skip
Figures = dict[str, Any]


def _at_one_moment(
    page: Any, shown: Callable[[], Figures], stored: Callable[[], Figures]
) -> tuple[Figures, Figures]:
    """The page's figures just after its live part refreshed, and the store's read right
    after, in one minute (the chart's minutes shift at the turn of one: read again then)."""
    while True:
        minute = int(time.time() // 60)
        refreshed = page.locator("#live").get_attribute("data-refreshed") or ""
        page.wait_for_function(
            f"document.querySelector('#live').dataset.refreshed !== '{refreshed}'",
            timeout=10000,
        )
        figures = shown(), stored()
        if int(time.time() // 60) == minute:
            return figures


def _overview(page: Any, url: str) -> Figures:
    rows = page.locator("#replicas tr[data-replica]")
    replicas = [
        (row.get_attribute("data-replica"), *(row.locator(f"td.{c}").inner_text()
                                             for c in ("running", "held", "free", "draining")))
        for row in rows.all()
    ]  # fmt: skip
    done, failed = chart_series(page.request.get(url + "/chart/jobs.svg").text())
    return {"replicas": replicas, "done": done, "failed": failed}


def _overview_stored(env: PubSubResources, store: str) -> Figures:
    now = time.time()
    with _opened(heartbeat_opener(store)) as beats:
        live = beats.live(env.subscription_path, now)
    replicas = [(b.replica, str(b.running), str(b.waiting), str(max(0, b.slots - b.running)),
                 "yes" if b.draining else "no") for b in live]  # fmt: skip
    last = int(now // 60)
    minutes = range(last - 59, last + 1)
    with _opened(store_opener(store)) as completions:
        done = completions.completed_per_minute(minutes[0] * 60) or {}
        failed = completions.failed_per_minute(minutes[0] * 60) or {}
    return {"replicas": replicas, "done": [done.get(m, 0) for m in minutes],
            "failed": [failed.get(m, 0) for m in minutes]}  # fmt: skip


def _keys(page: Any) -> Figures:
    keys = {}
    for row in page.locator("#keys tr[data-key]").all():
        holders = row.locator("td.holders").inner_text().splitlines()[1:]
        shares = re.findall(r"^(\S+): (\d+) \(wants (\d+),", row.locator("td.shares").inner_text(),
                            re.MULTILINE)  # fmt: skip
        cells = row.locator("td").all_inner_texts()
        keys[row.get_attribute("data-key")] = {
            "limit": cells[1], "holders": [h.split(", ")[0] for h in holders],
            "waiting": cells[3], "deferred": cells[4], "shares": shares,
        }  # fmt: skip
    return keys


def _keys_stored(store: str) -> Figures:
    now = time.time()
    limits = {"demo-slots": "4", "tenant:a": "1", "tenant:b": "1"}
    keys = {}
    with _opened(slot_store_opener(store)) as slots:
        for key, limit in limits.items():
            table = slots.table(key)
            keys[key] = {
                "limit": limit,
                "holders": [f"{name} (token {lease.token}" for name, lease
                            in sorted(table.holders.items(), key=lambda h: h[1].since)],
                "waiting": str(len(table.waiters)), "deferred": str(len(table.booked)),
                "shares": [(name, str(s.granted), str(s.want))
                           for name, s in sorted(table.live_shares(now).items())],
            }  # fmt: skip
    return keys


@contextlib.contextmanager
def _opened(opener: Callable[[], Any] | None) -> Iterator[Any]:
    assert opener is not None
    store = opener()
    try:
        yield store
    finally:
        store.close()
