"""pytest fixtures for testing jobs against the Pub/Sub emulator; pytest loads this module by
itself wherever workerpool is installed (entry point ``pytest11``; ``-p no:workerpool`` turns
it off).

* ``pubsub_emulator`` (session): the emulator's host; ``PUBSUB_EMULATOR_HOST`` if set, else a
  testcontainers container where a Docker engine answers, else a local gcloud emulator process.
* ``pubsub_resources``: a fresh topic, subscription and dead-letter topic for one test
  (``workerpool.testing.pubsub.PubSubResources``): ``publish``, ``dead_letters``, ...
* ``worker``: starts in-process workers on them, ``worker(jobs=["mypkg.jobs"], max_outstanding=4)``
  with any setting ``workerpool run`` takes; each is drained and stopped at teardown.
  ``workerpool.testing.wait_settled(w, n)`` waits until ``n`` messages have left it.

A test that uses any of them is marked ``emulator``, so ``pytest -m "not emulator"`` is the
fast tier. Everything heavy is imported inside the fixtures, so a test session that uses none
of them pays nothing for this plugin.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from workerpool.assembly.launcher import Launcher
    from workerpool.testing.pubsub import PubSubResources

# The emulator takes any project id; ``PUBSUB_PROJECT_ID`` picks another.
PROJECT = os.environ.get("PUBSUB_PROJECT_ID", "workerpool-test")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "emulator: needs the Pub/Sub emulator")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        # Every fixture of this plugin stands on pubsub_emulator.
        if "pubsub_emulator" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.emulator)


@pytest.fixture(scope="session")
def pubsub_emulator() -> Iterator[str]:
    from workerpool.testing import pubsub_emulator as find_emulator

    with find_emulator(PROJECT) as (host, how):
        previous = os.environ.get("PUBSUB_EMULATOR_HOST")
        os.environ["PUBSUB_EMULATOR_HOST"] = host
        print(f"\nPub/Sub emulator at {host} ({how})")
        try:
            yield host
        finally:
            if previous is None:
                os.environ.pop("PUBSUB_EMULATOR_HOST", None)
            else:
                os.environ["PUBSUB_EMULATOR_HOST"] = previous


@pytest.fixture
def pubsub_resources(pubsub_emulator: str) -> Iterator[PubSubResources]:
    from workerpool.testing.pubsub import PubSubResources

    resources = PubSubResources(PROJECT, pubsub_emulator)
    try:
        yield resources
    finally:
        resources.close()


@pytest.fixture
def worker(pubsub_resources: PubSubResources) -> Iterator[Callable[..., Launcher]]:
    with contextlib.ExitStack() as running:

        def start(jobs: Any = None, **settings: Any) -> Launcher:
            from workerpool.registry import registry

            launcher: Launcher = running.enter_context(
                pubsub_resources.worker(registry if jobs is None else jobs, **settings)
            )
            return launcher

        yield start
