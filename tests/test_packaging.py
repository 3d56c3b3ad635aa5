"""What ``pip install workerpool`` puts on a machine: the framework and its built-in plugins
under names of their own (never a top-level ``jobs``), typed, complete."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from importlib.metadata import entry_points
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Where each installed package's source lives in the tree (pyproject's package-dir).
SOURCES = {"workerpool": ROOT / "workerpool", "workerpool_jobs": ROOT / "jobs"}


def _packages_in_the_tree() -> set[str]:
    found = set()
    for name, folder in SOURCES.items():
        for init in folder.rglob("__init__.py"):
            parts = init.parent.relative_to(folder).parts
            found.add(".".join((name, *parts)))
    return found


def test_every_package_of_the_tree_is_listed_for_installation() -> None:
    # Given pyproject's explicit package list (explicit because jobs/ installs under a mapping)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(project["tool"]["setuptools"]["packages"])
    # Then it is exactly the packages in the tree: none forgotten, none stale
    assert listed == _packages_in_the_tree()
    assert project["tool"]["setuptools"]["package-dir"] == {"workerpool_jobs": "jobs"}


def test_the_plugins_install_as_workerpool_jobs_and_jobs_is_not_importable(
    tmp_path: Path,
) -> None:
    # Given the installed workerpool, seen from a folder that is not the repository
    probe = (
        "import importlib.util, workerpool_jobs.demo, workerpool_jobs.http_delivery\n"
        "print(importlib.util.find_spec('jobs'))\n"
    )
    # When a program imports the plugins and looks for a package named jobs
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    # Then the plugins are there under their own name, and there is no top-level jobs
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "None"
    plugins = {ep.name: ep.value for ep in entry_points(group="workerpool.jobs")}
    assert {name: plugins.get(name) for name in ("demo", "bigquery", "http")} == {
        "demo": "workerpool_jobs.demo",
        "bigquery": "workerpool_jobs.bigquery_reverse_etl",
        "http": "workerpool_jobs.http_delivery",
    }
    assert not [value for value in plugins.values() if value.split(".")[0] == "jobs"]


# In the full suite, outside the fast unit tier: pip builds the wheel in an environment of its
# own, installing its build backend into it first (seconds of I/O, all of it pip's).
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_wheel_holds_two_typed_top_level_packages(tmp_path: Path) -> None:
    # Given a wheel built from the tree
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp_path),
         str(ROOT)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    [wheel] = tmp_path.glob("workerpool-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    # Then its top level is workerpool and workerpool_jobs (and its metadata), nothing else,
    top = {name.split("/", 1)[0] for name in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"workerpool", "workerpool_jobs"}
    # both ship py.typed, and every package of the tree is in it
    assert {"workerpool/py.typed", "workerpool_jobs/py.typed"} <= set(names)
    packages = {name.rsplit("/", 1)[0].replace("/", ".") for name in names if "__init__" in name}
    assert packages == _packages_in_the_tree()
    # and the dashboard's templates and static files with it
    data = ROOT / "workerpool" / "dashboard"
    shipped = {
        str(f.relative_to(ROOT)) for d in ("templates", "static") for f in (data / d).iterdir()
    }
    assert shipped and shipped <= set(names)
