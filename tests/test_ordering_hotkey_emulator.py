"""One hot ordering key's backlog against 20 other keys, with a real worker process on the
emulator: the hot key holds no more than its share of the worker's hold, so the other keys run
beside it from the moment they arrive, every key in order, nothing lost or run twice."""

from __future__ import annotations

import time
from pathlib import Path

from tests.support import (
    held_messages,
    ledger_events,
    spawn_worker,
    wait_for,
    worker_processes,
)
from tests.test_ordering_emulator import (
    _assert_one_at_a_time,
    _done_once,
    _out_of_order,
    _runs_by_key,
)
from workerpool.publishing import JobMessage, publish_many
from workerpool.testing.emulator import free_port
from workerpool.testing.pubsub import PubSubResources

_HOT, _KEYS, _PER_KEY, _N = 250, 20, 10, 8


def _jobs(keys: range, per_key: int, seconds: float) -> list[JobMessage]:
    """``per_key`` demo.sleep jobs of ``seconds`` for each key, the keys interleaved."""
    return [
        JobMessage("demo.sleep", {"seconds": seconds}, f"k{key}-{i:03d}", ordering_key=f"{key}")
        for i in range(per_key)
        for key in keys
    ]


def _publish(env: PubSubResources, messages: list[JobMessage]) -> None:
    for _ in publish_many(env.publisher, env.topic_path, messages):
        pass


def test_a_hot_keys_backlog_leaves_room_for_the_other_keys(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given an ordered subscription with one hot key of 250 jobs of 100 ms, and a worker of 8
    # slots that has just started it (its first pull brought only the hot key)
    pubsub_resources.provision(ordered=True)
    _publish(pubsub_resources, _jobs(range(_KEYS, _KEYS + 1), _HOT, 0.1))
    ledger = tmp_path / "ledger.jsonl"
    with worker_processes() as workers:
        port = free_port()
        workers.append(
            spawn_worker(
                pubsub_resources, ledger, "--max-outstanding", str(_N), "--metrics-port", str(port)
            )
        )
        assert wait_for(lambda: ledger_events(ledger, "start"), timeout=60, interval=0.005)
        # Then it holds no more than half of its 24 places, all of the hot key (without the
        # cap its first pull took all 24)
        held = [held_messages(port, pubsub_resources.subscription) for _ in range(5)]
        assert 0 < max(held) <= (_N + 2 * _N) // 2, held
        # When 20 other keys of 10 jobs of 20 ms each arrive (the first alone, so it is known
        # to be there before the rest have gone out)
        others = _jobs(range(_KEYS), _PER_KEY, 0.02)
        _publish(pubsub_resources, others[:1])
        published = time.time()
        _publish(pubsub_resources, others[1:])
        total = _HOT + _KEYS * _PER_KEY
        done = wait_for(lambda: len(ledger_events(ledger, "done")) >= total, timeout=120)
        assert done, workers[0].output()[-3000:]
    # Then every key ran in publish order, never two of a key at once, each job once
    runs = _runs_by_key(ledger)
    assert sorted(len(found) for found in runs.values()) == [_PER_KEY] * _KEYS + [_HOT]
    assert not _out_of_order(runs)
    _assert_one_at_a_time(runs)
    assert set(_done_once(ledger, total).values()) == {1}
    # And the other keys started at once and ran beside the hot key, in the room it left them
    # (their 7 slots 0.65-0.76 busy while they had work, 0.40-0.43 without the cap, run alone;
    # not asserted: with another emulator test beside it the emulator's slower ordered pulls
    # held them to 0.45 with the cap)
    hot = runs.pop(f"k{_KEYS}")
    first_other = min(r["start"] for found in runs.values() for r in found)
    last_other = max(r["end"] for found in runs.values() for r in found)
    hot_first = sum(published <= r["start"] < first_other for r in hot)
    hot_beside = sum(first_other <= r["start"] < last_other for r in hot)
    busy = sum(r["end"] - r["start"] for found in runs.values() for r in found)
    busy /= (last_other - first_other) * (_N - 1)
    print(f"\nthe other keys: first start {first_other - published:.2f}s after the first was "
          f"published, after {hot_first} hot runs; {hot_beside} hot runs while they ran "
          f"({last_other - first_other:.2f}s); their slots busy {busy:.2f}; held at the "
          f"hot key's first start: {held}")  # fmt: skip
    assert hot_first <= 5
    assert hot_beside > 0
