"""The project's tests use the fixtures of its own pytest plugin (``workerpool.pytest_plugin``:
one Pub/Sub emulator per session, fresh resources and in-process workers per test), the same
code path job authors test with.

Every test that needs an emulator is marked ``emulator``, from what it uses (the plugin marks
those on its own fixtures; here, the other emulators), so ``pytest -m "not emulator"`` is the
fast unit tier without anyone marking tests by hand.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from workerpool.testing.emulator import LocalEmulator, gcloud_available
from workerpool.worker.timers import Timers

# The tests write the bytecode they compile, whatever the environment says: with
# PYTHONDONTWRITEBYTECODE set (as container images often do), every test process and every
# worker process a test starts compiled the package from source again. This module is loaded
# before pytest-xdist starts its workers, so they and their children inherit the change.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# The project the Firestore emulator's stores live in (idempotency claims, slots).
FIRESTORE_PROJECT = "workerpool-idempotency"

# The project's own fixtures that start (or need) another emulator than Pub/Sub's.
EMULATOR_FIXTURES = frozenset({"firestore_emulator", "bigquery_host"})
# Parametrized backends that live on an emulator.
EMULATOR_PARAMS = frozenset({"firestore"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if (
            EMULATOR_FIXTURES & set(getattr(item, "fixturenames", ()))
            or EMULATOR_PARAMS & {value for value in params.values() if isinstance(value, str)}
            or "_emulator" in item.path.stem  # starts an emulator process of its own
        ):
            item.add_marker(pytest.mark.emulator)
    _alone_first(items)


def _alone_first(items: list[pytest.Item]) -> None:
    """Under -n 3, an ``alone`` test waits for the tests under way on the other processes to
    end, tens of seconds each time, while the machine runs below its cores. So the files with
    such tests come first, and their ``alone`` tests first in each: the processes start on
    them together, and they wait mostly for each other. The other files follow, those with
    emulator tests (seconds to minutes each) before the unit ones, so that the run does not
    end on one process working through a long file alone; each group by how many tests its
    files have, most first, as pytest-xdist orders them by itself (which the README's
    command turns off, ``--no-loadscope-reorder``, for this order to hold)."""
    alone_files = {item.path for item in items if item.get_closest_marker("alone")}
    # (The plugin marks its own fixtures' users after this hook: those are read here too.)
    emulator_files = {
        item.path
        for item in items
        if item.get_closest_marker("emulator")
        or "pubsub_emulator" in getattr(item, "fixturenames", ())
    }
    per_file = Counter(item.path for item in items)
    items.sort(
        key=lambda item: (
            item.path not in alone_files,
            item.path not in emulator_files,
            -per_file[item.path],
            str(item.path),
            item.get_closest_marker("alone") is None,
        )
    )


@pytest.fixture(autouse=True)
def _alone_when_marked(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """Under pytest-xdist (``-n 3``), a test marked ``alone`` runs while no other test does:
    its figure is a rate or a share of time that other tests' processes, on the same
    cores, would bend. Every test holds a shared lock, an ``alone`` test the exclusive one;
    a turnstile taken first stops a stream of shared holders from starving it."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    root = Path(tmp_path_factory.getbasetemp()).parent  # shared by this run's workers
    alone = request.node.get_closest_marker("alone") is not None
    with open(root / "alone.lock", "a") as gate, open(root / "turnstile.lock", "a") as turn:
        fcntl.flock(turn, fcntl.LOCK_EX)
        fcntl.flock(gate, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(turn, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
            fcntl.flock(turn, fcntl.LOCK_UN)


@pytest.fixture
def timers() -> Iterator[Timers]:
    """A running timer thread, closed after the test."""
    timers = Timers()
    timers.start()
    yield timers
    timers.close(1.0)


@pytest.fixture(scope="session")
def firestore_emulator() -> Iterator[LocalEmulator]:
    """One Firestore emulator per session; each test uses collections of its own."""
    if not gcloud_available():
        reason = "gcloud CLI not installed: Firestore emulator unavailable"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    with LocalEmulator(kind="firestore", project=FIRESTORE_PROJECT) as emulator:
        yield emulator


@pytest.fixture(scope="session")
def warm_firestore(firestore_emulator: LocalEmulator) -> LocalEmulator:
    """The Firestore emulator after 800 slot grants and releases from four threads:
    its first seconds on a cold JVM answer writes in 0.1-1 s (measured: a key's busy share
    0.69-0.76 on a fresh emulator, 0.90-0.95 on one other tests had used), which real
    Firestore, warm all the time, never shows. A figure of the store's behaviour is measured
    on a warm one. In a process of its own: the slot store's listeners end with it (a
    listener's stream closed later by the emulator raised in a thread of the test process)."""
    env = {**os.environ, firestore_emulator.env_var: firestore_emulator.host}
    subprocess.run([sys.executable, "-c", _WARM_UP], env=env, check=True, timeout=120)
    return firestore_emulator


_WARM_UP = f"""
import threading, uuid
from workerpool.slots.firestore import FirestoreSlots

store = FirestoreSlots({FIRESTORE_PROJECT!r}, "warm-" + uuid.uuid4().hex[:8])

def cycle(holder):
    for _ in range(200):
        store.acquire("warm", holder, 2, 30.0, wait=True)
        store.release_many([("warm", holder)], held_for=0.01)

threads = [threading.Thread(target=cycle, args=(f"h{{i}}",)) for i in range(4)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
store.close()
"""
