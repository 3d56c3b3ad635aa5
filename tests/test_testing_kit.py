"""The test kit's ``run_job`` without an emulator: how a job is named, configured and limited
(what it returns for each row of the decision table is checked against a real worker in
test_run_job_emulator.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from workerpool import JobContext
from workerpool.constants import Label
from workerpool.errors import ConfigError
from workerpool.registry import Registry
from workerpool.testing import run_job


@dataclass(frozen=True)
class Settings:
    greeting: str
    times: int = 1


def test_a_job_is_found_by_its_handler_or_its_name_and_gets_its_typed_config() -> None:
    # Given a job with a typed config that records what it was given
    jobs, seen = Registry(), []

    @jobs.job("kit.greet", config=Settings)
    def greet(ctx: JobContext, payload: dict[str, Any]) -> None:
        seen.append((ctx.job_id, ctx.delivery_attempt, ctx.config, payload))

    # When it is run by handler with a config section, and by name with a config object
    first = run_job(greet, {"to": "ada"}, jobs=jobs, config={"greeting": "hi"}, attempt=3)
    second = run_job("kit.greet", jobs=jobs, config=Settings("yo", 2), job_id="j-2")
    # Then both ran to done, each with its config as the worker would convert it
    assert (first.label, second.label) == (Label.DONE, Label.DONE)
    assert first.acked and first.delay is None and first.error_type is None
    assert seen == [
        ("test-job", 3, Settings("hi", 1), {"to": "ada"}),
        ("j-2", 1, Settings("yo", 2), {}),
    ]


def test_a_config_mistake_and_an_unknown_job_are_errors_not_outcomes() -> None:
    jobs = Registry()
    jobs.job("kit.greet", config=Settings)(lambda ctx, payload: None)
    with pytest.raises(ConfigError, match="greting: unexpected field"):
        run_job("kit.greet", jobs=jobs, config={"greeting": "hi", "greting": "typo"})
    with pytest.raises(KeyError, match=r"kit\.nope"):
        run_job("kit.nope", jobs=jobs)
    with pytest.raises(KeyError, match="not registered"):
        run_job(lambda ctx, payload: None, jobs=jobs)


def test_rate_limits_are_declared_for_acquire_and_never_wait_otherwise() -> None:
    # Given a job limited by @job(rate_limit=...) that also acquires from a second limiter
    jobs, waited = Registry(), []

    @jobs.job("kit.calls", rate_limit="partner")
    def calls(ctx: JobContext, payload: dict[str, Any]) -> None:
        waited.append(ctx.acquire("bulk", 1))

    # When it is run with the second limiter declared, Then it ran without waiting
    assert run_job(calls, jobs=jobs, rate_limits={"bulk": "10/s"}).label is Label.DONE
    assert waited == [0.0]
    # And without it, ctx.acquire fails as it would in a worker that does not declare it
    assert run_job(calls, jobs=jobs).label is Label.RETRIED
