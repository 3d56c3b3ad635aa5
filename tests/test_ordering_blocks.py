"""The blocked-keys store (memory and SQLite) and the ``ordered_exhausted`` option."""

from __future__ import annotations

from pathlib import Path

import pytest

from workerpool import options
from workerpool.errors import ConfigError
from workerpool.ordering import MemoryBlocks, SqliteBlocks, blocked_lines, open_blocked_keys


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_a_key_is_blocked_until_unblocked(kind: str, tmp_path: Path) -> None:
    blocks = MemoryBlocks() if kind == "memory" else SqliteBlocks(tmp_path / "claims.db")
    blocks.block("key-a", "demo.sleep", "job-1")
    assert blocks.blocked("key-a") and not blocks.blocked("key-b")
    assert [(b.key, b.job, b.job_id) for b in blocks.all()] == [("key-a", "demo.sleep", "job-1")]
    assert blocks.unblock("key-a") and not blocks.unblock("key-a")
    assert not blocks.blocked("key-a") and blocks.all() == []


def test_the_sqlite_store_is_shared_by_whoever_opens_the_file(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'claims.db'}"
    open_blocked_keys(url).block("key-a", "demo.sleep", "job-1")
    assert blocked_lines(url) == ["blocked ordering key key-a: job demo.sleep (job-1)"]
    assert open_blocked_keys(url).unblock("key-a") and blocked_lines(url) == []


def test_a_store_that_keeps_no_blocks_is_one_clear_error() -> None:
    with pytest.raises(ConfigError, match="not none"):
        open_blocked_keys("none")
    assert blocked_lines("none") == []


def test_the_option_takes_record_or_block_only() -> None:
    options.check("j", {"ordered_exhausted": "block"})
    options.check("j", {"ordered_exhausted": "record"})
    with pytest.raises(ValueError, match="'record' or 'block'"):
        options.check("j", {"ordered_exhausted": "stop"})
