"""Fixtures: one Pub/Sub emulator per session, fresh topics and subscriptions per test."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.support import PubSubEnv
from workerpool.testing import pubsub_emulator

PROJECT = "workerpool-test"


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
