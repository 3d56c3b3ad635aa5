"""The Dead letters page pages through more records than one page shows, over the emulator:
each record shows on one page only, oldest failure first, and every one stays a dead letter."""

from __future__ import annotations

import re

from starlette.testclient import TestClient

from workerpool import constants as c
from workerpool.config import Settings
from workerpool.dashboard import create_app
from workerpool.testing.pubsub import PubSubResources

RECORDS = 250


def test_the_dead_letters_page_pages_through_every_record_once(
    pubsub_resources: PubSubResources,
) -> None:
    # Given 250 failure records, failed one second apart, published in shuffled order
    env = pubsub_resources
    env.provision()
    topic = f"projects/{env.project}/topics/{env.dead_letter_topic}"
    order = [(i * 97) % RECORDS for i in range(RECORDS)]  # every index once, out of order
    futures = [
        env.publisher.publish(
            topic, b"{}", job="t.a", job_id=f"j-{i:03d}", **{c.ATTR_ERROR_TYPE: "permanent_error",
            c.ATTR_FAILED_AT: f"2026-11-30T00:{i // 60:02d}:{i % 60:02d}.000+00:00"},
        )
        for i in order
    ]  # fmt: skip
    for future in futures:
        future.result(30)
    settings = Settings(project=env.project, dead_letter_topic=env.dead_letter_topic)
    client = TestClient(create_app(settings))
    # When the page is followed from its first page through its "Next page" links
    pages: list[list[str]] = []
    url = "/dead-letters"
    while url:
        page = client.get(url).text
        pages.append(re.findall(r"<td>(j-\d+)</td>", page))
        if len(pages) == 1:
            assert f"Records 1 to 100 of {RECORDS}" in page
        found = re.search(r'id="next" href="([^"]+)"', page)
        url = found.group(1).replace("&amp;", "&") if found else ""
    # Then three pages of 100, 100 and 50 show each record once, in the order they failed
    assert [len(p) for p in pages] == [100, 100, 50]
    assert [job_id for p in pages for job_id in p] == [f"j-{i:03d}" for i in range(RECORDS)]
    assert "Records 201 to 250 of 250" in page
    # and reading them consumed none
    assert "Records 1 to 100 of 250" in client.get("/dead-letters").text
