"""Publishing, the pure parts: the lines of ``publish --file`` and the jobs the Python API
takes (a publisher that records stands in for Pub/Sub; tests/test_cli.py publishes for real)."""

from __future__ import annotations

from concurrent.futures import Future
from math import inf
from pathlib import Path
from typing import Any

import pytest

import workerpool
from tests.fakes import Confirmed, FakeClock
from workerpool.batches import SqliteBatches
from workerpool.errors import ConfigError
from workerpool.publishing import JobMessage, confirm_all, confirmed, read_jsonl


class _Publisher:
    def __init__(self) -> None:
        self.published: list[dict[str, str]] = []

    def get_topic(self, request: dict[str, str], timeout: float) -> object:
        return request  # every topic is there

    def publish(self, topic: str, data: bytes, **attributes: str) -> Future[str]:
        self.published.append(attributes)
        future: Future[str] = Future()
        future.set_result(f"m-{len(self.published)}")
        return future


def test_a_good_file_is_read_with_its_blank_lines_skipped() -> None:
    lines = [b'{"job": "a", "job_id": "1", "data": {"k": 1}}\n', b"\n", b'{"job": "b"}\n']
    assert read_jsonl(lines, "jobs.jsonl") == [
        JobMessage("a", {"k": 1}, "1"),
        JobMessage("b", {}, ""),
    ]


@pytest.mark.parametrize(
    ("line", "says"),
    [
        (b'{"job": "a", "job_id": null}', "field 'job_id' is null, not a string"),
        (b'{"job": null, "job_id": "1"}', "field 'job' is null, not a string"),
        (b'{"job": "a", "data": null}', "field 'data' is null, not an object"),
        (b'{"job": 7}', "field 'job' is a number, not a string"),
        (b'{"job": "a", "job_id": 12}', "field 'job_id' is a number, not a string"),
        (b'{"job": "a", "job_id": true}', "field 'job_id' is a boolean, not a string"),
        (b'{"job": "a", "data": [1]}', "field 'data' is an array, not an object"),
        (b'{"job": ""}', "job must not be empty"),
        (b'{"job_id": "1"}', "field 'job' is missing"),
        (b'{"job": "a", "jobid": "1"}', "unknown field 'jobid'"),
        (b'["a"]', "expected an object"),
        (b'{"job": "a", "data": {"x": NaN}}', "NaN is not valid JSON"),
        (b'{"job": "a"', "Expecting"),
        (b'{"job": "caf\xe9"}', "not UTF-8"),
        (b'{"job": "\\ud800"}', "is not valid UTF-8 text"),
        (b'{"job": "a", "job_id": "' + b"x" * 1025 + b'"}', "Pub/Sub takes 1024"),
        (b"[" * 100_000, "nested too deeply"),
    ],
)
def test_a_bad_line_is_refused_naming_its_line_and_field(line: bytes, says: str) -> None:
    # Given a file whose second line is bad, When it is read
    with pytest.raises(ConfigError) as refused:
        read_jsonl([b'{"job": "a", "job_id": "1"}\n', line + b"\n"], "jobs.jsonl")
    # Then one line names the file, the line and what is wrong
    message = str(refused.value)
    assert message.startswith("jobs.jsonl:2: ") and says in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("kwargs", "error", "says"),
    [
        ({"job": None}, TypeError, "job must be a string, not NoneType"),
        ({"job": ""}, ValueError, "job must not be empty"),
        ({"job": "a", "job_id": None}, TypeError, "job_id must be a string, not NoneType"),
        ({"job": "a", "job_id": 7}, TypeError, "job_id must be a string, not int"),
        ({"job": "a", "data": [1]}, TypeError, "data must be a mapping, not list"),
    ],
)
def test_the_python_api_refuses_a_job_or_job_id_that_is_not_a_string(
    kwargs: dict[str, Any], error: type[Exception], says: str
) -> None:
    # Given a job name or job id that is None (or not text), When it is published
    publisher = _Publisher()
    with pytest.raises(error, match=says):
        workerpool.publish("projects/p/topics/t", publisher=publisher, **kwargs)
    # Then nothing goes out as the job "None"
    assert publisher.published == []
    workerpool.publish("projects/p/topics/t", "a", job_id="1", publisher=publisher)
    assert [(a["job"], a["job_id"]) for a in publisher.published] == [("a", "1")]


def test_a_batch_refuses_a_completion_job_that_is_not_a_string() -> None:
    with pytest.raises(TypeError, match="on_complete must be a string, not NoneType"):
        workerpool.publish_batch(
            "projects/p/topics/t",
            [JobMessage("a", {}, "1")],
            on_complete=None,  # type: ignore[arg-type]
            store="memory://",
            publisher=_Publisher(),
        )


def test_a_batch_in_a_store_no_worker_sees_is_refused() -> None:
    publisher = _Publisher()
    with pytest.raises(ConfigError, match="memory://: no other process can see its batches"):
        workerpool.publish_batch(
            "projects/p/topics/t", [JobMessage("a", {}, "1")], on_complete="done",
            store="memory://", publisher=publisher,
        )  # fmt: skip
    assert publisher.published == []


def test_a_batch_id_too_long_for_its_deadline_job_records_and_publishes_nothing(
    tmp_path: Path,
) -> None:
    # Given a batch id its children could carry, but not its deadline job's id
    publisher, batch_id = _Publisher(), "b" * 1010
    # When the batch is published, Then it is refused in one line
    with pytest.raises(ConfigError, match="batch_id: job_id is 1025 bytes; Pub/Sub takes 1024"):
        workerpool.publish_batch(
            "projects/p/topics/t", [JobMessage("a", {}, "1")], on_complete="done",
            batch_id=batch_id, store=f"sqlite:///{tmp_path / 'fleet.db'}", publisher=publisher,
        )  # fmt: skip
    # ... having published and recorded nothing (no batch left "publishing" for good)
    assert publisher.published == []
    batches = SqliteBatches(tmp_path / "fleet.db")
    assert batches.get(batch_id) is None
    batches.close()


def test_confirmations_are_waited_for_until_the_timeout_after_the_last_answer() -> None:
    # Given publishes Pub/Sub confirms 10 s on, refuses 25 s on, confirms 20 s on; one the
    # client refused as it was sent; two Pub/Sub never answers, and one confirmed already
    clock, waits = FakeClock(0.0), []

    def sent(after: float, error: Exception | None = None) -> tuple[str, str, Confirmed]:
        return ("t", "", Confirmed(waits, clock.advance, after, f"m-{after:g}", error))

    unavailable, refused = RuntimeError("unavailable"), ValueError("refused by the client")
    publishes = [
        sent(10), sent(25, unavailable), sent(20), ("t", "", refused), sent(inf), sent(inf),
        sent(0),
    ]  # fmt: skip
    # When they are waited for with a timeout of 30 s
    results = confirm_all(object(), publishes, 30, monotonic=clock)
    # Then each answer, a refusal too, gives the next wait 30 s again, and once 30 s pass
    # with no answer the rest are not waited for: 85 s in all, not 30 s for each unanswered
    assert waits == [30, 30, 30, 30, 0, 0]
    assert results[:4] == ["m-10", unavailable, "m-20", refused] and results[6] == "m-0"
    assert all(isinstance(result, TimeoutError) for result in results[4:6])
    assert clock() == 85


def test_a_confirmation_that_timed_out_leaves_its_ordering_key_alone() -> None:
    # Given a publish with an ordering key that Pub/Sub does not answer in time, and two sent
    # together on another key that it refuses (the client pauses that key once)
    resumed: list[str] = []
    paused = {"key-2"}

    class Publisher:
        def resume_publish(self, topic: str, ordering_key: str) -> None:
            if ordering_key not in paused:
                raise RuntimeError("Ordering key is not paused.")
            paused.discard(ordering_key)
            resumed.append(ordering_key)

    waits: list[float] = []
    clock = FakeClock(0.0)
    unanswered = Confirmed(waits, clock.advance)
    refused = [
        Confirmed(waits, clock.advance, after=0, error=RuntimeError(f"unavailable {i}"))
        for i in range(2)
    ]
    # When each is waited for, Then the timeout is what the wait says, and the key is not
    # resumed (the publish is still under way: it is not paused)
    with pytest.raises(TimeoutError):
        confirmed(Publisher(), "t", "key-1", unanswered, 5)
    # ... and each refused one says why it was refused, its key resumed once
    for i, future in enumerate(refused):
        with pytest.raises(RuntimeError, match=f"unavailable {i}"):
            confirmed(Publisher(), "t", "key-2", future, 5)
    assert resumed == ["key-2"]
