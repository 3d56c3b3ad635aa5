"""The message payload and the plugin's config section, and the naming rules they are held to.

The framework converts the JSON object to ``ExportRequest`` and checks its types before the
handler runs. ``validate`` then checks every name against BigQuery's and Bigtable's rules, since
each one ends up in SQL or in a URI: nothing from a message reaches a statement unchecked.
Every problem is a ``PermanentError`` (``invalid_payload``) that names the field.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from workerpool import PermanentError

# The config section's name and the job's name are the same: [jobs."bigquery.reverse_etl"].
JOB_NAME = "bigquery.reverse_etl"
INVALID_PAYLOAD = "invalid_payload"


@dataclass
class Column:
    name: str
    type: str = "STRING"
    mode: str = "NULLABLE"


@dataclass
class Source:
    """Either files in Cloud Storage (``uris`` with a ``format``) or a BigQuery ``table``."""

    uris: list[str] | None = None
    format: str | None = None  # CSV (default for uris), NEWLINE_DELIMITED_JSON, PARQUET, ...
    skip_leading_rows: int | None = None  # CSV only
    field_delimiter: str | None = None  # CSV only
    max_bad_records: int | None = None
    schema: list[Column] | None = None  # required for CSV and JSON
    table: str | None = None  # "project.dataset.table" or "dataset.table"


@dataclass
class Target:
    project: str
    instance: str
    app_profile: str
    table: str


@dataclass
class Options:
    overwrite: bool = False
    truncate: bool = False
    auto_create_column_families: bool = False


@dataclass
class ExportRequest:
    source: Source
    row_key: str
    column_families: dict[str, list[str]]
    target: Target
    options: Options = field(default_factory=Options)
    location: str | None = None
    labels: dict[str, str] = field(default_factory=dict)


def invalid(path: str, problem: str) -> PermanentError:
    return PermanentError(f"{path}: {problem}", error_type=INVALID_PAYLOAD)


# --- Naming rules -------------------------------------------------------------------------------
# BigQuery column names (without flexible column names): letters, digits, underscores, not
# starting with a digit, at most 300 characters, and not one of the reserved prefixes.
COLUMN = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,299}")
RESERVED_COLUMN_PREFIXES = (
    "_table_", "_file_", "_partition", "_row_timestamp", "__root__", "_colidentifier",
    "_change_sequence_number", "_change_type", "_change_timestamp",
)  # fmt: skip
# A Bigtable column family is at most 64 of [-_.a-zA-Z0-9]; it is also the alias of a BigQuery
# column here, so it must be a BigQuery column name as well: the intersection of both rules.
FAMILY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
# Project ids: 6-30 of [a-z0-9-], starting with a letter, not ending with a hyphen; optionally
# domain-scoped ("example.com:my-project").
PROJECT = re.compile(r"(?:[a-z][a-z0-9.-]{0,61}[a-z0-9]:)?[a-z][a-z0-9-]{4,28}[a-z0-9]")
BIGTABLE_INSTANCE = re.compile(r"[a-z][a-z0-9-]{4,31}[a-z0-9]")  # 6-33 characters
BIGTABLE_APP_PROFILE = re.compile(r"[_a-zA-Z0-9][-_.a-zA-Z0-9]{0,49}")
BIGTABLE_TABLE = re.compile(r"[_a-zA-Z0-9][-_.a-zA-Z0-9]{0,49}")
DATASET = re.compile(r"[A-Za-z0-9_]{1,1024}")
# BigQuery allows more in table names (Unicode letters, spaces); we accept the portable subset.
TABLE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,1023}")
LOCATION = re.compile(r"[A-Za-z][A-Za-z0-9-]{1,29}")
LABEL_KEY = re.compile(r"[a-z][a-z0-9_-]{0,62}")
LABEL_VALUE = re.compile(r"[a-z0-9_-]{0,63}")
BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")
TYPES = frozenset(
    {
        "STRING", "BYTES", "INT64", "INTEGER", "FLOAT64", "FLOAT", "NUMERIC", "BIGNUMERIC",
        "BOOL", "BOOLEAN", "DATE", "DATETIME", "TIME", "TIMESTAMP", "JSON",
    }
)  # fmt: skip
MODES = frozenset({"NULLABLE", "REQUIRED"})
FORMATS = frozenset({"CSV", "NEWLINE_DELIMITED_JSON", "PARQUET", "AVRO", "ORC"})
SELF_DESCRIBING = frozenset({"PARQUET", "AVRO", "ORC"})
# Labels the plugin sets itself; a payload may not set anything under this prefix.
RESERVED_LABEL_PREFIX = "workerpool-"
MAX_PAYLOAD_LABELS = 60  # BigQuery allows 64 labels a job; the plugin sets 4
MAX_COLUMNS = 10_000


def check(pattern: re.Pattern[str], value: str, path: str, rule: str) -> str:
    if not pattern.fullmatch(value):
        raise invalid(path, f"{value!r} is not {rule}")
    return value


def check_column(name: str, path: str) -> str:
    check(COLUMN, name, path, "a BigQuery column name ([A-Za-z_][A-Za-z0-9_]*, <= 300)")
    if name.lower().startswith(RESERVED_COLUMN_PREFIXES):
        raise invalid(path, f"{name!r} starts with a prefix BigQuery reserves")
    return name


@dataclass(frozen=True)
class TableRef:
    project: str
    dataset: str
    table: str


def parse_table(reference: str, default_project: str | None, path: str) -> TableRef:
    """``project.dataset.table`` or ``dataset.table`` (in ``default_project``)."""
    project_part, _, rest = reference.rpartition(".")
    project_part, _, dataset = project_part.rpartition(".")
    table = rest
    project = project_part or default_project
    if not dataset or not table or project is None:
        raise invalid(path, f"{reference!r} is not project.dataset.table")
    check(PROJECT, project, path, "a valid project id")
    check(DATASET, dataset, path, "a valid dataset name")
    check(TABLE, table, path, "a valid table name ([A-Za-z0-9_-], <= 1024)")
    return TableRef(project, dataset, table)


def _check_uri(uri: str, path: str) -> None:
    bucket, _, name = uri.removeprefix("gs://").partition("/")
    if not uri.startswith("gs://") or not name or not BUCKET.fullmatch(bucket):
        raise invalid(path, f"{uri!r} is not gs://BUCKET/OBJECT")
    if any(ord(ch) < 0x20 or ch == "\x7f" for ch in name) or len(uri.encode()) > 1024:
        raise invalid(path, "control characters or longer than 1024 bytes")
    if name.count("*") > 1:
        raise invalid(path, "at most one '*' wildcard")


def _validate_schema(schema: list[Column]) -> set[str]:
    if len(schema) > MAX_COLUMNS:
        raise invalid("source.schema", f"more than {MAX_COLUMNS} columns")
    seen: set[str] = set()
    for i, column in enumerate(schema):
        path = f"source.schema[{i}]"
        check_column(column.name, f"{path}.name")
        if column.type.upper() not in TYPES:
            raise invalid(f"{path}.type", f"{column.type!r} is not one of {sorted(TYPES)}")
        if column.mode.upper() not in MODES:
            raise invalid(f"{path}.mode", f"{column.mode!r} is not NULLABLE or REQUIRED")
        if column.name.lower() in seen:
            raise invalid(f"{path}.name", f"{column.name!r} appears twice")
        seen.add(column.name.lower())
    return seen


def _validate_files(source: Source, uris: list[str]) -> str:
    """Check a source of files; return its format."""
    if not uris:
        raise invalid("source.uris", "at least one URI")
    for i, uri in enumerate(uris):
        _check_uri(uri, f"source.uris[{i}]")
    fmt = source.format or "CSV"
    if fmt not in FORMATS:
        raise invalid("source.format", f"{fmt!r} is not one of {sorted(FORMATS)}")
    csv_only = [
        n for n in ("skip_leading_rows", "field_delimiter") if getattr(source, n) is not None
    ]
    if fmt != "CSV" and csv_only:
        raise invalid(f"source.{csv_only[0]}", "only for CSV")
    if (source.skip_leading_rows or 0) < 0 or (source.max_bad_records or 0) < 0:
        raise invalid("source", "skip_leading_rows and max_bad_records must not be negative")
    if source.field_delimiter is not None and len(source.field_delimiter) != 1:
        raise invalid("source.field_delimiter", "must be one character")
    if not source.schema and fmt not in SELF_DESCRIBING:
        raise invalid("source.schema", f"required for {fmt}")
    return fmt


def _validate_source(source: Source, default_project: str | None) -> set[str] | None:
    """Check the source; return its column names (lowercased) when a schema declares them."""
    if source.uris is None and source.table is not None:
        extra = [f.name for f in fields(source) if f.name != "table" and getattr(source, f.name)]
        if extra:
            raise invalid(f"source.{extra[0]}", "only for a source with uris")
        parse_table(source.table, default_project, "source.table")
        return None
    if source.uris is None or source.table is not None:
        raise invalid("source", "give either uris or table")
    _validate_files(source, source.uris)
    return _validate_schema(source.schema) if source.schema else None


def _validate_families(request: ExportRequest, columns: set[str] | None) -> None:
    def known(name: str, path: str) -> None:
        if columns is not None and name.lower() not in columns:
            raise invalid(path, f"no column {name!r} in source.schema")

    check_column(request.row_key, "row_key")
    known(request.row_key, "row_key")
    if not request.column_families:
        raise invalid("column_families", "at least one column family")
    families: set[str] = set()
    total = 0
    for family, qualifiers in request.column_families.items():
        path = f"column_families[{family!r}]"
        check(FAMILY, family, path, "a column family name ([A-Za-z_][A-Za-z0-9_]*, <= 64)")
        if family.lower() == "rowkey" or family.lower().startswith(RESERVED_COLUMN_PREFIXES):
            raise invalid(path, f"{family!r} is reserved")
        if family.lower() in families:
            raise invalid(path, "appears twice (column names are case-insensitive in BigQuery)")
        families.add(family.lower())
        if not qualifiers:
            raise invalid(path, "at least one column")
        seen: set[str] = set()
        for i, qualifier in enumerate(qualifiers):
            check_column(qualifier, f"{path}[{i}]")
            known(qualifier, f"{path}[{i}]")
            if qualifier.lower() in seen:
                raise invalid(f"{path}[{i}]", f"{qualifier!r} appears twice")
            seen.add(qualifier.lower())
        total += len(qualifiers)
    if total > MAX_COLUMNS:
        raise invalid("column_families", f"more than {MAX_COLUMNS} columns")


def _validate_target(target: Target) -> None:
    check(PROJECT, target.project, "target.project", "a valid project id")
    check(BIGTABLE_INSTANCE, target.instance, "target.instance", "a Bigtable instance id")
    check(BIGTABLE_APP_PROFILE, target.app_profile, "target.app_profile", "an app profile id")
    check(BIGTABLE_TABLE, target.table, "target.table", "a Bigtable table id")


def _validate_labels(labels: Mapping[str, str]) -> None:
    if len(labels) > MAX_PAYLOAD_LABELS:
        raise invalid("labels", f"at most {MAX_PAYLOAD_LABELS} labels")
    for key, value in labels.items():
        check(LABEL_KEY, key, f"labels[{key!r}]", "a label key ([a-z][a-z0-9_-]*, <= 63)")
        if key.startswith(RESERVED_LABEL_PREFIX):
            raise invalid(f"labels[{key!r}]", f"keys starting {RESERVED_LABEL_PREFIX!r} are ours")
        check(LABEL_VALUE, value, f"labels[{key!r}]", "a label value ([a-z0-9_-]*, <= 63)")


def validate(request: ExportRequest, default_project: str | None) -> None:
    """Raise ``PermanentError`` naming the first field that breaks a naming rule."""
    columns = _validate_source(request.source, default_project)
    _validate_families(request, columns)
    _validate_target(request.target)
    if request.location is not None:
        check(LOCATION, request.location, "location", "a BigQuery location")
    _validate_labels(request.labels)


# --- The plugin's config section ----------------------------------------------------------------
@dataclass(frozen=True)
class PluginConfig:
    """``[jobs."bigquery.reverse_etl"]``: set by the operator, never by a message; checked when
    the worker starts (``@job(config=...)``), so a mistake stops it with the setting named."""

    project: str | None = None  # where the BigQuery jobs run (default: the client's project)
    location: str = "US"
    max_concurrent_exports: int = 2  # the global cap, across every replica: ...
    slot_key: str = "bigquery-exports"  # ... the limit of this fleet-wide concurrency key
    defer_seconds: float = 60.0  # how long a message waits when the cap is reached
    poll_min_seconds: float = 1.0  # first poll interval; grows x1.5 per poll ...
    poll_max_seconds: float = 60.0  # ... up to this
    max_export_attempts: int = 3  # BigQuery jobs per message that may fail retryably

    def __post_init__(self) -> None:
        if self.project is not None and not PROJECT.fullmatch(self.project):
            raise ValueError(f"project {self.project!r} is not valid")
        if not LOCATION.fullmatch(self.location):
            raise ValueError(f"location {self.location!r} is not valid")
        if self.max_concurrent_exports < 1 or self.max_export_attempts < 1:
            raise ValueError("max_concurrent_exports and max_export_attempts must be >= 1")
        if not (
            0 < self.poll_min_seconds <= self.poll_max_seconds
            and 0 <= self.defer_seconds < math.inf
        ):
            raise ValueError("bad poll_min_seconds, poll_max_seconds or defer_seconds")
        if not self.slot_key or "{" in self.slot_key or "*" in self.slot_key:
            raise ValueError(f"slot_key {self.slot_key!r} must be a plain concurrency key")

    @property
    def concurrency_limits(self) -> dict[str, int]:
        """What the worker declares for this plugin: ``max_concurrent_exports`` slots of
        ``slot_key``, one held by each export while it runs."""
        return {self.slot_key: self.max_concurrent_exports}
