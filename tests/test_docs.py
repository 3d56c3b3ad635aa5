"""The README stays short and points into the docs site, and every topic the long README
covered has its page there (``make docs`` checks that the site builds, links and all)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"

# The set-up commands, exactly as the README has always given them (.ci/run runs the second).
SET_UP = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[dev]' && workerpool demo",
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[dev]' -e examples/reports"
    " && python -m pytest -n 3",
)

# Each section of the README before the docs site, and the page its text moved to.
PAGES = {
    "Set up": "getting-started.md",
    "Writing jobs": "guide/jobs.md",
    "Async jobs": "guide/async-jobs.md",
    "Testing your jobs": "guide/testing.md",
    "Message contract": "reference/message-contract.md",
    "What happens to a message": "reference/outcomes.md",
    "Running": "guide/running.md",
    "Configuration": "guide/configuration.md",
    "Draining, idempotency and crash safety": "guide/draining-and-idempotency.md",
    "Rate limits and several pools": "guide/rate-limits.md",
    "Fleet-wide concurrency limits": "guide/fleet-wide-limits.md",
    "Delayed jobs": "guide/delayed-jobs.md",
    "Batches": "guide/batches.md",
    "Autoscaling": "guide/autoscaling.md",
    "On Cloud Run, Kubernetes and KEDA": "guide/autoscaling.md",
    "Why not the client library's `subscribe()`": "design.md",
    "Observability and operations": "guide/observability.md",
    "BigQuery reverse ETL": "guide/bigquery-reverse-etl.md",
    "Development": "development.md",
}

_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_the_readme_is_short_and_keeps_the_set_up_commands() -> None:
    # Given the README
    text = README.read_text()
    # Then it fits in 250 lines and gives both set-up commands unchanged
    assert len(text.splitlines()) <= 250
    for command in SET_UP:
        assert command in text


def test_every_former_readme_section_has_a_page_in_the_site() -> None:
    # Given the site's navigation
    nav = (ROOT / "mkdocs.yml").read_text()
    for section, page in PAGES.items():
        # Then each section's page exists and the navigation lists it
        assert (DOCS / page).is_file(), f"{section}: docs/{page} is missing"
        assert f": {page}" in nav, f"{section}: docs/{page} is not in mkdocs.yml's nav"


def test_the_readme_links_resolve_to_files_of_the_repository() -> None:
    # Given the README's relative links (they are read on GitHub as well as next to the site)
    links = [link for link in _LINK.findall(README.read_text()) if "://" not in link]
    assert links
    # Then each names a file that exists
    missing = [link for link in links if not (ROOT / link).is_file()]
    assert missing == []


def test_the_code_cites_the_design_page_not_a_missing_design_file() -> None:
    # Given the sources
    sources = [*ROOT.glob("workerpool/**/*.py"), *ROOT.glob("jobs/**/*.py")]
    # Then none refers to DESIGN.md, which the repository does not have, and the page exists
    citing = [str(path.relative_to(ROOT)) for path in sources if "DESIGN" in path.read_text()]
    assert citing == []
    assert (DOCS / "design.md").is_file()


# The word "issue" or "session" and a number: a tracker's or a diary's numbering means nothing
# to a reader of the code or the docs.
TRACKER_NUMBER = re.compile(r"\b(issues? #?|sessions? )\d+", re.IGNORECASE)


def test_no_code_test_or_page_names_a_tracker_issue_or_a_session_by_number() -> None:
    # Given the code, the tests, the benchmarks and the docs (the dated benchmark history aside)
    roots = ["workerpool", "jobs", "tests", "bench", "docs", "examples"]
    files = [p for r in roots for p in (ROOT / r).rglob("*") if p.suffix in {".py", ".md"}]
    files.append(ROOT / "README.md")
    # Then none names an issue by its number
    naming = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in files
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if TRACKER_NUMBER.search(line)
    ]
    assert naming == []
