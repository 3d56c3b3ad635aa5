"""Naming middleware in the config (workerpool.assembly.named): what a name may point at, and
the order they are made in."""

from __future__ import annotations

from pathlib import Path

import pytest

from workerpool import Middleware, Settings
from workerpool.assembly import named
from workerpool.errors import ConfigError


class Recorder(Middleware):
    """A middleware a name can point at: made with no arguments."""


class Configured(Middleware):
    def __init__(self, settings: Settings) -> None:
        self.subscription = settings.subscription


def configured(settings: Settings) -> Middleware:
    """A factory a name can point at: called with the pool's Settings."""
    return Configured(settings)


def not_a_factory(settings: Settings) -> object:
    return settings


def test_classes_and_factories_are_made_in_the_order_named() -> None:
    settings = Settings(
        subscription="jobs-sub",
        middleware=("tests.test_named:configured", "tests.test_named:Recorder"),
    )
    first, second = named.build(settings)
    assert isinstance(first, Configured) and first.subscription == "jobs-sub"
    assert type(second) is Recorder


def test_a_factory_that_returns_no_middleware_is_a_config_error() -> None:
    settings = Settings(middleware=("tests.test_named:not_a_factory",))
    with pytest.raises(ConfigError, match=r"^middleware tests.test_named:not_a_factory: its "):
        named.build(settings)


def test_a_class_that_needs_arguments_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"^middleware tests.test_named:Configured: cannot make"):
        named.build(Settings(middleware=("tests.test_named:Configured",)))


def test_every_pools_names_are_checked_before_the_jobs_load() -> None:
    settings = Settings(
        middleware=("tests.test_named:Recorder",),
        pools=({"subscription": "a"}, {"subscription": "b", "middleware": ["tests:Nothing"]}),
    )
    with pytest.raises(ConfigError, match=r"^middleware tests:Nothing: tests has no Nothing$"):
        named.find_all(settings)


def test_an_entry_point_is_found_by_its_name_and_only_when_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a distribution on the path advertising "recorder" in workerpool.middleware
    info = tmp_path / "recorder_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: recorder-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[workerpool.middleware]\nrecorder = tests.test_named:Recorder\n"
        "missing = tests.test_named:Missing\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    # Then a worker that names nothing gets none of it, and one that names it gets it
    assert named.build(Settings()) == []
    [made] = named.build(Settings(middleware=("recorder",)))
    assert type(made) is Recorder
    # And one that names nothing is a ConfigError naming it
    with pytest.raises(ConfigError, match=r"^middleware missing: cannot import it \("):
        named.build(Settings(middleware=("missing",)))


def test_an_option_a_middleware_class_declares_is_accepted_by_job() -> None:
    from workerpool.registry import Registry

    jobs = Registry()
    with pytest.raises(TypeError, match="unknown option"):
        jobs.job("t.tagged", named_test_tag="x")

    class Tagging(Middleware):
        options = frozenset({"named_test_tag"})

    jobs.job("t.tagged", named_test_tag="x")(lambda ctx, payload: None)
    assert jobs.get("t.tagged") is not None
    assert Tagging.options == frozenset({"named_test_tag"})
