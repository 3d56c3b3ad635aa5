"""BigQuery reverse ETL: export rows (files in Cloud Storage or a table) to Bigtable.

Job ``bigquery.reverse_etl``: one message, one ``EXPORT DATA ... format='CLOUD_BIGTABLE'``
query job, started at most once per job id however often the message is delivered, waited for
for hours if need be, with at most ``max_concurrent_exports`` of them running across every
replica. docs/guide/bigquery-reverse-etl.md has the payload, the config and the IAM roles.

Modules: ``payload`` (what a message and the config may say, and the naming rules),
``statement`` (the SQL and the temporary table definition), ``launch`` (job ids, the cap,
waiting, errors).
"""

from __future__ import annotations

from collections.abc import Callable

try:
    from google.cloud import bigquery
except ImportError as missing:  # an extra: the core does not need it
    raise ImportError(
        "the BigQuery reverse-ETL job needs google-cloud-bigquery: "
        "pip install 'workerpool[bigquery]'"
    ) from missing

from workerpool import JobContext, job

from .launch import Export, make_client
from .payload import JOB_NAME, ExportRequest, PluginConfig
from .statement import Query, build_query

__all__ = ["JOB_NAME", "JOB_TIMEOUT", "ExportRequest", "Query", "reverse_etl", "run_export"]

JOB_TIMEOUT = 6 * 3600.0
# Every delivery counts toward max_attempts, deferrals under the cap and drains included, so
# it is high; BigQuery's own failures are bounded by max_export_attempts (config) instead.
MAX_ATTEMPTS = 50

# Seams, replaced only by tests (nothing in a message or the config can reach them): the
# statement builder, since no emulator runs EXPORT DATA to Bigtable, and the client factory.
query_builder: Callable[[ExportRequest, str | None], Query] = build_query
client_factory: Callable[[str | None, str], bigquery.Client] = make_client


def run_export(ctx: JobContext, request: ExportRequest, *, timeout: float = JOB_TIMEOUT) -> None:
    """The handler's body; ``timeout`` is the one the job was registered with."""
    config: PluginConfig = ctx.config
    query = query_builder(request, config.project)  # validates: PermanentError naming a field
    location = request.location or config.location
    client = client_factory(config.project, location)
    Export(client, config, ctx, query, location, request.labels, timeout).run()


@job(
    JOB_NAME,
    timeout=JOB_TIMEOUT,
    max_attempts=MAX_ATTEMPTS,
    payload=ExportRequest,
    config=PluginConfig,
)
def reverse_etl(ctx: JobContext, request: ExportRequest) -> None:
    run_export(ctx, request, timeout=JOB_TIMEOUT)
