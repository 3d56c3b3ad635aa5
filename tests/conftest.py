"""Fixtures: one Pub/Sub emulator per session, fresh topics and subscriptions per test.

Every test that needs an emulator is marked ``emulator`` here, from what it uses, so
``pytest -m "not emulator"`` is the fast unit tier without anyone marking tests by hand.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.support import PubSubEnv
from workerpool.testing import pubsub_emulator

PROJECT = "workerpool-test"
# Fixtures that start (or need) an emulator, directly or through the fixtures they use.
EMULATOR_FIXTURES = frozenset({"emulator_host", "pubsub", "firestore_emulator", "bigquery_host"})
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


@pytest.fixture(scope="session")
def emulator_host() -> Iterator[str]:
    with pubsub_emulator(PROJECT) as (host, how):
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
def pubsub(emulator_host: str, request: pytest.FixtureRequest) -> Iterator[PubSubEnv]:
    env = PubSubEnv(PROJECT, emulator_host, request.node.name)
    try:
        yield env
    finally:
        env.close()
