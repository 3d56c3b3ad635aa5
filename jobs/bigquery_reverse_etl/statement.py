"""The EXPORT DATA statement and, for files in Cloud Storage, the temporary table it reads.

Only validated names reach the statement, and each is quoted anyway: identifiers in backticks,
the URI as a string literal. The quoting helpers refuse characters a name could use to end its
quotes, so a gap in validation would be an error here, not an injection.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from google.cloud import bigquery

from .payload import ExportRequest, Source, parse_table, validate

# The name the query gives a CSV (or other file) source through table_definitions.
TEMP_TABLE = "temp_source"
BIGTABLE_ENDPOINT = "https://bigtable.googleapis.com"


@dataclass(frozen=True)
class Query:
    """What one BigQuery job runs: the SQL and the temporary tables it reads."""

    sql: str
    table_definitions: dict[str, bigquery.ExternalConfig] = field(default_factory=dict)


def quote_identifier(name: str) -> str:
    if not name or any(ch in name for ch in "`\\\n\r") or not name.isprintable():
        raise ValueError(f"refusing to quote identifier {name!r}")
    return f"`{name}`"


def quote_string(value: str) -> str:
    if any(ch in value for ch in "'\\\n\r") or not value.isprintable():
        raise ValueError(f"refusing to quote string {value!r}")
    return f"'{value}'"


def bigtable_uri(request: ExportRequest) -> str:
    t = request.target
    return (
        f"{BIGTABLE_ENDPOINT}/projects/{t.project}/instances/{t.instance}"
        f"/appProfiles/{t.app_profile}/tables/{t.table}"
    )


def _row_key(request: ExportRequest) -> str:
    """Bigtable needs a STRING or BYTES ``rowkey``: cast anything else to STRING."""
    schema = {c.name.lower(): c.type.upper() for c in request.source.schema or []}
    column = quote_identifier(request.row_key)
    if schema.get(request.row_key.lower()) == "BYTES":
        return f"{column} AS rowkey"
    return f"CAST({column} AS STRING) AS rowkey"


def _from(request: ExportRequest, default_project: str | None) -> str:
    if request.source.table is None:
        return quote_identifier(TEMP_TABLE)
    ref = parse_table(request.source.table, default_project, "source.table")
    return ".".join(quote_identifier(part) for part in (ref.project, ref.dataset, ref.table))


def external_config(source: Source) -> bigquery.ExternalConfig:
    """The temporary table over the files (``table_definitions`` of the query job)."""
    assert source.uris is not None
    config = bigquery.ExternalConfig(source.format or "CSV")
    config.source_uris = list(source.uris)
    if source.schema:
        config.schema = [
            bigquery.SchemaField(c.name, c.type.upper(), mode=c.mode.upper()) for c in source.schema
        ]
    if source.max_bad_records is not None:
        config.max_bad_records = source.max_bad_records
    if isinstance(config.options, bigquery.CSVOptions):
        if source.skip_leading_rows is not None:
            config.options.skip_leading_rows = source.skip_leading_rows
        if source.field_delimiter is not None:
            config.options.field_delimiter = source.field_delimiter
    return config


def build_query(request: ExportRequest, default_project: str | None) -> Query:
    """Validate ``request`` (``PermanentError`` naming the field) and build its statement."""
    validate(request, default_project)
    options = [
        f"uri = {quote_string(bigtable_uri(request))}",
        "format = 'CLOUD_BIGTABLE'",
    ]
    for name in ("overwrite", "truncate", "auto_create_column_families"):
        if getattr(request.options, name):
            options.append(f"{name} = true")
    columns = [_row_key(request)] + [
        f"STRUCT({', '.join(quote_identifier(q) for q in qualifiers)}) AS {quote_identifier(fam)}"
        for fam, qualifiers in request.column_families.items()
    ]
    sql = "\n".join(
        [
            "EXPORT DATA OPTIONS (",
            ",\n".join(f"  {option}" for option in options),
            ") AS",
            "SELECT",
            ",\n".join(f"  {column}" for column in columns),
            f"FROM {_from(request, default_project)}",
        ]
    )
    if request.source.table is not None:
        return Query(sql)
    return Query(sql, {TEMP_TABLE: external_config(request.source)})
