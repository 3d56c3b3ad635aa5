"""The Dead letters page over the emulator: its first view does not wait for the whole read of
the subscription (it says the subscription is being read, offers no action, and shows the
records once the read is done); it pages through more records than one page shows,
each record on one page only, oldest failure first, reading the subscription once for all the
views (not once a view); filters page the same way; replay and delete act on exactly the
records chosen, and the page stops offering them at once; and every other record stays a dead
letter."""

from __future__ import annotations

import re
import threading
from typing import Any

from starlette.testclient import TestClient

from tests.support import wait_for
from workerpool import constants as c
from workerpool.config import Settings
from workerpool.dashboard import create_app
from workerpool.ops.dlq import peek
from workerpool.pubsub import Clients
from workerpool.testing.pubsub import PubSubResources

RECORDS = 250
TOKEN = "sesame"
# What the page shows while its first read of the subscription is under way.
READING = 'id="reading"'


class CountingSubscriber:
    """The emulator's subscriber client, counting the pulls made through it."""

    def __init__(self, subscriber: Any) -> None:
        self._subscriber = subscriber
        self.pulls = 0

    def pull(self, *args: Any, **kwargs: Any) -> Any:
        self.pulls += 1
        return self._subscriber.pull(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._subscriber, name)


class HeldSubscriber(CountingSubscriber):
    """A counting subscriber whose pulls after the first ``free`` wait until ``go`` is set, or
    20 s have passed (a view waiting for the read then gets it, and the test fails instead of
    hanging)."""

    def __init__(self, subscriber: Any, free: int = 0) -> None:
        super().__init__(subscriber)
        self.free = free
        self.go = threading.Event()

    def pull(self, *args: Any, **kwargs: Any) -> Any:
        if self.pulls >= self.free and not self.go.wait(20):
            self.go.set()
        return super().pull(*args, **kwargs)


def _fail(
    env: PubSubResources, count: int, job: Any = "t.a", error: Any = "permanent_error"
) -> None:
    """``count`` failure records, failed one second apart, published in shuffled order; the
    job and error type of record ``i`` are ``job(i)`` and ``error(i)`` when callables."""
    topic = f"projects/{env.project}/topics/{env.dead_letter_topic}"
    order = [(i * 97) % count for i in range(count)]  # every index once, out of order
    futures = [
        env.publisher.publish(
            topic, b"{}", job=job(i) if callable(job) else job, job_id=f"j-{i:03d}",
            **{c.ATTR_ERROR_TYPE: error(i) if callable(error) else error,
               c.ATTR_SOURCE_TOPIC: env.topic_path,
               c.ATTR_FAILED_AT: f"2026-11-30T00:{i // 60:02d}:{i % 60:02d}.000+00:00"},
        )
        for i in order
    ]  # fmt: skip
    for future in futures:
        future.result(30)


def _app(env: PubSubResources, subscriber: CountingSubscriber) -> TestClient:
    settings = Settings(project=env.project, dead_letter_topic=env.dead_letter_topic)
    clients = Clients(subscriber=subscriber, publisher=env.publisher)
    return TestClient(create_app(settings, clients=clients, token=TOKEN))


def _read(client: TestClient) -> TestClient:
    """``client`` once its page's first read of the subscription is done."""
    assert wait_for(lambda: READING not in client.get("/dead-letters").text, 60)
    return client


def _pages(client: TestClient, url: str) -> list[list[str]]:
    """The job ids of each page, following "Next page" from ``url``."""
    pages: list[list[str]] = []
    while url:
        page = client.get(url).text
        pages.append(re.findall(r"<td>(j-\d+)</td>", page))
        found = re.search(r'id="next" href="([^"]+)"', page)
        url = found.group(1).replace("&amp;", "&") if found else ""
    return pages


def _left(env: PubSubResources) -> list[str]:
    """The job ids the dead-letter subscription holds, sorted (read without consuming)."""
    records = peek(env.subscriber, env.dead_letter_subscription_path, limit=1000)
    return sorted(record.job_id for record in records)


def test_the_first_view_does_not_wait_for_the_read_and_the_page_shows_the_records_once_read(
    pubsub_resources: PubSubResources,
) -> None:
    # Given 250 records, and a dashboard whose read of them is held after its first pull (100)
    env = pubsub_resources
    env.provision()
    _fail(env, RECORDS)
    subscriber = HeldSubscriber(env.subscriber, free=1)
    client = _app(env, subscriber)
    # When the page is viewed while the read waits
    first = client.get("/dead-letters").text
    # Then it answers without waiting for the read, saying the subscription is being read: it
    # reloads itself, and offers no record and no action
    assert not subscriber.go.is_set() and subscriber.pulls <= 1
    assert READING in first and '<meta http-equiv="refresh"' in first
    assert "data-message" not in first and 'name="action"' not in first
    # and, reloaded, how many records the read has so far
    assert wait_for(lambda: "(100 records so far)" in client.get("/dead-letters").text, 15)
    assert not subscriber.go.is_set()
    # When the read goes on: the page, reloaded, shows the records once it is done
    subscriber.go.set()
    _read(client)
    page = client.get("/dead-letters").text
    assert f"Records 1 to 100 of {RECORDS}" in page and READING not in page
    assert 'name="action"' in page and "http-equiv" not in page


def test_the_dead_letters_page_pages_through_every_record_once(
    pubsub_resources: PubSubResources,
) -> None:
    # Given 250 failure records, failed one second apart, published in shuffled order
    env = pubsub_resources
    env.provision()
    _fail(env, RECORDS)
    subscriber = CountingSubscriber(env.subscriber)
    client = _read(_app(env, subscriber))
    # When the page is followed from its first page through its "Next page" links
    first = client.get("/dead-letters").text
    pulls = subscriber.pulls
    pages = _pages(client, "/dead-letters")
    # Then three pages of 100, 100 and 50 show each record once, in the order they failed
    assert f"Records 1 to 100 of {RECORDS}" in first
    assert [len(p) for p in pages] == [100, 100, 50]
    assert [job_id for p in pages for job_id in p] == [f"j-{i:03d}" for i in range(RECORDS)]
    # and the first read pulled the subscription, the next views none of it
    assert pulls > 0 and subscriber.pulls == pulls
    # and reading them consumed none
    assert _left(env) == [f"j-{i:03d}" for i in range(RECORDS)]


def test_a_filter_pages_through_the_records_it_matches_once(
    pubsub_resources: PubSubResources,
) -> None:
    # Given 250 records of two jobs and two error types
    env = pubsub_resources
    env.provision()
    _fail(env, RECORDS, job=lambda i: "t.b" if i % 2 else "t.a",
          error=lambda i: "timeout" if i % 5 == 0 else "permanent_error")  # fmt: skip
    client = _read(_app(env, CountingSubscriber(env.subscriber)))
    # When the records of job t.b are paged through, and those of t.a that timed out
    odd = _pages(client, "/dead-letters?job=t.b")
    timed_out = _pages(client, "/dead-letters?job=t.a&error_type=timeout")
    # Then each shows every matching record once, in the order they failed
    assert [len(p) for p in odd] == [100, 25]
    assert [j for p in odd for j in p] == [f"j-{i:03d}" for i in range(1, RECORDS, 2)]
    assert [j for p in timed_out for j in p] == [f"j-{i:03d}" for i in range(0, RECORDS, 10)]
    assert (
        "Records 1 to 25 of 25 matching the filter"
        in client.get("/dead-letters?job=t.a&error_type=timeout").text
    )


def test_replay_and_delete_act_on_exactly_the_records_chosen(
    pubsub_resources: PubSubResources,
) -> None:
    # Given 150 records, and the page's second page viewed
    env = pubsub_resources
    env.provision()
    _fail(env, 150, job=lambda i: "t.b" if i % 10 == 0 else "t.a")
    client = _read(_app(env, CountingSubscriber(env.subscriber)))
    second = client.get("/dead-letters?after=" + _last_of_first_page(client)).text
    ids = dict(re.findall(r'<tr data-message="([^"]+)">.*?<td>(j-\d+)</td>', second, re.S))
    chosen = [m for m, job_id in ids.items() if job_id in ("j-101", "j-102", "j-147")]
    csrf = client.cookies["workerpool_csrf"]
    form = {"csrf_token": csrf, "confirmed": "yes", "token": TOKEN}
    # When three of them are replayed
    replayed = client.post("/dead-letters/apply", data={**form, "action": "replay",
                           "scope": "selected", "id": chosen})  # fmt: skip
    # Then those three are republished to their topic, and only they
    assert "3 replayed" in replayed.text
    assert sorted(_pulled_jobs(env, 3)) == ["j-101", "j-102", "j-147"]
    gone = {"j-101", "j-102", "j-147"}
    assert _left(env) == sorted({f"j-{i:03d}" for i in range(150)} - gone)
    # and the page no longer offers them, without waiting for its next read
    assert "Records 1 to 100 of 147" in client.get("/dead-letters").text
    # When two records of the first page are deleted
    first = client.get("/dead-letters").text
    ids = dict(re.findall(r'<tr data-message="([^"]+)">.*?<td>(j-\d+)</td>', first, re.S))
    doomed = [m for m, job_id in ids.items() if job_id in ("j-003", "j-004")]
    deleted = client.post("/dead-letters/apply", data={**form, "action": "delete",
                          "scope": "selected", "id": doomed})  # fmt: skip
    # Then they are gone, not republished
    assert "2 deleted" in deleted.text
    gone |= {"j-003", "j-004"}
    assert _left(env) == sorted({f"j-{i:03d}" for i in range(150)} - gone)
    # When every record of job t.b is replayed through the filter
    every = client.post("/dead-letters/apply", data={**form, "action": "replay", "scope": "filter",
                        "job": "t.b"})  # fmt: skip
    # Then the 15 of them are republished, and nothing else moved
    assert "15 replayed" in every.text
    assert sorted(_pulled_jobs(env, 15)) == [f"j-{i:03d}" for i in range(0, 150, 10)]
    gone |= {f"j-{i:03d}" for i in range(0, 150, 10)}
    assert _left(env) == sorted({f"j-{i:03d}" for i in range(150)} - gone)
    assert "No record matching the filter" in client.get("/dead-letters?job=t.b").text
    assert f"of {150 - len(gone)}" in client.get("/dead-letters").text


def _last_of_first_page(client: TestClient) -> str:
    found = re.search(r'id="next" href="[^"]*after=([^"&]+)', client.get("/dead-letters").text)
    assert found is not None
    return found.group(1)


def _pulled_jobs(env: PubSubResources, expected: int) -> list[str]:
    """The job ids published to the work topic (pulled and acked), once ``expected`` came or
    the subscription has nothing more."""
    jobs: list[str] = []
    for _ in range(20):
        response = env.subscriber.pull(
            request={"subscription": env.subscription_path, "max_messages": 100}, timeout=2
        )
        messages = response.received_messages
        if messages:
            env.subscriber.acknowledge(
                request={"subscription": env.subscription_path,
                         "ack_ids": [m.ack_id for m in messages]},
            )  # fmt: skip
            jobs += [m.message.attributes["job_id"] for m in messages]
        if len(jobs) >= expected and not messages:
            break
    return jobs
