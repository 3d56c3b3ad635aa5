"""Bulk keys whose record is split into shards (``"20/bulk/2"``), shown with real worker
processes on the Pub/Sub emulator sharing an SQLite store that counts its writes by record:
the fleet runs at the key's limit with each shard's record written by its replicas only, and
a shard's idle slots reach a busy shard within a rebalance period or two; ``workerpool status``
shows the key once, each shard's part and the replicas' shares in it; and a fleet redeployed
with the key as one record gets its slots once the parts' lease ran out."""

from __future__ import annotations

import re
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.support import (
    WorkerProcess,
    count_slot_writes,
    ledger_events,
    overlap,
    read_ledger,
    run_to_the_end,
    shared_store,
    slot_writes,
    spawn_worker,
    start_bulk_workers,
    subscriptions_of_their_own,
    wait_for,
    worker_processes,
)
from workerpool import constants as c
from workerpool.cli import main
from workerpool.slots.parts import part_lease
from workerpool.slots.sharding import EARLY
from workerpool.slots.store import MIN_COME_BACK
from workerpool.testing.pubsub import PubSubResources

LIMIT = 20
SHARDS = 2
KEY = "demo-slots"


def shard_of(worker: WorkerProcess) -> int:
    """The shard the worker writes, as it logs at start."""
    found = re.search(r"writes shard (\d+) of", worker.output())
    assert found, worker.output()[-2000:]
    return int(found[1])


def two_on_each_shard(
    workers: list[WorkerProcess],
    envs: list[PubSubResources],
    ledger: Path,
    store: str,
    extra_env: dict[str, str],
) -> dict[int, list[WorkerProcess]]:
    """4 workers, started on ``envs``, two of them writing each shard: a replica's shard is a
    hash of its id, random per process, so a worker on a shard that has two already is
    stopped (before it takes any slot) and started again."""
    start_bulk_workers(workers, envs, ledger, LIMIT, store, extra_env, shards=SHARDS)
    for _ in range(20):
        on = Counter(shard_of(w) for w in workers)
        extra = next((w for w in workers if on[shard_of(w)] > len(workers) // SHARDS), None)
        if extra is None:
            break
        env = envs[workers.index(extra)]
        extra.kill()
        extra.wait(10)
        at = workers.index(extra)
        workers.remove(extra)
        start_bulk_workers(workers, [env], ledger, LIMIT, store, extra_env, shards=SHARDS)
        workers.insert(at, workers.pop())  # the worker on envs[at] stays at its place
    by_shard: dict[int, list[WorkerProcess]] = {}
    for worker in workers:
        by_shard.setdefault(shard_of(worker), []).append(worker)
    assert sorted(len(ws) for ws in by_shard.values()) == [2, 2], by_shard
    return by_shard


# (jobs, seconds each) by store, as for one record (test_slot_shares_emulator.py): on
# Firestore every job's claim and completion are writes too.
WORK = {"sqlite": (4000, 0.1), "firestore": (800, 0.5)}


@pytest.mark.alone
@pytest.mark.parametrize("kind", ["sqlite", "firestore"])
def test_a_key_in_two_shards_runs_at_its_limit_with_fewer_writes_per_document(
    kind: str, pubsub_resources: PubSubResources, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # Given 4 worker processes (N = 16) sharing a subscription and a store (SQLite: counting
    # its writes), a key of 20 slots leased in bulk in 2 shards, two workers on each
    pubsub_resources.provision(retry_policy=False)
    ledger = tmp_path / "ledger.jsonl"
    store, extra_env = shared_store(kind, request, tmp_path, warm=True)
    db = tmp_path / "fleet.db"  # (shared_store's SQLite file)
    if kind == "sqlite":
        count_slot_writes(db)
    count, seconds = WORK[kind]
    jobs = [(f"fast-{i}", {"seconds": seconds}) for i in range(count)]
    with worker_processes() as workers:
        two_on_each_shard(workers, [pubsub_resources] * 4, ledger, store, extra_env)
        # When 4,000 jobs of 100 ms (800 of 0.5 s) that take a slot of the key are published
        pubsub_resources.publish_many("demo.slot_sleep", jobs)
        codes = run_to_the_end(workers, ledger, count, timeout=150)
    done = ledger_events(ledger, "done")
    runs = [(r["start"], r["end"]) for r in done]
    first_start = min(start for start, _ in runs)
    backlog_until = max(start for start, _ in runs)  # from then on nothing waits for a slot
    backlog = backlog_until - first_start
    peak, busy = overlap(runs, until=backlog_until)
    written = Counter(
        key
        for key, at in (slot_writes(db) if kind == "sqlite" else [])
        if first_start <= at <= backlog_until
    )
    shards = {key: n / backlog for key, n in written.items() if key.startswith(KEY + "#")}
    per_worker = Counter(r["pid"] for r in done)
    print(
        f"{kind}: peak {peak} running, {busy / LIMIT:.3f} of {LIMIT} slots busy over "
        f"{backlog:.1f}s of backlog ({count / backlog:.0f} runs/s); writes a second: "
        f"{ {k: round(v, 2) for k, v in sorted(shards.items())} }, the key's own record "
        f"{written[KEY] / backlog:.2f}; per worker {sorted(per_worker.values())}"
    )
    # Then never more than 20 ran at once across the fleet (the jobs' own ledger), and the 20
    # were reached; the slots were kept busy while the backlog lasted; (SQLite) each shard's
    # record was written (by its own replicas) at most 5 times a second, as one record is,
    # and the key's own record twice a rebalance at most, rebalanced early at most 5 times a
    # period (while a shard is behind its fair part); every job ran once. (How the writes
    # split between the two shards is not judged here: a few writes a backlog, one more on
    # either side moves the split by a seventh; the split by replicas is the model's, with
    # 100 replicas, and the unit tests show each replica writes its own shard only.)
    assert peak == LIMIT
    assert busy / LIMIT >= 0.85
    if kind == "sqlite":
        assert len(shards) == SHARDS
        assert max(shards.values()) <= 5
        assert written[KEY] / backlog <= 2 * EARLY / c.SLOT_SHARD_REBALANCE
    assert sorted(r["job_id"] for r in done) == sorted(job_id for job_id, _ in jobs)
    assert len(per_worker) == 4
    assert codes == [0, 0, 0, 0]


def running_at(runs: list[tuple[float, float]], at: float) -> int:
    return sum(1 for start, end in runs if start <= at < end)


@pytest.mark.alone
def test_an_idle_shards_slots_reach_the_busy_shard_within_a_rebalance_period_or_two(
    pubsub_resources: PubSubResources, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # Given 4 worker processes (N = 16), each on a subscription of its own, sharing a key of
    # 20 slots in 2 shards, two workers on each
    with ExitStack() as stack:
        subs = subscriptions_of_their_own(stack, pubsub_resources, 4)
        ledger = tmp_path / "ledger.jsonl"
        store, extra_env = shared_store("sqlite", request, tmp_path)
        workers = stack.enter_context(worker_processes())
        by_shard = two_on_each_shard(workers, subs, ledger, store, extra_env)
        hot = by_shard[0]
        # When the workers of one shard get 500 jobs of 0.5 s each, those of the other 100
        # each (so at first both shards are busy, each with its half of the slots)
        published = {}
        for worker in workers:
            sub = subs[workers.index(worker)]
            many = 500 if worker in hot else 100
            jobs = [(f"{worker.pid}-{i}", {"seconds": 0.5}) for i in range(many)]
            sub.publish_many("demo.slot_sleep", jobs)
            published[worker.pid] = many
        codes = run_to_the_end(workers, ledger, sum(published.values()), timeout=150)
    done = ledger_events(ledger, "done")
    hot_pids = {w.pid for w in hot}
    hot_runs = [(r["start"], r["end"]) for r in done if r["pid"] in hot_pids]
    cold_runs = [(r["start"], r["end"]) for r in done if r["pid"] not in hot_pids]
    cold_over = max(end for _, end in cold_runs)  # the idle shard's last run ended
    backlog_until = max(start for start, _ in hot_runs)
    # When the busy shard's workers first ran the key's 20 at once, after the idle ones' end
    full = min(
        (start for start, _ in hot_runs
         if start >= cold_over and running_at(hot_runs, start + 1e-6) == LIMIT),
        default=float("inf"),
    )  # fmt: skip
    peak, _ = overlap([(r["start"], r["end"]) for r in done])
    after = [(s, e) for s, e in hot_runs if s >= full]
    _, busy_after = overlap(after, until=backlog_until) if after else (0, 0.0)
    both_busy = cold_over - min(s for s, _ in hot_runs)
    print(
        f"idle shard's last run ended {both_busy:.1f}s in; the "
        f"busy shard ran 20 at once {full - cold_over:.1f}s later, then {busy_after / LIMIT:.3f}"
        f" of the 20 busy until its backlog ran out ({backlog_until - full:.1f}s); peak {peak}"
    )
    # Then both shards ran at first; the busy shard's workers ran the key's 20 slots within
    # two rebalance periods of the other shard's end (its slots moved), and kept them busy;
    # never more than 20 ran at once; every job ran once
    assert both_busy > 0
    assert full - cold_over <= 2 * c.SLOT_SHARD_REBALANCE
    assert busy_after / LIMIT >= 0.85
    assert peak == LIMIT
    assert Counter(r["job_id"] for r in done) == Counter(
        {f"{pid}-{i}": 1 for pid, many in published.items() for i in range(many)}
    )
    assert codes == [0, 0, 0, 0]


def status_of_the_key(env: PubSubResources, store: str) -> list[str]:
    """``workerpool status`` (the fleet's declaration): the key's line and its shards'."""
    result = CliRunner().invoke(main, [
        "status", "--project", env.project, "--subscription", env.subscription,
        "--idempotency-store", store, "--concurrency", f"{KEY}={LIMIT}/bulk/{SHARDS}",
        "--concurrency", "tenant:*=1",
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(f"concurrency {KEY}"))
    return [line for line in lines[at:] if line.startswith((f"concurrency {KEY}", "  shard #"))]


def holding(line: str) -> dict[int, int]:
    """The slots each replica (by pid: a worker's id is host-pid-random) holds in a shard."""
    return {int(pid): int(n) for pid, n in re.findall(r"-(\d+)-\w+ (\d+) \(wants", line)}


@pytest.mark.alone
def test_status_shows_the_split_key_once_with_each_shards_part_and_its_replicas_shares(
    pubsub_resources: PubSubResources, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # Given 4 worker processes (N = 16) sharing a key of 20 slots in 2 shards, two on each
    pubsub_resources.provision(retry_policy=False)
    ledger = tmp_path / "ledger.jsonl"
    store, extra_env = shared_store("sqlite", request, tmp_path)
    jobs = [(f"slow-{i}", {"seconds": 1.0}) for i in range(300)]
    with worker_processes() as workers:
        by_shard = two_on_each_shard(workers, [pubsub_resources] * 4, ledger, store, extra_env)
        # When 300 jobs of 1 s are published, and status asked while they run, until every
        # worker holds slots in its shard
        pubsub_resources.publish_many("demo.slot_sleep", jobs)
        seen: list[list[str]] = []

        def all_holding() -> bool:
            seen.append(status_of_the_key(pubsub_resources, store))
            held = [holding(line) for line in seen[-1][1:]]
            return len(held) == SHARDS and all(
                set(held[shard]) == {w.pid for w in by_shard[shard]} and all(held[shard].values())
                for shard in range(SHARDS)
            )

        shown = wait_for(all_holding, timeout=30, interval=0.5)
        codes = run_to_the_end(workers, ledger, len(jobs), timeout=120)
    lines = seen[-1]
    print("\n".join(lines))
    # Then the key shows once, then a line for each shard (no shard record shows as a key):
    # each with its part of the 20 and the shares of the two workers writing it, no more
    # held in a shard than its part nor across the shards than the limit; every job ran once
    assert shown, "\n".join(lines)
    assert lines[0].split(":", 1)[0].strip() == f"concurrency {KEY}"
    assert lines[0].endswith(f"; in {SHARDS} shards")
    assert [line.split(":", 1)[0].strip() for line in lines[1:]] == ["shard #0", "shard #1"]
    parts = [int(re.findall(r":\s+part (\d+)", line)[0]) for line in lines[1:]]
    held = [sum(holding(line).values()) for line in lines[1:]]
    assert sum(parts) == LIMIT
    assert all(h <= p for h, p in zip(held, parts, strict=True)) and sum(held) <= LIMIT
    assert sorted(r["job_id"] for r in ledger_events(ledger, "done")) == sorted(
        job_id for job_id, _ in jobs
    )
    assert codes == [0, 0, 0, 0]


# A short slot TTL, so a part's lease (the TTL and two rebalance periods) is short too.
TTL = 6.0


@pytest.mark.alone
def test_a_split_key_redeployed_as_one_record_gets_every_slot_within_a_parts_lease(
    pubsub_resources: PubSubResources, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # Given 2 worker processes (N = 16, a slot TTL of 6 s) sharing a store, a key of 20
    # slots leased in bulk in 2 shards, that ran a backlog of 400 jobs of 100 ms and were
    # stopped (SIGTERM: the fleet redeployed)
    pubsub_resources.provision(retry_policy=False)
    store, extra_env = shared_store("sqlite", request, tmp_path)
    ttl = ("--slot-ttl", str(TTL))
    split_ledger = tmp_path / "split.jsonl"
    with worker_processes() as workers:
        start_bulk_workers(
            workers, [pubsub_resources] * 2, split_ledger, LIMIT, store, extra_env, *ttl,
            shards=SHARDS,
        )  # fmt: skip
        assert all(shard_of(w) in range(SHARDS) for w in workers)
        pubsub_resources.publish_many(
            "demo.slot_sleep", [(f"split-{i}", {"seconds": 0.1}) for i in range(400)]
        )
        codes = run_to_the_end(workers, split_ledger, 400, timeout=120)
    stopped = time.time()
    # When 2 workers keeping the key as one record ("20/bulk") start at once, with a backlog
    # of 600 jobs of 0.5 s
    ledger = tmp_path / "whole.jsonl"
    jobs = [(f"whole-{i}", {"seconds": 0.5}) for i in range(600)]
    with worker_processes() as workers:
        start_bulk_workers(workers, [pubsub_resources] * 2, ledger, LIMIT, store, extra_env, *ttl)
        pubsub_resources.publish_many("demo.slot_sleep", jobs)
        codes += run_to_the_end(workers, ledger, len(jobs), timeout=180)
    split = [(r["start"], r["end"]) for r in ledger_events(split_ledger, "done")]
    runs = [(r["start"], r["end"]) for r in ledger_events(ledger, "done")]
    first = min(start for start, _ in runs)
    full = min(start for start, _ in runs if running_at(runs, start + 1e-6) == LIMIT)
    bound = part_lease(TTL, c.SLOT_SHARD_REBALANCE)
    peak, _ = overlap(runs)
    print(
        f"split fleet peak {overlap(split)[0]}; one-record fleet: first run "
        f"{first - stopped:.1f}s after the split fleet stopped, {LIMIT} running "
        f"{full - stopped:.1f}s after (a part's lease: {bound:g}s), peak {peak}"
    )
    # Then the workers keeping one record ran the key's 20 at once within a part's lease
    # of the split fleet's stop (its last rebalance came before), and what their runs take
    # to get there: runs deferred while the key was held come back a second later at least,
    # and shares grow at rounds; never more than 20 ran at once, in either fleet (the jobs'
    # own ledger); every job ran once
    assert full - stopped <= bound + MIN_COME_BACK + 2 * c.SLOT_SHARE_PERIOD
    assert peak == LIMIT and overlap(split)[0] <= LIMIT
    assert sorted(r["job_id"] for r in ledger_events(ledger, "done")) == sorted(
        job_id for job_id, _ in jobs
    )
    assert len(split) == 400
    assert codes == [0, 0, 0, 0]


def test_a_job_whose_key_would_name_a_shard_record_gets_one_failure_record(
    pubsub_resources: PubSubResources, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # Given 2 worker processes (N = 16) sharing a store, each tenant's key of 5 slots leased
    # in bulk in 2 shards (the records of "tenant:acme"'s shards: "tenant:acme#0", "#1")
    pubsub_resources.provision(retry_policy=False)
    ledger = tmp_path / "ledger.jsonl"
    store, extra_env = shared_store("sqlite", request, tmp_path)
    jobs = [(f"ok-{i}", {"tenant": "acme", "seconds": 0.05}) for i in range(20)]
    with worker_processes() as workers:
        for _ in range(2):
            workers.append(
                spawn_worker(
                    pubsub_resources, ledger, "--jobs", "workerpool_jobs.demo_slots",
                    "--concurrency", "demo-slots=1", "--concurrency", "tenant:*=5/bulk/2",
                    "--max-outstanding", "16", store=store, extra_env=extra_env,
                )
            )  # fmt: skip
        assert wait_for(lambda: all(w.ready() for w in workers), timeout=60)
        # When a job whose tenant is "acme#0" (its key: shard 0's record of "tenant:acme") is
        # published with 20 jobs of tenant "acme"
        clash = {"tenant": "acme#0", "seconds": 0.05}
        pubsub_resources.publish("demo.tenant_sleep", clash, job_id="clash")
        pubsub_resources.publish_many("demo.tenant_sleep", jobs)
        records = pubsub_resources.dead_letters(expected=1, timeout=30)
        codes = run_to_the_end(workers, ledger, len(jobs), timeout=60)
        records += pubsub_resources.dead_letters(expected=1, timeout=2)
    # Then that job has one failure record, an invalid payload from its first delivery, and
    # never started; the others ran once each
    assert len(records) == 1, records
    failure = records[0].attributes
    assert failure[c.ATTR_ERROR_TYPE] == c.ERR_INVALID_PAYLOAD
    assert (failure[c.ATTR_JOB_ID], failure[c.ATTR_DELIVERY_ATTEMPT]) == ("clash", "1")
    assert "'tenant:acme#0'" in failure[c.ATTR_ERROR_MESSAGE]
    assert not [r for r in read_ledger(ledger) if r["job_id"] == "clash"]
    done = ledger_events(ledger, "done")
    assert sorted(r["job_id"] for r in done) == sorted(job_id for job_id, _ in jobs)
    assert codes == [0, 0]


def test_a_rolling_deploy_of_split_and_one_record_workers_keeps_the_limit_exact(
    pubsub_resources: PubSubResources, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # Given 4 worker processes (N = 16) sharing a subscription and a store, a key of 20
    # slots leased in bulk: two split its record in 2 shards, two keep it as one record (a
    # rolling deploy, either way)
    pubsub_resources.provision(retry_policy=False)
    ledger = tmp_path / "ledger.jsonl"
    store, extra_env = shared_store("sqlite", request, tmp_path)
    jobs = [(f"mixed-{i}", {"seconds": 0.1}) for i in range(2000)]
    envs = [pubsub_resources] * 2
    with worker_processes() as workers:
        start_bulk_workers(workers, envs, ledger, LIMIT, store, extra_env, shards=SHARDS)
        start_bulk_workers(workers, envs, ledger, LIMIT, store, extra_env)
        split_pids = {w.pid for w in workers[:2]}
        # When 2,000 jobs of 100 ms that take a slot of the key are published
        pubsub_resources.publish_many("demo.slot_sleep", jobs)
        codes = run_to_the_end(workers, ledger, len(jobs), timeout=150)
    done = ledger_events(ledger, "done")
    runs = [(r["start"], r["end"]) for r in done]
    backlog_until = max(start for start, _ in runs)
    peak, busy = overlap(runs, until=backlog_until)
    split = [(r["start"], r["end"]) for r in done if r["pid"] in split_pids]
    whole = [(r["start"], r["end"]) for r in done if r["pid"] not in split_pids]
    both = sum(1 for s, _ in split if running_at(whole, s) > 0)
    print(
        f"mixed fleet: peak {peak}, {busy / LIMIT:.3f} of the slots busy over the backlog; "
        f"runs {len(split)} split, {len(whole)} one record; {both} split runs started while "
        f"one-record runs ran"
    )
    # Then never more than 20 ran at once across both kinds (the jobs' own ledger), and the
    # 20 were reached; the slots were kept busy while the backlog lasted (a kind whose
    # replicas find nothing free is given its due within fifths of a rebalance period, not
    # a whole one); every job ran once. (How the jobs split between the kinds is not judged:
    # the emulator hands a shared backlog to whichever pulls first, and slots a shard's
    # shares gave back count in the key's record until the next rebalance.)
    assert peak == LIMIT
    assert busy / LIMIT >= 0.7
    assert sorted(r["job_id"] for r in done) == sorted(job_id for job_id, _ in jobs)
    assert codes == [0, 0, 0, 0]
