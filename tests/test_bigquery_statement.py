"""The BigQuery reverse-ETL plugin's pure logic: the statement (golden text, parsed back with
sqlglot's BigQuery dialect), the naming rules, job ids and labels, error classification, and
the launch/wait decisions against a fake client (no emulator can fail a job with
rateLimitExceeded or show a 409 race on demand)."""

from __future__ import annotations

import copy
import json
import re
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest
import requests
import sqlglot
from google.api_core import exceptions as gexc
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlglot import exp
from workerpool_jobs.bigquery_reverse_etl import ExportRequest, run_export
from workerpool_jobs.bigquery_reverse_etl.launch import (
    JOB_LABEL_VALUE,
    LABEL_JOB,
    api_failure,
    failure,
    job_ids,
    job_labels,
    label_value,
)
from workerpool_jobs.bigquery_reverse_etl.payload import INVALID_PAYLOAD, JOB_NAME, PluginConfig
from workerpool_jobs.bigquery_reverse_etl.statement import (
    build_query,
    quote_identifier,
    quote_string,
)

from tests.bigquery_fixture import EXAMPLE_PAYLOAD
from workerpool import Defer, JobContext, PermanentError, RetryableError
from workerpool.context import Flag
from workerpool.errors import ConfigError
from workerpool.payload import PayloadError, convert
from workerpool.registry import Registry, registry

PROJECT = "my-project"

EXAMPLE = EXAMPLE_PAYLOAD

GOLDEN_CSV = """\
EXPORT DATA OPTIONS (
  uri = 'https://bigtable.googleapis.com/projects/ads-serving/instances/segments-prod/appProfiles/retl/tables/segments',
  format = 'CLOUD_BIGTABLE',
  overwrite = true,
  auto_create_column_families = true
) AS
SELECT
  CAST(`user_id` AS STRING) AS rowkey,
  STRUCT(`segment`) AS `seg`
FROM `temp_source`"""

GOLDEN_TABLE = """\
EXPORT DATA OPTIONS (
  uri = 'https://bigtable.googleapis.com/projects/ads-serving/instances/segments-prod/appProfiles/retl/tables/segments',
  format = 'CLOUD_BIGTABLE',
  truncate = true
) AS
SELECT
  CAST(`user_id` AS STRING) AS rowkey,
  STRUCT(`segment`, `score`) AS `seg`,
  STRUCT(`country`) AS `geo`
FROM `warehouse-prod`.`marts`.`user_segments`"""


def request(**changes: Any) -> ExportRequest:
    """The example with ``changes`` applied (``"source.table": ...`` reaches into objects)."""
    data = copy.deepcopy(EXAMPLE)
    for path, value in changes.items():
        *parents, last = path.split(".")
        node = data
        for part in parents:
            node = node[part]
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return convert(ExportRequest, data)


def table_request(**changes: Any) -> ExportRequest:
    return request(
        source={"table": "warehouse-prod.marts.user_segments"},
        column_families={"seg": ["segment", "score"], "geo": ["country"]},
        options={"truncate": True},
        **changes,
    )


# --- The statement ------------------------------------------------------------------------------
def test_csv_source_golden_statement_and_temporary_table() -> None:
    query = build_query(request(), PROJECT)
    assert query.sql == GOLDEN_CSV
    assert {name: c.to_api_repr() for name, c in query.table_definitions.items()} == {
        "temp_source": {
            "sourceFormat": "CSV",
            "sourceUris": ["gs://bucket/segments/2026-11-30/*.csv"],
            "schema": {
                "fields": [
                    {"name": "user_id", "type": "STRING", "mode": "NULLABLE"},
                    {"name": "segment", "type": "STRING", "mode": "NULLABLE"},
                ]
            },
            "csvOptions": {"skipLeadingRows": "1"},
        }
    }


def test_table_source_golden_statement_has_no_temporary_table() -> None:
    query = build_query(table_request(), PROJECT)
    assert query.sql == GOLDEN_TABLE
    assert query.table_definitions == {}


def test_table_source_forms() -> None:
    # dataset.table runs in the config's project; domain-scoped projects keep their colon
    short = build_query(table_request(**{"source.table": "marts.user_segments"}), PROJECT)
    assert short.sql.endswith("FROM `my-project`.`marts`.`user_segments`")
    scoped = build_query(table_request(**{"source.table": "example.com:warehouse.m.t"}), PROJECT)
    assert scoped.sql.endswith("FROM `example.com:warehouse`.`m`.`t`")


def test_bytes_row_key_is_not_cast_and_other_types_are() -> None:
    schema = [{"name": "k", "type": "BYTES"}, {"name": "n", "type": "INT64"}]
    raw = build_query(
        request(**{"source.schema": schema, "row_key": "k", "column_families": {"f": ["n"]}}),
        PROJECT,
    )
    assert "  `k` AS rowkey," in raw.sql
    cast = build_query(
        request(**{"source.schema": schema, "row_key": "n", "column_families": {"f": ["k"]}}),
        PROJECT,
    )
    assert "  CAST(`n` AS STRING) AS rowkey," in cast.sql


def _parse(sql: str) -> exp.Export:
    tree = sqlglot.parse_one(sql, read="bigquery")
    assert isinstance(tree, exp.Export), type(tree)
    return tree


def _options(tree: exp.Export) -> dict[str, str]:
    options = {}
    for prop in tree.args["options"].expressions:
        if isinstance(prop, exp.FileFormatProperty):
            options["format"] = prop.this.name
        else:
            options[prop.this.name] = prop.args["value"].sql("bigquery")
    return options


def test_generated_statements_parse_as_bigquery_export_data() -> None:
    tree = _parse(build_query(request(), PROJECT).sql)
    assert _options(tree) == {
        "uri": "'https://bigtable.googleapis.com/projects/ads-serving/instances/segments-prod"
        "/appProfiles/retl/tables/segments'",
        "format": "CLOUD_BIGTABLE",
        "overwrite": "TRUE",
        "auto_create_column_families": "TRUE",
    }
    select = tree.this
    assert [e.alias for e in select.expressions] == ["rowkey", "seg"]
    assert isinstance(select.expressions[0].this, exp.Cast)
    struct = select.expressions[1].this
    assert isinstance(struct, exp.Struct)
    assert [c.name for c in struct.expressions] == ["segment"]
    assert select.args["from_"].this.name == "temp_source"
    # The table source parses to a three-part table reference, each part quoted
    table = _parse(build_query(table_request(), PROJECT).sql).this.args["from_"].this
    assert (table.catalog, table.db, table.name) == ("warehouse-prod", "marts", "user_segments")


_column = st.from_regex(r"\A[a-z_][a-z0-9_]{0,20}\Z").filter(
    lambda name: (
        not name.startswith(("_table_", "_file_", "_partition", "_change", "__root__"))
        and name.lower() != "rowkey"
    )
)


@settings(max_examples=60, deadline=None)
@given(
    row_key=_column,
    families=st.dictionaries(_column, st.lists(_column, min_size=1, max_size=4), min_size=1),
)
def test_any_valid_names_parse_back_to_exactly_those_names(
    row_key: str, families: dict[str, list[str]]
) -> None:
    families = {f: list(dict.fromkeys(q)) for f, q in families.items()}
    names = {row_key} | {q for qs in families.values() for q in qs}
    schema = [{"name": n, "type": "STRING"} for n in sorted(names)]
    if len({f.lower() for f in families}) != len(families):
        return
    req = request(**{"source.schema": schema, "row_key": row_key, "column_families": families})
    select = _parse(build_query(req, PROJECT).sql).this
    assert select.expressions[0].this.this.name == row_key
    parsed = {e.alias: [c.name for c in e.this.expressions] for e in select.expressions[1:]}
    assert parsed == families


# --- Naming rules: nothing from a message reaches SQL unchecked --------------------------------
BAD_PAYLOADS = [
    ({"row_key": "user_id` FROM x; DROP TABLE t; --"}, "row_key"),
    ({"row_key": "1user"}, "row_key"),
    ({"row_key": "_PARTITIONTIME"}, "row_key"),
    ({"row_key": "missing"}, "row_key"),
    ({"column_families": {"se`g": ["segment"]}}, "column_families['se`g']"),
    ({"column_families": {"seg": ["segment'"]}}, "column_families['seg'][0]"),
    ({"column_families": {"seg": ["segment", "SEGMENT"]}}, "column_families['seg'][1]"),
    ({"column_families": {"seg": ["segment"], "SEG": ["user_id"]}}, "column_families['SEG']"),
    ({"column_families": {"rowkey": ["segment"]}}, "column_families['rowkey']"),
    ({"column_families": {"seg": []}}, "column_families['seg']"),
    ({"column_families": {}}, "column_families"),
    ({"target.project": "p"}, "target.project"),  # the example: too short
    ({"target.instance": "i"}, "target.instance"),
    ({"target.project": "ads-serving/instances/x"}, "target.project"),
    ({"target.table": "segments'), format='CSV"}, "target.table"),
    ({"target.app_profile": "retl/tables/x"}, "target.app_profile"),
    ({"source.uris": ["https://example.com/x.csv"]}, "source.uris[0]"),
    ({"source.uris": ["gs://bucket/a\n.csv"]}, "source.uris[0]"),
    ({"source.uris": []}, "source.uris"),
    ({"source.format": "XML"}, "source.format"),
    ({"source.schema": None}, "source.schema"),
    ({"source.schema": [{"name": "user_id", "type": "STRING); DROP"}]}, "source.schema[0].type"),
    ({"source.schema": [{"name": "a b"}]}, "source.schema[0].name"),
    ({"source.table": "p.d.t"}, "source"),  # both uris and table
    ({"source": {"table": "warehouse-prod.marts.t`x"}}, "source.table"),
    ({"source": {"table": "just_a_table"}}, "source.table"),
    ({"source": {"table": "warehouse-prod.m.t", "format": "CSV"}}, "source.format"),
    ({"source": {}}, "source"),
    ({"location": "US'; --"}, "location"),
    ({"labels": {"Team": "ads"}}, "labels['Team']"),
    ({"labels": {"team": "Ads Team"}}, "labels['team']"),
    ({"labels": {"workerpool-job": "x"}}, "labels['workerpool-job']"),
]


@pytest.mark.parametrize(("changes", "field_path"), BAD_PAYLOADS)
def test_a_payload_that_breaks_a_naming_rule_is_a_permanent_error_naming_the_field(
    changes: dict[str, Any], field_path: str
) -> None:
    with pytest.raises(PermanentError) as raised:
        build_query(request(**changes), PROJECT)
    assert raised.value.error_type == INVALID_PAYLOAD
    assert str(raised.value).startswith(f"{field_path}: "), str(raised.value)


def test_payload_types_are_checked_by_the_framework_before_the_handler() -> None:
    data = copy.deepcopy(EXAMPLE)
    data["row_key"] = 7
    with pytest.raises(PayloadError, match=r"^row_key: expected str, got int$"):
        convert(ExportRequest, data)
    data = copy.deepcopy(EXAMPLE)
    data["target"]["tabel"] = "x"
    with pytest.raises(PayloadError, match=r"^target\.tabel: unexpected field$"):
        convert(ExportRequest, data)


@pytest.mark.parametrize("bad", ["a`b", "a\\b", "a\nb", "", "a\x00b"])
def test_quoting_refuses_what_could_end_the_quotes(bad: str) -> None:
    with pytest.raises(ValueError):
        quote_identifier(bad)
    if bad:
        with pytest.raises(ValueError):
            quote_string(bad.replace("`", "'"))


# --- Job ids and labels -------------------------------------------------------------------------
BIGQUERY_JOB_ID = re.compile(r"[A-Za-z0-9_-]{1,1024}")


@pytest.mark.parametrize(
    "job_id", ["seg-2026-11-30", "a/b c:d", "ü" * 10, "x" * 1024, "projects/p/jobs/1"]
)
def test_bigquery_job_ids_are_valid_deterministic_and_numbered_by_attempt(job_id: str) -> None:
    first, again = job_ids(job_id), job_ids(job_id)
    assert first(1) == again(1) and first(2) == again(2)
    assert first(1) != first(2) and first(2).endswith("-a2")
    assert BIGQUERY_JOB_ID.fullmatch(first(1)) and BIGQUERY_JOB_ID.fullmatch(first(99))
    assert len(first(99)) < 300


def test_job_ids_that_sanitize_alike_still_differ() -> None:
    assert job_ids("a/b")(1) != job_ids("a_b")(1) != job_ids("a b")(1)
    assert job_ids("seg-1")(1).startswith("workerpool-retl-seg-1-")


def test_labels_follow_bigquery_label_rules() -> None:
    key, value = re.compile(r"[a-z][a-z0-9_-]{0,62}"), re.compile(r"[a-z0-9_-]{0,63}")
    ctx = JobContext("bigquery.reverse_etl", "Seg/2026-11-30 " + "x" * 80, "m", 1, None, None)  # type: ignore[arg-type]
    labels = job_labels(ctx, {"team": "ads"}, 3)
    assert labels["team"] == "ads" and labels["workerpool-attempt"] == "3"
    assert labels[LABEL_JOB] == JOB_LABEL_VALUE == "bigquery-reverse_etl"
    assert all(key.fullmatch(k) and value.fullmatch(v) for k, v in labels.items()), labels
    assert label_value("seg-1") == "seg-1"  # kept as is when it already fits
    assert label_value("Seg-1") != label_value("seg-1")  # changed ones get a hash


# --- Errors and config --------------------------------------------------------------------------
def test_errors_from_job_status_are_classified_by_reason() -> None:
    rate = failure({"reason": "rateLimitExceeded", "message": "slow down"}, "j", last=False)
    assert isinstance(rate, RetryableError) and "rateLimitExceeded: slow down" in str(rate)
    final = failure({"reason": "backendError", "message": "oops"}, "j", last=True)
    assert isinstance(final, PermanentError) and final.error_type == "bigquery.backendError"
    bad = failure({"reason": "invalidQuery", "message": "Syntax error"}, "j", last=False)
    assert isinstance(bad, PermanentError) and bad.error_type == "bigquery.invalidQuery"
    assert "Syntax error (BigQuery job j)" in str(bad)
    concurrent = {"reason": "quotaExceeded", "message": "Too many concurrent queries"}
    assert isinstance(failure(concurrent, "j", last=False), RetryableError)
    daily = {"reason": "quotaExceeded", "message": "Daily export quota"}
    assert isinstance(failure(daily, "j", last=False), PermanentError)


@pytest.mark.parametrize(
    ("exc", "kind", "error_type"),
    [
        (gexc.Forbidden("x", errors=[{"reason": "rateLimitExceeded"}]), RetryableError, None),
        (gexc.TooManyRequests("x"), RetryableError, None),
        (gexc.ServiceUnavailable("x"), RetryableError, None),
        (gexc.InternalServerError("x", errors=[{"reason": "backendError"}]), RetryableError, None),
        (requests.exceptions.ConnectionError("refused"), RetryableError, None),
        (gexc.BadRequest("x", errors=[{"reason": "invalidQuery"}]), PermanentError, "invalidQuery"),
        (gexc.Forbidden("x", errors=[{"reason": "accessDenied"}]), PermanentError, "accessDenied"),
        (gexc.NotFound("x", errors=[{"reason": "notFound"}]), PermanentError, "notFound"),
        (gexc.BadRequest("x", errors=[{"reason": "invalid"}]), PermanentError, "invalid"),
    ],
)
def test_api_errors_are_classified(exc: Exception, kind: type, error_type: str | None) -> None:
    mapped = api_failure(exc, "insert")
    assert isinstance(mapped, kind)
    if error_type:
        assert isinstance(mapped, PermanentError) and mapped.error_type == f"bigquery.{error_type}"


def test_config_defaults_and_mistakes() -> None:
    # Given the plugin registered, When its section is converted as a worker does at start
    jobs = Registry()
    jobs.add(registry.get(JOB_NAME))  # type: ignore[arg-type]
    assert jobs.configs({})[JOB_NAME] == PluginConfig()
    config = jobs.configs({JOB_NAME: {"project": PROJECT, "max_concurrent_exports": 4}})[JOB_NAME]
    assert (config.project, config.location, config.max_concurrent_exports) == (PROJECT, "US", 4)
    assert config.concurrency_limits == {"bigquery-exports": 4}  # the worker declares these
    # Then each mistake stops the worker with the setting named
    for bad, says in [
        (
            {"slot_key": "exports:*"},
            "the section: ValueError: slot_key 'exports:*' must be a plain concurrency key",
        ),
        ({"max_concurrent_exports": "2"}, "max_concurrent_exports: expected int, got str"),
        ({"max_concurrent": 2}, "max_concurrent: unexpected field"),
        ({"location": "U S"}, "the section: ValueError: location 'U S' is not valid"),
        (
            {"defer_seconds": float("inf")},
            "the section: ValueError: bad poll_min_seconds, poll_max_seconds or defer_seconds",
        ),
    ]:
        with pytest.raises(ConfigError) as stopped:
            jobs.configs({JOB_NAME: bad})
        assert str(stopped.value) == f'[jobs."{JOB_NAME}"] {says}'


# --- Launch and wait, against a fake client -----------------------------------------------------
@dataclass
class FakeJob:
    job_id: str
    labels: dict[str, str]
    states: list[tuple[str, dict[str, str] | None]]  # what successive reloads show
    job_type: str = "query"
    cancelled: bool = False

    @property
    def state(self) -> str:
        return self.states[0][0]

    @property
    def error_result(self) -> dict[str, str] | None:
        return self.states[0][1]

    def reload(self, **_: Any) -> None:
        if len(self.states) > 1:
            self.states.pop(0)


@dataclass
class FakeClient:
    jobs: dict[str, FakeJob] = field(default_factory=dict)
    # what a job inserted next goes through: [(state, errorResult), ...]
    script: list[tuple[str, dict[str, str] | None]] = field(
        default_factory=lambda: [("RUNNING", None), ("DONE", None)]
    )
    inserts: list[str] = field(default_factory=list)
    conflict_on_insert: bool = False

    def get_job(self, job_id: str, **_: Any) -> FakeJob:
        if job_id not in self.jobs:
            raise gexc.NotFound(f"Job {job_id}")
        return self.jobs[job_id]

    def query(self, sql: str, *, job_config: Any, job_id: str, job_retry: Any, **_: Any) -> Any:
        assert job_retry is None
        if self.conflict_on_insert:  # another worker won the race to insert it
            self.jobs[job_id] = FakeJob(job_id, dict(job_config.labels), list(self.script))
            raise gexc.Conflict(f"Already Exists: Job {job_id}")
        self.inserts.append(job_id)
        job = self.jobs[job_id] = FakeJob(job_id, dict(job_config.labels), list(self.script))
        return job

    def list_jobs(self, state_filter: str, **_: Any) -> list[FakeJob]:
        return [j for j in self.jobs.values() if j.state.lower() == state_filter]

    def cancel_job(self, job_id: str, **_: Any) -> None:
        self.jobs[job_id].cancelled = True


def _ctx(job_id: str = "seg-1", **config: Any) -> JobContext:
    settings = {"project": PROJECT, "poll_min_seconds": 0.01, "poll_max_seconds": 0.02, **config}
    return JobContext(
        "bigquery.reverse_etl", job_id, "m-1", 1, None, Flag(), config=PluginConfig(**settings)
    )


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeClient:
    client = FakeClient()
    monkeypatch.setattr(
        "workerpool_jobs.bigquery_reverse_etl.client_factory", lambda p, loc: client
    )
    return client


def test_a_run_inserts_one_job_with_the_derived_id_and_labels(fake: FakeClient) -> None:
    run_export(_ctx(), request())
    assert fake.inserts == [job_ids("seg-1")(1)]
    labels = fake.jobs[fake.inserts[0]].labels
    assert labels["team"] == "ads" and labels["workerpool-job-id"] == "seg-1"
    run_export(_ctx(), request())  # delivered again after it finished: attaches, inserts nothing
    assert fake.inserts == [job_ids("seg-1")(1)]


def test_a_lost_insert_race_attaches_to_the_winner(fake: FakeClient) -> None:
    fake.conflict_on_insert = True
    run_export(_ctx(), request())
    assert fake.inserts == [] and list(fake.jobs) == [job_ids("seg-1")(1)]


def test_rate_limit_exceeded_is_retried_under_the_next_attempt_id(fake: FakeClient) -> None:
    # The first job ends with rateLimitExceeded: this delivery fails retryably ...
    fake.script = [("RUNNING", None), ("DONE", {"reason": "rateLimitExceeded", "message": "x"})]
    with pytest.raises(RetryableError, match="rateLimitExceeded"):
        run_export(_ctx(), request())
    # ... and the next one starts attempt 2 (attempt 1 cannot run again under its id)
    fake.script = [("RUNNING", None), ("DONE", None)]
    run_export(_ctx(), request())
    assert fake.inserts == [job_ids("seg-1")(1), job_ids("seg-1")(2)]


def test_retryable_failures_stop_at_max_export_attempts(fake: FakeClient) -> None:
    fake.script = [("DONE", {"reason": "backendError", "message": "x"})]
    with pytest.raises(RetryableError):
        run_export(_ctx(max_export_attempts=2), request())
    with pytest.raises(PermanentError) as raised:
        run_export(_ctx(max_export_attempts=2), request())
    assert raised.value.error_type == "bigquery.backendError"
    assert len(fake.inserts) == 2


def test_at_the_cap_the_message_is_deferred_without_inserting(fake: FakeClient) -> None:
    for i in range(2):
        fake.jobs[f"other-{i}"] = FakeJob(
            f"other-{i}", {LABEL_JOB: JOB_LABEL_VALUE}, [("RUNNING", None)]
        )
    fake.jobs["not-ours"] = FakeJob("not-ours", {}, [("RUNNING", None)])
    with pytest.raises(Defer) as raised:
        run_export(_ctx(defer_seconds=10), request())
    assert "2 exports running, at the cap of 2" in str(raised.value)
    assert raised.value.delay is not None and 7.5 <= raised.value.delay <= 12.5
    assert fake.inserts == []
    run_export(_ctx(max_concurrent_exports=3), request())
    assert len(fake.inserts) == 1


def test_drain_hands_the_message_back_and_leaves_the_job_running(fake: FakeClient) -> None:
    fake.script = [("RUNNING", None)]
    ctx = _ctx()
    threading.Timer(0.2, ctx.draining.set).start()
    with pytest.raises(Defer) as raised:
        run_export(ctx, request())
    assert raised.value.delay == 0
    assert not fake.jobs[job_ids("seg-1")(1)].cancelled


def test_the_jobs_own_timeout_cancels_the_bigquery_job(fake: FakeClient) -> None:
    fake.script = [("RUNNING", None)]
    ctx = _ctx()
    # What the framework's TimeLimit does at the timeout
    threading.Timer(0.3, lambda: (ctx.timed_out.set(), ctx.cancelled.set())).start()
    with pytest.raises(RetryableError, match=r"timed out after 0\.3s"):
        run_export(ctx, request(), timeout=0.3)
    assert fake.jobs[job_ids("seg-1")(1)].cancelled


def test_a_cancel_long_before_the_timeout_leaves_the_job_running(fake: FakeClient) -> None:
    fake.script = [("RUNNING", None)]
    ctx = _ctx()
    threading.Timer(0.2, ctx.cancelled.set).start()  # e.g. our claim was taken over
    with pytest.raises(RetryableError, match="left running"):
        run_export(ctx, request(), timeout=3600)
    assert not fake.jobs[job_ids("seg-1")(1)].cancelled


def test_module_constants_are_consistent() -> None:
    assert json.dumps(JOB_LABEL_VALUE)
