"""Ordered subscriptions with real worker processes on the emulator: each key's jobs run one at
a time, in publish order, and the pool stays busy with the other keys.

Every check reads the jobs' own ledger (workerpool_jobs.demo): a line per run with its job id,
the process, and when it started and ended.
"""

from __future__ import annotations

import itertools
import random
import signal
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from tests.support import (
    WorkerProcess,
    ledger_events,
    pull_once,
    spawn_worker,
    wait_for,
    worker_processes,
)
from workerpool import publish, publish_batch
from workerpool.cli import main
from workerpool.publishing import JobMessage, publish_many
from workerpool.testing.pubsub import PubSubResources

# A killed worker's claims expire in 6 s and its leases lapse within 10 s.
_RECOVERY = ("--claim-ttl", "6", "--lease-extension", "10")

# Ledger outcomes of a run that ended (a retryable failure is a run too).
_ENDED = ("done", "retryable")


def _job_id(key: int, number: int) -> str:
    return f"k{key}-{number:03d}"


def _publish_keyed(
    env: PubSubResources,
    keys: int,
    per_key: int,
    seconds: Callable[[int, int], float],
    fails: Mapping[str, dict[str, Any]] | None = None,
    **provision: Any,
) -> None:
    """``per_key`` demo.sleep jobs for each of ``keys`` ordering keys, published as producers
    would, the keys interleaved; ``seconds(key, number)`` is each one's sleep, ``fails``
    adds to the payload of the job ids it names; ``provision`` to the subscription's."""
    messages = [
        JobMessage(
            "demo.sleep",
            {"seconds": seconds(key, number), **(fails or {}).get(_job_id(key, number), {})},
            _job_id(key, number),
            ordering_key=f"key-{key}",
        )
        for number in range(per_key)
        for key in range(keys)
    ]
    env.provision(ordered=True, **provision)
    for _ in publish_many(env.publisher, env.topic_path, messages):
        pass


def _runs_by_key(ledger: Path, pid: int | None = None) -> dict[str, list[dict[str, Any]]]:
    """Every ended run (of process ``pid``, if given), by key, in the order they started."""
    runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for outcome in _ENDED:
        for run in ledger_events(ledger, outcome, pid):
            runs[run["job_id"].split("-")[0]].append(run)
    return {key: sorted(found, key=lambda r: r["start"]) for key, found in runs.items()}


def _out_of_order(runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The keys whose runs did not start in publish order (a retried job again before the
    next one counts as in order)."""
    wrong = []
    for key, found in runs.items():
        order = [job_id for job_id, _ in itertools.groupby(r["job_id"] for r in found)]
        if order != sorted(order) or len(set(order)) != len(order):
            wrong.append(f"{key}: {order}")
    return wrong


def _assert_one_at_a_time(runs: dict[str, list[dict[str, Any]]]) -> None:
    """Each run of a key started only after the one before it ended."""
    for key, found in runs.items():
        for before, after in itertools.pairwise(found):
            assert before["end"] <= after["start"], (key, before, after)


def _assert_in_order_one_at_a_time(ledger: Path, keys: int, per_key: int) -> None:
    """Every job of every key ran, the key's in publish order, one at a time."""
    runs = _runs_by_key(ledger)
    assert sorted(runs) == sorted(f"k{key}" for key in range(keys))
    assert all(len({r["job_id"] for r in found}) == per_key for found in runs.values())
    assert not _out_of_order(runs)
    _assert_one_at_a_time(runs)


def _done_once(ledger: Path, expected: int) -> Counter[str]:
    done = _done_once_or_more(ledger)
    assert len(done) == expected, f"{len(done)} of {expected} job ids done"
    return done


def _done_once_or_more(ledger: Path) -> Counter[str]:
    return Counter(r["job_id"] for r in ledger_events(ledger, "done"))


def _busy_while_keys_wait(ledger: Path, n: int) -> float:
    """Mean running / N from the first start until fewer than N keys have work left."""
    runs = [r for outcome in _ENDED for r in ledger_events(ledger, outcome)]
    last_end = sorted(max(r["end"] for r in found) for found in _runs_by_key(ledger).values())
    begin, end = min(r["start"] for r in runs), last_end[len(last_end) - n]
    busy = sum(max(0.0, min(r["end"], end) - max(r["start"], begin)) for r in runs)
    return float(busy / ((end - begin) * n))


def _run_until_done(workers: list[WorkerProcess], ledger: Path, expected: int) -> None:
    assert wait_for(lambda: len(ledger_events(ledger, "done")) >= expected, timeout=120), (
        f"{len(ledger_events(ledger, 'done'))} of {expected} done\n" + workers[-1].output()[-3000:]
    )


def test_each_key_runs_in_order_one_at_a_time_and_the_pool_stays_busy(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given an ordered subscription with 20 keys of 50 jobs each, sleeping 0-50 ms
    rng = random.Random(7)
    _publish_keyed(pubsub_resources, 20, 50, lambda key, number: rng.uniform(0, 0.05))
    ledger = tmp_path / "ledger.jsonl"
    with worker_processes() as workers:
        # When one worker runs them, 8 at a time
        workers.append(spawn_worker(pubsub_resources, ledger, "--max-outstanding", "8"))
        _run_until_done(workers, ledger, 1000)
    # Then every key ran in publish order, never two of a key at once, each job once
    _assert_in_order_one_at_a_time(ledger, 20, 50)
    assert set(_done_once(ledger, 1000).values()) == {1}
    # And the pool kept its slots busy while at least 8 keys had work
    busy = _busy_while_keys_wait(ledger, 8)
    print(f"\nmean running / N while >= N keys had work: {busy:.2f}")
    assert busy >= 0.8


def test_a_failing_job_holds_its_key_back_and_no_other_key(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given 5 keys of 20 jobs each, where job 10 of key 3 fails twice with a retryable error
    failing = _job_id(3, 10)
    _publish_keyed(
        pubsub_resources, 5, 20, lambda key, number: 0.01,
        {failing: {"fail": "retryable", "fail_until": 3}}, retry_policy=False,
    )  # fmt: skip
    ledger = tmp_path / "ledger.jsonl"
    with worker_processes() as workers:
        # When one worker runs them, 4 at a time, retrying after 1 s (its own backoff: the
        # emulator does not space the redeliveries of a subscription's retry policy)
        workers.append(spawn_worker(pubsub_resources, ledger, "--max-outstanding", "4"))
        _run_until_done(workers, ledger, 100)
    # Then it ran three times, and no later job of key 3 started before its third run ended
    runs = [r for r in _runs_by_key(ledger)["k3"] if r["job_id"] == failing]
    assert [r["outcome"] for r in runs] == ["retryable", "retryable", "done"], runs
    _assert_in_order_one_at_a_time(ledger, 5, 20)
    # And every other key had finished before it succeeded: none waited for it
    succeeded = runs[-1]["start"]
    others = [r for key, found in _runs_by_key(ledger).items() if key != "k3" for r in found]
    first_failed = runs[0]["end"]
    others_ended = max(r["end"] for r in others)
    print(f"\nthe other keys ended {others_ended - first_failed:.2f}s after the first failure, "
          f"its success started {succeeded - first_failed:.2f}s after it")  # fmt: skip
    assert others_ended < succeeded


def test_a_job_that_exhausts_its_attempts_is_recorded_once_and_its_key_goes_on(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given 3 keys of 10 jobs each, where job 4 of key 1 always fails with a retryable error
    failing = _job_id(1, 4)
    _publish_keyed(
        pubsub_resources, 3, 10, lambda key, number: 0.01,
        {failing: {"fail": "retryable", "fail_until": 0}}, retry_policy=False,
    )  # fmt: skip
    ledger = tmp_path / "ledger.jsonl"
    with worker_processes() as workers:
        # When one worker runs them (the default: record and go on)
        workers.append(spawn_worker(pubsub_resources, ledger, "--max-outstanding", "4"))
        _run_until_done(workers, ledger, 29)
        records = pubsub_resources.dead_letters(expected=1, timeout=30)
    # Then it ran until its max_attempts and left one failure record
    runs = _runs_by_key(ledger)
    tries = [r for r in runs["k1"] if r["job_id"] == failing]
    assert len(records) == 1 and records[0].attributes["job_id"] == failing, records
    assert [r["outcome"] for r in tries] == ["retryable"] * len(tries) and len(tries) > 1
    # And its key went on after it, in order: every other job ran once, none of key 1's
    # later jobs before its last try
    assert set(_done_once(ledger, 29).values()) == {1}
    later = [r for r in runs["k1"] if r["job_id"] > failing]
    assert len(later) == 5 and min(r["start"] for r in later) >= tries[-1]["end"]
    assert not _out_of_order(runs)
    _assert_one_at_a_time(runs)


def test_two_workers_run_every_key_in_order_and_never_one_key_at_once(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    """Pub/Sub holds a key back while any of its messages is outstanding, so two workers
    never hold one key at once; and what one gives back comes back first, in order."""
    # Given 10 keys of 30 jobs each, sleeping 10-30 ms
    rng = random.Random(3)
    _publish_keyed(pubsub_resources, 10, 30, lambda key, number: rng.uniform(0.01, 0.03))
    ledger = tmp_path / "ledger.jsonl"
    with worker_processes() as workers:
        # When two worker processes run them, 4 at a time each
        for _ in range(2):
            workers.append(spawn_worker(pubsub_resources, ledger, "--max-outstanding", "4"))
        _run_until_done(workers, ledger, 300)
    # Then both ran jobs, and across them every key ran in publish order, never two at once,
    # and each job ran once
    by_worker = Counter(r["pid"] for r in ledger_events(ledger, "done"))
    print(f"\njobs per worker: {sorted(by_worker.values())}")
    assert len(by_worker) == 2
    _assert_in_order_one_at_a_time(ledger, 10, 30)
    assert set(_done_once(ledger, 300).values()) == {1}


def test_a_drain_and_a_restart_keep_every_key_in_order_and_lose_nothing(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    """A drained worker gives back the messages it holds behind a running one of their key;
    they lapse rather than being nacked, so they come back first, in the key's order."""
    # Given 10 keys of 30 jobs each, sleeping 20-50 ms, and a worker running them 4 at a time
    rng = random.Random(5)
    _publish_keyed(pubsub_resources, 10, 30, lambda key, number: rng.uniform(0.02, 0.05))
    ledger = tmp_path / "ledger.jsonl"
    with worker_processes() as workers:
        first = spawn_worker(pubsub_resources, ledger, "--max-outstanding", "4")
        workers.append(first)
        # When it gets SIGTERM a third of the way through, and a new worker starts after it
        assert wait_for(lambda: len(ledger_events(ledger, "done")) >= 100, timeout=60)
        first.signal(signal.SIGTERM)
        assert first.wait(30) == 0, first.output()
        drained = len(ledger_events(ledger, "done"))
        workers.append(spawn_worker(pubsub_resources, ledger, "--max-outstanding", "4"))
        _run_until_done(workers, ledger, 300)
    # Then across both every key ran in publish order, never two at once, nothing was lost
    # and no job id ran twice
    print(f"\n{drained} done before the drain ended, the rest after the restart")
    assert drained < 300
    _assert_in_order_one_at_a_time(ledger, 10, 30)
    assert set(_done_once(ledger, 300).values()) == {1}


def test_a_kill_and_a_restart_keep_every_key_in_order_and_run_no_job_twice(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    """A worker killed outright leaves its leases to lapse and its claims to expire (``--claim-
    ttl``): its messages come back first, in their key's order, and wait for their claims. A
    job whose run ended just before the kill, its completion not yet recorded, runs again
    (at least once): that, and only that, may run twice."""
    # Given 10 keys of 30 jobs each, sleeping 20-50 ms, and a worker running them 4 at a time
    rng = random.Random(11)
    _publish_keyed(pubsub_resources, 10, 30, lambda key, number: rng.uniform(0.02, 0.05))
    ledger = tmp_path / "ledger.jsonl"
    args = ("--max-outstanding", "4", *_RECOVERY)
    with worker_processes() as workers:
        first = spawn_worker(pubsub_resources, ledger, *args)
        workers.append(first)
        # When it is killed (SIGKILL) a third of the way through, and a new worker starts
        assert wait_for(lambda: len(ledger_events(ledger, "done")) >= 100, timeout=60)
        first.signal(signal.SIGKILL)
        first.wait(30)
        killed = len(ledger_events(ledger, "done"))
        workers.append(spawn_worker(pubsub_resources, ledger, *args))
        assert wait_for(lambda: len(_done_once_or_more(ledger)) >= 300, timeout=120), workers[
            -1
        ].output()[-3000:]
    # Then across both every key ran in publish order, never two at once, nothing was lost
    # and no job id ran to its end twice but one the killed worker ended unrecorded
    cut = Counter(r["job_id"] for r in ledger_events(ledger, "start")) - Counter(
        r["job_id"] for r in ledger_events(ledger, "done")
    )
    after = max(r["end"] for r in ledger_events(ledger, "done")) - workers[-1].launched
    done = _done_once_or_more(ledger)
    twice = {job_id for job_id, times in done.items() if times > 1}
    print(
        f"\n{killed} done before the kill; cut short by it: {sorted(cut)}; ended before it "
        f"and run again: {sorted(twice)}; the rest done {after:.1f}s after the restart"
    )
    assert killed < 300
    assert len(done) == 300 and max(done.values()) <= 2
    killed_ended = {r["job_id"] for r in ledger_events(ledger, "done", first.pid)}
    assert twice <= killed_ended and len(twice) <= 4, twice
    _assert_in_order_one_at_a_time(ledger, 10, 30)


def test_a_batch_runs_its_keyed_children_in_each_key_order_then_completes_once(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given an ordered subscription and a batch of 3 keys x 10 children, published with keys
    env = pubsub_resources
    env.provision(ordered=True)
    ledger = tmp_path / "ledger.jsonl"
    store = f"sqlite:///{tmp_path / 'claims.db'}"  # the workers' (``worker_command``)
    children = [
        JobMessage("demo.sleep", {"seconds": 0.01}, _job_id(key, number), ordering_key=f"key-{key}")
        for number in range(10)
        for key in range(3)
    ]
    with worker_processes() as workers:
        workers.append(spawn_worker(env, ledger, "--max-outstanding", "4"))
        batch_id = publish_batch(
            env.topic_path, children, on_complete="demo.batch_done", store=store,
            publisher=env.publisher,
        )  # fmt: skip
        # When a worker runs them
        complete = f"batch:{batch_id}:complete"
        assert wait_for(
            lambda: any(r["job_id"] == complete for r in ledger_events(ledger, "done")), timeout=60
        ), workers[0].output()
    # Then each key's children ran in publish order, one at a time, and the batch completed
    runs = {key: found for key, found in _runs_by_key(ledger).items() if key != complete}
    assert sorted(runs) == ["k0", "k1", "k2"]
    assert all(len(found) == 10 for found in runs.values())
    assert not _out_of_order(runs)
    _assert_one_at_a_time(runs)
    assert [r["job_id"] for r in ledger_events(ledger, "done")].count(complete) == 1


def test_the_cli_provisions_an_ordered_subscription_and_publishes_with_keys(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given a subscription made by `workerpool provision --ordered`
    env = pubsub_resources
    runner = CliRunner()
    made = runner.invoke(main, [
        "provision", "--project", env.project, "--topic", env.topic,
        "--subscription", env.subscription, "--dead-letter-topic", env.dead_letter_topic,
        "--ordered",
    ])  # fmt: skip
    assert made.exit_code == 0, made.output
    env.provisioned = True
    ordered = env.subscriber.get_subscription(request={"subscription": env.subscription_path})
    assert ordered.enable_message_ordering
    # When jobs are published with --ordering-key, from a --file with and without a key of
    # their own, and with workerpool.publish
    jsonl = tmp_path / "jobs.jsonl"
    jsonl.write_text(
        '{"job": "demo.echo", "job_id": "a", "ordering_key": "own"}\n'
        '{"job": "demo.echo", "job_id": "b"}\n'
    )
    target = ["publish", "--project", env.project, "--topic", env.topic]
    one = ["--job", "demo.echo", "--job-id", "c", "--data", "{}", "--ordering-key", "k"]
    for args in (["--file", str(jsonl), "--ordering-key", "flag"], one):
        result = runner.invoke(main, [*target, *args])
        assert result.exit_code == 0, result.output
    publish(env.topic_path, "demo.echo", job_id="d", ordering_key="api", publisher=env.publisher)
    # Then each message carries its key
    received = pull_once(env)
    keys = {m.message.attributes["job_id"]: m.message.ordering_key for m in received}
    assert keys == {"a": "own", "b": "flag", "c": "k", "d": "api"}


def test_a_delayed_job_is_published_again_with_its_key(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given an ordered subscription, and a second one on the topic to watch what is published
    env = pubsub_resources
    env.provision(ordered=True)
    watch = f"{env.subscription_path}-watch"
    env.subscriber.create_subscription(
        request={"name": watch, "topic": env.topic_path, "enable_message_ordering": True}
    )
    ledger = tmp_path / "ledger.jsonl"
    with worker_processes() as workers:
        workers.append(spawn_worker(env, ledger, "--max-outstanding", "2"))
        assert wait_for(workers[0].ready, timeout=30), workers[0].output()
        # When a job with a key is published to run 3 s from now
        later = timedelta(seconds=3)
        publish(env.topic_path, "demo.sleep", {"seconds": 0}, job_id="late",
                ordering_key="k", not_before=later, publisher=env.publisher)  # fmt: skip
        # Then it runs once it is due
        assert wait_for(lambda: ledger_events(ledger, "done"), timeout=30), workers[0].output()
    # And it was published again, with its key
    seen: list[tuple[str, str]] = []
    for _ in range(5):
        response = env.subscriber.pull(
            request={"subscription": watch, "max_messages": 10}, timeout=10
        )
        got = response.received_messages
        seen += [(m.message.message_id, m.message.ordering_key) for m in got]
        if got:  # acked, so the key's next message can come
            env.subscriber.acknowledge(
                request={"subscription": watch, "ack_ids": [m.ack_id for m in got]}
            )
        if len(seen) >= 2:
            break
    assert len({message_id for message_id, _ in seen}) == 2, seen
    assert [key for _, key in seen] == ["k", "k"]
