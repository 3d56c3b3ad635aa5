"""Middleware of the user's, named in the config, the environment or on the command line, run
by a real ``workerpool run`` process: around each job, inside the defaults."""

from __future__ import annotations

import json
import os
import signal
import textwrap
from pathlib import Path
from typing import Any

from tests.support import ledger_events, spawn_worker, wait_for, worker_processes
from workerpool.testing.pubsub import PubSubResources

# A plugin as a distribution would ship it: a module, and (``_install``) an entry point.
AUDIT_MODULE = """
import json, os, time

from workerpool import Middleware


def _write(**entry):
    with open(os.environ["AUDIT_LEDGER"], "a") as ledger:
        ledger.write(json.dumps(entry) + "\\n")


class Audit(Middleware):
    options = frozenset({"audited"})

    def __init__(self, name="audit"):
        self.name = name

    def around(self, run):
        job = run.job
        tag = job.spec.options.get("audited")
        _write(mw=self.name, event="enter", job_id=job.job_id, at=time.time(), tag=tag)
        outcome = yield
        _write(mw=self.name, event="leave", job_id=job.job_id, at=time.time(),
               outcome=type(outcome).__name__)
        return outcome

    def settled(self, event):
        _write(mw=self.name, event="settled", job_id=event.job_id,
               message_id=event.message_id, label=str(event.label))


class Inner(Audit):
    def __init__(self):
        super().__init__("inner")


def make_outer(settings):
    return Audit(f"outer of {settings.subscription}")
"""
# Jobs that take the plugin's own ``@job`` option: they load only if it was imported first.
AUDIT_JOBS = """
from workerpool import job


@job("audit.tagged", audited="yes")
def tagged(ctx, payload):
    pass
"""


def _install(tmp_path: Path) -> Path:
    """A folder to put on PYTHONPATH holding the plugin and a ``*.dist-info`` whose
    entry_points.txt advertises ``audit`` in the workerpool.middleware group: importlib.metadata
    finds it there as it would an installed distribution's."""
    plugin = tmp_path / "plugin"
    info = plugin / "audit_plugin-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: audit-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[workerpool.middleware]\naudit = audit_mw:Audit\n")
    (plugin / "audit_mw.py").write_text(textwrap.dedent(AUDIT_MODULE))
    (plugin / "audit_jobs.py").write_text(textwrap.dedent(AUDIT_JOBS))
    return plugin


def _environment(plugin: Path, audit: Path) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(plugin), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "AUDIT_LEDGER": str(audit)}


def _audit(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    text = path.read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


def _events(audit: Path, event: str, mw: str) -> list[dict[str, Any]]:
    return [e for e in _audit(audit) if e["event"] == event and e["mw"] == mw]


def _settled(audit: Path, message_id: str) -> list[dict[str, Any]]:
    return [e for e in _events(audit, "settled", "audit") if e["message_id"] == message_id]


def test_an_entry_point_named_in_the_config_runs_around_each_job_inside_the_claim(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given a plugin advertising the middleware "audit" in the workerpool.middleware group, a
    # config naming it, and a worker running demo jobs and a job that takes its option
    pubsub_resources.provision()
    plugin, audit, ledger = _install(tmp_path), tmp_path / "audit.jsonl", tmp_path / "ledger.jsonl"
    config = tmp_path / "workerpool.toml"
    config.write_text('[worker]\nmiddleware = ["audit"]\n')
    sleeps = ["a", "b", "c"]
    with worker_processes() as workers:
        worker = spawn_worker(
            pubsub_resources, ledger, "--config", str(config), "--jobs", "audit_jobs",
            extra_env=_environment(plugin, audit),
        )  # fmt: skip
        workers.append(worker)
        assert wait_for(worker.ready, timeout=60), worker.output()
        # When it runs three jobs, one of the plugin's, then a copy of a finished one
        pubsub_resources.publish_many("demo.sleep", [(j, {"seconds": 0.2}) for j in sleeps])
        pubsub_resources.publish("audit.tagged", {}, job_id="t")
        assert wait_for(lambda: len(_events(audit, "leave", "audit")) == 4, 30), worker.output()
        copy = pubsub_resources.publish("demo.sleep", {"seconds": 0.2}, job_id="a")
        assert wait_for(lambda: _settled(audit, copy), 30), worker.output()
        worker.signal(signal.SIGTERM)
        assert worker.wait(30) == 0, worker.output()

    # Then it entered and left each run once, around its handler, and saw each job's option
    enters = {e["job_id"]: e for e in _events(audit, "enter", "audit")}
    leaves = {e["job_id"]: e for e in _events(audit, "leave", "audit")}
    assert sorted(enters) == sorted(leaves) == [*sleeps, "t"]
    assert len(_events(audit, "enter", "audit")) == 4
    for run in ledger_events(ledger, "done"):
        job_id = run["job_id"]
        assert enters[job_id]["at"] <= run["start"] <= run["end"] <= leaves[job_id]["at"]
    assert {e["outcome"] for e in leaves.values()} == {"Succeeded"}
    assert enters["t"]["tag"] == "yes" and enters["a"]["tag"] is None
    # And the copy of a finished job, ended by the claim (a default), never reached it,
    # though it heard how that copy was settled
    assert [e["label"] for e in _settled(audit, copy)] == ["duplicate"]


def test_module_paths_on_the_command_line_run_in_the_order_named(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given a worker started with --middleware audit_mw:make_outer (a factory of the
    # Settings) then --middleware audit_mw:Inner (a class), and no entry point installed
    pubsub_resources.provision()
    plugin, audit, ledger = _install(tmp_path), tmp_path / "audit.jsonl", tmp_path / "ledger.jsonl"
    (plugin / "audit_plugin-0.1.dist-info" / "entry_points.txt").unlink()
    outer = f"outer of {pubsub_resources.subscription}"
    jobs = ["x", "y", "z"]
    with worker_processes() as workers:
        worker = spawn_worker(
            pubsub_resources, ledger,
            "--middleware", "audit_mw:make_outer", "--middleware", "audit_mw:Inner",
            extra_env=_environment(plugin, audit),
        )  # fmt: skip
        workers.append(worker)
        assert wait_for(worker.ready, timeout=60), worker.output()
        # When it runs three jobs
        pubsub_resources.publish_many("demo.sleep", [(j, {"seconds": 0.1}) for j in jobs])
        assert wait_for(lambda: len(_events(audit, "leave", outer)) == 3, 30), worker.output()
        worker.signal(signal.SIGTERM)
        assert worker.wait(30) == 0, worker.output()

    # Then each run went through the first named, then the second, then the handler, and out
    # the other way
    for job_id in jobs:
        steps = [
            (e["mw"], e["event"])
            for e in _audit(audit)
            if e["job_id"] == job_id and e["event"] != "settled"
        ]
        assert steps == [(outer, "enter"), ("inner", "enter"), ("inner", "leave"), (outer, "leave")]
    done = {r["job_id"] for r in ledger_events(ledger, "done")}
    assert done == set(jobs)
