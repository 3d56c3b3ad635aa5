"""How ``Steps`` runs the two halves of each middleware's ``around``, in order, and what it
does with a middleware that ends a run early, raises, or does not keep to one yield."""

from __future__ import annotations

import pytest

from workerpool.context import Flag, JobContext
from workerpool.registry import Registry
from workerpool.testing.fakes import make_delivery
from workerpool.worker.envelope import Job, decode
from workerpool.worker.middleware import Around, Chain, Ended, Middleware, Steps
from workerpool.worker.outcome import AlreadyDone, Failed, Outcome, Succeeded
from workerpool.worker.run import Run


class Recorder(Middleware):
    """Writes down when each half of it runs and what it saw."""

    def __init__(self, name: str, heard: list[str], *, early: Outcome | None = None) -> None:
        self.name, self.heard, self.early = name, heard, early

    def around(self, run: Run) -> Around:
        self.heard.append(f"{self.name} before")
        if self.early is not None:
            return self.early
        try:
            outcome = yield
        except RuntimeError as exc:
            self.heard.append(f"{self.name} saw {exc}")
            raise
        self.heard.append(f"{self.name} after {type(outcome).__name__}")
        return outcome


class Before(Middleware):
    """Only a ``before``: writes down that it ran, and ends the run if told to."""

    def __init__(self, heard: list[str], *, early: Outcome | None = None) -> None:
        self.heard, self.early = heard, early

    def before(self, run: Run) -> Outcome | None:
        self.heard.append("before-only")
        return self.early


class BeforeAfter(Middleware):
    """A ``before`` and an ``after``, no generator: writes down each, and what it saw; its
    ``before`` ends the run if told to, its ``after`` changes the outcome if told to."""

    def __init__(
        self, name: str, heard: list[str], *, early: Outcome | None = None,
        instead: Outcome | None = None,
    ) -> None:  # fmt: skip
        self.name, self.heard, self.early, self.instead = name, heard, early, instead

    def before(self, run: Run) -> Outcome | None:
        self.heard.append(f"{self.name} before")
        return self.early

    def after(self, run: Run, ended: Ended) -> Ended:
        self.heard.append(f"{self.name} after {type(ended).__name__}")
        return ended if self.instead is None else self.instead


class Raises(Middleware):
    def around(self, run: Run) -> Around:
        raise RuntimeError("a bug before the yield")
        yield  # a generator, as every around is


class YieldsTwice(Middleware):
    def around(self, run: Run) -> Around:
        yield
        yield
        return Succeeded()


def _run() -> Run:
    jobs = Registry()
    jobs.job("t.ok")(lambda ctx, payload: None)
    job = decode(make_delivery(b"{}", {"job": "t.ok", "job_id": "a"}), jobs, attempt=1)
    assert isinstance(job, Job)
    ctx = JobContext("t.ok", "a", "m-1", 1, None, Flag())
    return Run(job, ctx, make_delivery(b"{}", {"job": "t.ok"}), lambda run, outcome: False)


def test_the_halves_before_run_outermost_first_and_the_halves_after_innermost_first() -> None:
    heard: list[str] = []
    steps = Steps(Chain([Recorder("outer", heard), Recorder("inner", heard)]), _run())
    assert steps.enter() is None
    heard.append("handler")
    assert steps.leave(Succeeded()) == Succeeded()
    assert heard == [
        "outer before", "inner before", "handler", "inner after Succeeded",
        "outer after Succeeded",
    ]  # fmt: skip


def test_a_middleware_that_ends_the_run_early_is_left_by_the_ones_outside_it_only() -> None:
    heard: list[str] = []
    steps = Steps(
        Chain([Recorder("outer", heard), Recorder("early", heard, early=AlreadyDone()),
               Recorder("never", heard)]),
        _run(),
    )  # fmt: skip
    ended = steps.enter()
    assert ended == AlreadyDone()
    assert steps.leave(ended) == AlreadyDone()
    assert heard == ["outer before", "early before", "outer after AlreadyDone"]


def test_a_before_hook_runs_in_its_place_and_an_outcome_from_it_ends_the_run() -> None:
    heard: list[str] = []
    chain = Chain([Recorder("outer", heard), Before(heard), Middleware(), Recorder("inner", heard)])
    assert len(chain.hooks) == 3  # a middleware that overrides neither hook is left out
    steps = Steps(chain, _run())
    assert steps.enter() is None
    assert steps.leave(Succeeded()) == Succeeded()
    assert heard == [
        "outer before", "before-only", "inner before", "inner after Succeeded",
        "outer after Succeeded",
    ]  # fmt: skip
    heard.clear()
    steps = Steps(Chain([Recorder("outer", heard), Before(heard, early=AlreadyDone()),
                         Recorder("never", heard)]), _run())  # fmt: skip
    assert steps.leave(steps.enter() or Succeeded()) == AlreadyDone()
    assert heard == ["outer before", "before-only", "outer after AlreadyDone"]


class Sometimes(Middleware):
    """Wraps only the runs of job ids it is told, as a plain method returning None for others."""

    def __init__(self, heard: list[str], wraps: str) -> None:
        self.heard, self.wraps = heard, wraps

    def around(self, run: Run) -> Around | None:
        return Recorder("some", self.heard).around(run) if run.job.job_id == self.wraps else None


def test_an_around_that_returns_none_leaves_that_run_alone() -> None:
    # Given a middleware between two others that wraps job id "a" only
    heard: list[str] = []
    for wraps, expected in [
        ("a", ["outer before", "some before", "inner before", "inner after Succeeded",
               "some after Succeeded", "outer after Succeeded"]),
        ("b", ["outer before", "inner before", "inner after Succeeded",
               "outer after Succeeded"]),
    ]:  # fmt: skip
        heard.clear()
        chain = Chain([Recorder("outer", heard), Sometimes(heard, wraps), Recorder("inner", heard)])
        steps = Steps(chain, _run())
        # When a run of "a" goes through it
        assert steps.enter() is None
        # Then it wraps the run when told to, and otherwise is skipped both ways
        assert steps.leave(Succeeded()) == Succeeded()
        assert heard == expected


class WrapsTheBase(Middleware):
    """An around written as a wrapper of ``Middleware.around``, as before it could be None."""

    def __init__(self, heard: list[str]) -> None:
        self.heard = heard

    def around(self, run: Run) -> Around:
        self.heard.append("wrapper before")
        outcome = yield from super().around(run)  # type: ignore[misc]
        self.heard.append(f"wrapper after {type(outcome).__name__}")
        return outcome  # type: ignore[no-any-return]


def test_an_around_that_wraps_the_base_one_still_works() -> None:
    heard: list[str] = []
    steps = Steps(Chain([WrapsTheBase(heard)]), _run())
    assert steps.enter() is None
    assert steps.leave(Succeeded()) == Succeeded()
    assert heard == ["wrapper before", "wrapper after Succeeded"]


@pytest.mark.parametrize(
    ("outer", "saw"),
    [(Recorder, "outer saw a bug before the yield"), (BeforeAfter, "outer after RuntimeError")],
)
def test_what_a_middleware_raises_reaches_the_ones_outside_it_and_then_the_caller(
    outer: type[Recorder | BeforeAfter], saw: str
) -> None:
    # (an around's part after its yield has it raised there; an after is given it, and
    # passes it on)
    heard: list[str] = []
    steps = Steps(Chain([outer("outer", heard), Raises()]), _run())
    ended = steps.enter()
    assert isinstance(ended, RuntimeError)
    with pytest.raises(RuntimeError, match="a bug before the yield"):
        steps.leave(ended)
    assert heard == ["outer before", saw]


def test_a_middleware_that_yields_twice_is_a_bug_named_by_the_error() -> None:
    steps = Steps(Chain([YieldsTwice()]), _run())
    assert steps.enter() is None
    with pytest.raises(RuntimeError, match=r"YieldsTwice.around yielded more than once"):
        steps.leave(Failed("X", "y"))


def test_the_wrapper_form_of_earlier_versions_is_refused_where_it_is_defined() -> None:
    with pytest.raises(TypeError, match=r"around\(run\)"):

        class Old(Middleware):
            def run(self, run: Run, call_next: object) -> Outcome:
                return Succeeded()


def test_an_after_hook_is_left_in_its_place_as_an_arounds_half_after_would_be() -> None:
    # Given a before-and-after between two arounds, and one innermost
    heard: list[str] = []
    chain = Chain(
        [
            Recorder("outer", heard),
            BeforeAfter("plain", heard),
            Recorder("inner", heard),
            BeforeAfter("last", heard, instead=AlreadyDone()),
        ]
    )
    # When a run goes through and its handler succeeds
    steps = Steps(chain, _run())
    assert steps.enter() is None
    heard.append("handler")
    # Then each after runs where the half after its yield would, innermost first, and what it
    # returns is the outcome the ones outside it see
    assert steps.leave(Succeeded()) == AlreadyDone()
    assert heard == [
        "outer before", "plain before", "inner before", "last before", "handler",
        "last after Succeeded", "inner after AlreadyDone", "plain after AlreadyDone",
        "outer after AlreadyDone",
    ]  # fmt: skip


def test_an_after_is_not_called_when_its_own_before_ended_the_run() -> None:
    heard: list[str] = []
    steps = Steps(Chain([BeforeAfter("outer", heard), BeforeAfter("early", heard,
                                     early=AlreadyDone())]), _run())  # fmt: skip
    assert steps.leave(steps.enter() or Succeeded()) == AlreadyDone()
    assert heard == ["outer before", "early before", "outer after AlreadyDone"]


class _Replace:
    """An ``after`` that is an object of its own, not a method: it turns the outcome into
    AlreadyDone."""

    def __call__(self, run: Run, ended: Ended) -> Ended:
        return AlreadyDone()


class _StaticAfter(Middleware):
    @staticmethod
    def after(run: Run, ended: Ended) -> Ended:
        return Failed("Replaced", "by a static after", None)


class _ObjectAfter(Middleware):
    after = _Replace()


@pytest.mark.parametrize(
    ("middleware", "outcome"),
    [
        (_StaticAfter(), Failed("Replaced", "by a static after", None)),
        (_ObjectAfter(), AlreadyDone()),
    ],
    ids=["static_method", "callable_object"],
)
def test_an_after_that_is_not_a_method_is_called_as_an_after(
    middleware: Middleware, outcome: Outcome
) -> None:
    # Given a middleware whose after is a static method, or a callable object, inside an around
    heard: list[str] = []
    steps = Steps(Chain([Recorder("outer", heard), middleware]), _run())
    # When a run goes through and its handler succeeds
    assert steps.enter() is None
    # Then the after is called with the run and its outcome, and the around outside sees what
    # it returned
    assert steps.leave(Succeeded()) == outcome
    assert heard == ["outer before", f"outer after {type(outcome).__name__}"]
