"""The command line: provisioning, publishing, bad configuration, job listing."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from signal import SIGTERM

import pytest
from click.testing import CliRunner

from tests.commands import run_command, run_commands
from tests.support import catches_signal, runs_workerpool, wait_for
from workerpool.cli import main
from workerpool.config import load_settings
from workerpool.errors import ConfigError
from workerpool.slots import Limits
from workerpool.testing.pubsub import PubSubResources


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "workerpool", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


def _demo_slots_worker(tmp_path: Path, *concurrency: str) -> subprocess.CompletedProcess[str]:
    """A worker of workerpool_jobs.demo_slots with these ``--concurrency`` entries, and no
    Pub/Sub or credentials to reach: it stops at its settings' checks."""
    entries = [arg for entry in concurrency for arg in ("--concurrency", entry)]
    return run_command(
        "run", "--project", "p", "--subscription", "s", "--jobs", "workerpool_jobs.demo_slots",
        *entries, env=_nowhere(tmp_path),
    )  # fmt: skip


def test_provision_twice_succeeds_and_says_what_existed(pubsub_resources: PubSubResources) -> None:
    args = [
        "provision", "--project", pubsub_resources.project, "--topic", pubsub_resources.topic,
        "--subscription", pubsub_resources.subscription,
        "--dead-letter-topic", pubsub_resources.dead_letter_topic,
        "--ack-deadline", "30", "--max-delivery-attempts", "7", "--min-backoff", "5",
    ]  # fmt: skip
    first = CliRunner().invoke(main, args)
    second = CliRunner().invoke(main, args)
    assert first.exit_code == 0 and second.exit_code == 0, first.output + second.output
    assert first.output.count("created") == 4 and "exists" not in first.output
    assert second.output.count("exists") == 4 and "created" not in second.output
    sub = pubsub_resources.subscriber.get_subscription(
        subscription=pubsub_resources.subscription_path
    )
    assert sub.ack_deadline_seconds == 30
    assert sub.dead_letter_policy.max_delivery_attempts == 7
    assert sub.retry_policy.minimum_backoff.total_seconds() == 5


def test_run_with_missing_subscription_exits_2_with_one_line(
    pubsub_resources: PubSubResources,
) -> None:
    result = _cli("run", "--project", pubsub_resources.project, "--subscription", "no-such-sub")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"workerpool: error: subscription projects/{pubsub_resources.project}/subscriptions/"
        "no-such-sub does not exist"
    ]


def test_bad_config_exits_2_naming_the_setting(tmp_path: Path) -> None:
    config = tmp_path / "workerpool.toml"
    config.write_text('[worker]\nmax_outstanding = "lots"\n')
    result = _cli("run", "--config", str(config), "--project", "p", "--subscription", "s")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"workerpool: error: max_outstanding (from {config}) must be int, got 'lots'"
    ]


_SECTION_MISTAKES = [
    (
        '[jobs."http.delivery"]\nallowed_host = ["a.example"]\n',
        '[jobs."http.delivery"] allowed_host: unexpected field',
    ),
    (
        '[jobs."http.delivery"]\ntimeout = "10"\n',
        '[jobs."http.delivery"] timeout: expected float, got str',
    ),
    (
        '[jobs."bigquery.reverse_etl"]\nmax_concurrent_exports = 0\n',
        '[jobs."bigquery.reverse_etl"] the section: ValueError: max_concurrent_exports and '
        "max_export_attempts must be >= 1",
    ),
    (
        '[jobs."http.delivry"]\nallowed_hosts = []\n',
        '[jobs."http.delivry"]: no job of that name is registered',
    ),
]


def test_a_mistake_in_a_jobs_config_section_exits_2_before_connecting(tmp_path: Path) -> None:
    # Given config files each with a mistake in a plugin's section (unknown key, wrong type,
    # bad value, unknown job), and no Pub/Sub to connect to
    commands = []
    for i, (section, _) in enumerate(_SECTION_MISTAKES):
        config = tmp_path / f"workerpool-{i}.toml"
        config.write_text(section)
        commands.append(["run", "--config", str(config), "--project", "p", "--subscription", "s"])
    # When a worker starts with each
    results = run_commands(commands, env=_nowhere(tmp_path))
    # Then it exits 2 with one line naming the setting, before it tries to connect
    for result, (_, says) in zip(results, _SECTION_MISTAKES, strict=True):
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip().splitlines() == [f"workerpool: error: {says}"]


def test_a_command_without_credentials_exits_2_with_one_line(tmp_path: Path) -> None:
    # Given no emulator and no Google Cloud credentials, When a worker starts, or a command
    # that publishes or reads Pub/Sub runs
    project, topic = ["--project", "p"], ["--topic", "t"]
    job = ["--job", "j", "--job-id", "1", "--data", "{}"]
    batch = ["--on-complete", "done", "--idempotency-store", f"sqlite:///{tmp_path}/c.db"]
    commands = [
        ["run", *project, "--subscription", "s"],
        ["publish", *project, *topic, *job],
        ["publish", *project, *topic, *job, *batch],
        ["provision", *project, *topic, "--subscription", "s", "--dead-letter-topic", "d"],
        ["dlq", "list", *project, "--subscription", "s-dlq"],
    ]
    results = run_commands(commands, env=_nowhere(tmp_path))
    # Then each says what is missing in one line, not a traceback
    for result in results:
        assert result.returncode == 2, result.stderr
        [line] = result.stderr.strip().splitlines()
        assert line.startswith("workerpool: error: no Google Cloud credentials found")


def test_a_worker_whose_firestore_store_has_no_credentials_exits_2_with_one_line(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given Pub/Sub on the emulator, but a Firestore store with no emulator and no credentials
    pubsub_resources.provision()
    env = {
        **_nowhere(tmp_path),
        "PUBSUB_EMULATOR_HOST": pubsub_resources.host,
        "GCE_METADATA_IP": "127.0.0.1:9",  # no metadata server to ask either: refused at once
    }
    env.pop("FIRESTORE_EMULATOR_HOST", None)
    # When a worker starts
    result = _cli(
        "run", "--project", pubsub_resources.project,
        "--subscription", pubsub_resources.subscription,
        "--idempotency-store", "firestore://p/claims", env=env,
    )  # fmt: skip
    # Then it names the store and what is missing in one line, not a traceback
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("workerpool: error: idempotency_store"), line
    assert "Firestore" in line and "DefaultCredentialsError" in line


def _nowhere(tmp_path: Path) -> dict[str, str]:
    """An environment with no emulator and no credentials to be found (not even gcloud's)."""
    env = {k: v for k, v in os.environ.items() if k != "PUBSUB_EMULATOR_HOST"}
    env["GOOGLE_APPLICATION_CREDENTIALS"] = str(tmp_path / "no-such-key.json")
    env["CLOUDSDK_CONFIG"] = str(tmp_path / "gcloud")
    return env


def test_a_job_module_with_a_generator_handler_exits_2_with_one_line(tmp_path: Path) -> None:
    # Given a job module whose handler yields (its call would never run its body)
    (tmp_path / "asyncjobs.py").write_text(
        "from workerpool import job\n\n"
        "@job('t.async')\nasync def handle(ctx, payload):\n    yield\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    # When a worker is started with it
    result = run_command(
        "run", "--project", "p", "--subscription", "s", "--jobs", "asyncjobs", env=env
    )
    # Then it refuses to start, before pulling anything, in one line that says why
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(
        "workerpool: error: --jobs asyncjobs: job 't.async': handle is a generator"
    )


def test_publish_then_cli_lists_jobs(pubsub_resources: PubSubResources, tmp_path: Path) -> None:
    pubsub_resources.provision()
    jsonl = tmp_path / "jobs.jsonl"
    jsonl.write_text(
        '{"job": "demo.sleep", "job_id": "a", "data": {"seconds": 0}}\n'
        '{"job": "demo.echo", "job_id": "b", "data": {}}\n'
    )
    runner = CliRunner()
    target = ["publish", "--project", pubsub_resources.project, "--topic", pubsub_resources.topic]
    many = runner.invoke(main, [*target, "--file", str(jsonl)])
    one = runner.invoke(main, [*target, "--job", "demo.echo", "--job-id", "c", "--data", '{"k":1}'])
    assert many.exit_code == 0 and "published 2 job(s)" in many.output
    assert one.exit_code == 0 and "published 1 job(s)" in one.output
    received = pubsub_resources.subscriber.pull(
        subscription=pubsub_resources.subscription_path, max_messages=10
    )
    got = {m.message.attributes["job_id"]: m.message for m in received.received_messages}
    assert sorted(got) == ["a", "b", "c"]
    assert got["c"].attributes["job"] == "demo.echo" and got["c"].data == b'{"k":1}'
    listing = runner.invoke(main, ["jobs"])
    assert "demo.sleep" in listing.output and "payload=SleepRequest" in listing.output


def _pulled_job_ids(resources: PubSubResources, until: str) -> list[str]:
    """The job ids pulled (and acked) from the subscription, up to the one ``until``."""
    seen: list[str] = []
    while until not in seen:
        got = resources.subscriber.pull(
            subscription=resources.subscription_path, max_messages=100, timeout=30
        ).received_messages
        seen += [m.message.attributes.get("job_id", "") for m in got]
        if got:
            resources.subscriber.acknowledge(
                subscription=resources.subscription_path, ack_ids=[m.ack_id for m in got]
            )
    return seen


def test_publish_refuses_a_bad_file_in_one_line_and_publishes_none_of_it(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given files whose first line is good and whose second is not
    pubsub_resources.provision()
    good = b'{"job": "demo.echo", "job_id": "good", "data": {}}\n'
    bad = {
        "null-id": (b'{"job": "demo.echo", "job_id": null}', "field 'job_id' is null"),
        "null-job": (b'{"job": null, "job_id": "n"}', "field 'job' is null"),
        "latin-1": (b'{"job": "caf\xe9", "job_id": "l"}', "not UTF-8"),
        "not-json": (b'{"job": "demo.echo", "job_id": ', "Expecting value"),
        "wrong-type": (b'{"job": "demo.echo", "job_id": 42}', "field 'job_id' is a number"),
    }
    target = ["publish", "--project", pubsub_resources.project, "--topic", pubsub_resources.topic]
    commands = []
    for name, (line, _) in bad.items():
        (tmp_path / f"{name}.jsonl").write_bytes(good + line + b"\n")
        commands.append([*target, "--file", str(tmp_path / f"{name}.jsonl")])
    commands.append([*target, "--job", "demo.echo", "--job-id", "j", "--data", "[1]"])
    # When each is published
    results = run_commands(commands)
    # Then each exits 2 with one line naming the file's line and the field
    for (name, (_, says)), result in zip(bad.items(), results, strict=False):
        assert result.returncode == 2 and result.stdout == "", result.stderr
        [line] = result.stderr.strip().splitlines()
        assert line.startswith(f"workerpool: error: {tmp_path / name}.jsonl:2: ") and says in line
    assert results[-1].returncode == 2
    assert results[-1].stderr.strip() == "workerpool: error: --data must be a JSON object"
    # And none of their lines was published, the good first ones included
    marker = _cli(*target, "--job", "demo.echo", "--job-id", "marker", "--data", "{}")
    assert marker.returncode == 0, marker.stderr
    assert _pulled_job_ids(pubsub_resources, until="marker") == ["marker"]


def test_publish_refuses_arguments_that_are_not_utf8_in_one_line() -> None:
    # Given --data and --job arguments with a byte that is not UTF-8 (0xff, as argv carries it)
    target = ["publish", "--project", "p", "--topic", "t"]
    results = run_commands(
        [
            [*target, "--job", "a", "--data", '{"x": "\udcff"}'],
            [*target, "--job", "a\udcff", "--data", "{}"],
        ]
    )
    # Then each is refused in one line, exit 2, before anything connects
    said = [result.stderr.strip() for result in results]
    assert [result.returncode for result in results] == [2, 2], said
    assert said[0].startswith("workerpool: error: --data is not UTF-8 JSON: 'utf-8' codec")
    assert said[1].startswith("workerpool: error: --job/--job-id: job 'a\\\\udcff' is not valid")


def test_publishing_to_a_missing_topic_exits_2_with_one_line(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given a topic that does not exist
    project = pubsub_resources.project
    jsonl = tmp_path / "jobs.jsonl"
    jsonl.write_text('{"job": "demo.echo", "job_id": "a", "data": {}}\n')
    store = f"sqlite:///{tmp_path}/claims.db"
    target = ["publish", "--project", project, "--topic", "no-such-topic"]
    # When one job, a file, and a batch are published to it
    batch = ["--on-complete", "demo.echo", "--batch-id", "b-1", "--idempotency-store", store]
    results = run_commands(
        [
            [*target, "--job", "demo.echo", "--job-id", "a", "--data", "{}"],
            [*target, "--file", str(jsonl)],
            [*target, "--file", str(jsonl), *batch],
        ]
    )
    # Then each exits 2 with one line naming the topic
    for result in results:
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip().splitlines() == [
            f"workerpool: error: topic projects/{project}/topics/no-such-topic does not exist"
        ]
    # And the batch was never recorded (no batch left half-made, waiting for its deadline)
    listed = CliRunner().invoke(main, ["batch", "list", "--idempotency-store", store])
    assert listed.output.strip().splitlines()[-1] == "0 batch(es)"


def test_a_command_that_does_not_drain_still_ends_on_sigterm(tmp_path: Path) -> None:
    # Given `workerpool jobs` runs whose job module takes a minute to import
    (tmp_path / "slowjobs.py").write_text("import time\n\ntime.sleep(60)\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    command = [sys.executable, "-m", "workerpool", "jobs", "--jobs", "slowjobs"]
    early, late = (subprocess.Popen(command, env=env, stderr=subprocess.DEVNULL) for _ in "ab")

    # When one gets SIGTERM while the package holds it, the other once the command has
    # given it back (while it imports the module)
    def held(process: subprocess.Popen[bytes]) -> Callable[[], bool]:
        return lambda: runs_workerpool(process.pid) and catches_signal(process.pid, SIGTERM)

    assert wait_for(held(early), 60, interval=0.001)
    early.send_signal(SIGTERM)
    assert wait_for(held(late), 60, interval=0.001)
    assert wait_for(lambda: not catches_signal(late.pid, SIGTERM), 60)
    late.send_signal(SIGTERM)
    # Then both end by it, as any program does, rather than go on importing
    assert early.wait(30) == late.wait(30) == -SIGTERM


def test_settings_precedence_defaults_file_env_flags(tmp_path: Path) -> None:
    config = tmp_path / "w.toml"
    config.write_text(
        '[worker]\nproject = "from-file"\nmax_outstanding = 3\nprefetch = 1\n'
        '[jobs."bigquery.reverse_etl"]\nproject = "bq"\n'
    )
    env = {"WORKERPOOL_MAX_OUTSTANDING": "5", "WORKERPOOL_PREFETCH": "4"}
    settings = load_settings(str(config), {"prefetch": 0, "drain_timeout": None}, env)
    assert settings.project == "from-file"  # file over default
    assert settings.max_outstanding == 5  # env over file
    assert settings.prefetch == 0  # flag over env
    assert settings.drain_timeout == 25.0  # default
    assert settings.job_config == {"bigquery.reverse_etl": {"project": "bq"}}
    for bad in ("[worker]\nmax_outstandin = 3\n", "[worker]\nmax_outstanding = 0\n", "= x"):
        config.write_text(bad)
        try:
            load_settings(str(config), {}, {})
        except ConfigError:
            continue
        raise AssertionError(f"accepted {bad!r}")


def test_prefetch_is_a_quarter_of_n_unless_set(tmp_path: Path) -> None:
    defaults = {
        n: load_settings(None, {"max_outstanding": n}, {}).held_beyond_n for n in (1, 8, 9, 64, 100)
    }
    assert defaults == {1: 2, 8: 2, 9: 2, 64: 16, 100: 25}
    set_to_zero = load_settings(None, {"max_outstanding": 64}, {"WORKERPOOL_PREFETCH": "0"})
    assert set_to_zero.held_beyond_n == 0
    config = tmp_path / "w.toml"
    config.write_text("[worker]\nprefetch = -1\n")
    with pytest.raises(ConfigError, match="prefetch must not be negative"):
        load_settings(str(config), {}, {})


def test_concurrency_limits_from_file_env_and_flags(tmp_path: Path) -> None:
    config = tmp_path / "w.toml"
    config.write_text('[concurrency]\nexports = 2\n"partner:*" = 1\n')
    env = {"WORKERPOOL_CONCURRENCY": "exports=3, imports=4"}
    settings = load_settings(str(config), {"concurrency": ("imports=5",)}, env)
    assert settings.concurrency == {"exports": 3, "partner:*": 1, "imports": 5}
    for bad, says in (
        ("[concurrency]\nexports = 0\n", "'exports'"),
        ("[concurrency]\nexports = 1.5\n", "'exports'"),
        ('[concurrency]\n"a*b" = 1\n', "may only end in *"),
    ):
        config.write_text(bad)
        with pytest.raises(ConfigError, match=re.escape(says)):
            load_settings(str(config), {}, {})
    with pytest.raises(ConfigError, match="not KEY=LIMIT"):
        load_settings(None, {"concurrency": ("exports",)}, {})


def test_a_keys_entry_says_its_slots_are_leased_in_bulk(tmp_path: Path) -> None:
    config = tmp_path / "w.toml"
    config.write_text('[concurrency]\napi = "20/bulk"\n"tenant:*" = "5/bulk"\nexports = 2\n')
    env = {"WORKERPOOL_CONCURRENCY": "tenant:*=5/per_run"}
    settings = load_settings(str(config), {"concurrency": ("imports=4/bulk",)}, env)
    assert settings.concurrency == {"api": 20, "tenant:*": 5, "exports": 2, "imports": 4}
    assert settings.concurrency_leases == {"api": "bulk", "imports": "bulk"}
    limits = Limits(settings.concurrency, settings.concurrency_leases)
    assert limits.bulk("api") and limits.bulk("imports")
    assert not limits.bulk("tenant:acme") and not limits.bulk("exports")
    with pytest.raises(ConfigError, match="/bulk or /per_run"):
        load_settings(None, {"concurrency": ("api=20/fast",)}, {})


def test_a_bulk_keys_entry_may_split_its_record_into_shards(tmp_path: Path) -> None:
    config = tmp_path / "w.toml"
    config.write_text('[concurrency]\napi = "200/bulk/25"\n"tenant:*" = "5/bulk"\n')
    settings = load_settings(str(config), {"concurrency": ("imports=4/bulk/1",)}, {})
    assert settings.concurrency == {"api": 200, "tenant:*": 5, "imports": 4}
    assert settings.concurrency_shards == {"api": 25}  # one shard: the key's own record
    limits = Limits(settings.concurrency, settings.concurrency_leases, settings.concurrency_shards)
    assert (limits.shards("api"), limits.shards("tenant:acme"), limits.shards("imports")) == (
        25, 1, 1,
    )  # fmt: skip
    for bad in ("api=20/per_run/2", "api=20/bulk/0", "api=20/bulk/21", "api=20/bulk/x",
                "api=20/bulk/2/3"):  # fmt: skip
        with pytest.raises(ConfigError, match=re.escape(bad.partition("=")[2])):
            load_settings(None, {"concurrency": (bad,)}, {})
    result = _demo_slots_worker(tmp_path, "demo-slots=2/bulk/3")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "workerpool: error: concurrency 'demo-slots' (from --concurrency): the limit must be a "
        "positive integer, optionally /bulk or /per_run, a bulk key's shards /bulk/S (1 to the "
        "limit), and a key may only end in *, got '2/bulk/3'"
    ]


def test_a_declared_key_may_not_contain_the_shard_records_mark(tmp_path: Path) -> None:
    # A split key's shard records are named KEY#0, KEY#1, ...: a key "api#1" would be one
    result = _demo_slots_worker(tmp_path, "demo-slots=2", "api#1=4")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "workerpool: error: concurrency 'api#1' (from --concurrency): a key may not contain # "
        "(it marks a split key's shard records)"
    ]


def test_a_job_whose_concurrency_key_has_no_limit_exits_2_with_one_line(tmp_path: Path) -> None:
    result = _demo_slots_worker(tmp_path, "demo-slots=2")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "workerpool: error: job demo.tenant_sleep: concurrency key 'tenant:{tenant}' has no "
        'declared limit: declare "tenant:*" (one limit per rendered key)'
    ]


def test_a_pool_names_the_key_its_jobs_share_with_concurrency(tmp_path: Path) -> None:
    config = tmp_path / "w.toml"
    config.write_text(
        '[concurrency]\nexports = 2\n\n[[pools]]\nsubscription = "a"\nconcurrency = "exports"\n'
        '\n[[pools]]\nsubscription = "b"\n'
    )
    gated, plain = load_settings(str(config), {}, {}).pool_settings()
    assert (gated.pool_concurrency, plain.pool_concurrency) == ("exports", "")
    assert gated.concurrency == {"exports": 2}  # the limits stay the top-level table's
    config.write_text('[[pools]]\nsubscription = "a"\n[pools.concurrency]\nexports = 2\n')
    with pytest.raises(ConfigError, match="pools\\[0\\]: concurrency names the key"):
        load_settings(str(config), {}, {}).pool_settings()


def test_a_pool_key_without_a_limit_or_with_fields_exits_2_with_one_line(tmp_path: Path) -> None:
    cases = (("exports", "other=1"), ("partner:{id}", "partner:*=1"))
    commands = [
        ["run", "--project", "p", "--subscription", "s", "--pool-concurrency", key,
         "--concurrency", limits]
        for key, limits in cases
    ]  # fmt: skip
    for (key, _), result in zip(cases, run_commands(commands, env=_nowhere(tmp_path)), strict=True):
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip().splitlines() == [
            f"workerpool: error: pool_concurrency {key!r}: a pool's key must be a plain key "
            "with a declared limit (the pool takes its slots before it sees any payload)"
        ]


@pytest.mark.parametrize(
    ("key", "limits", "why"),
    [
        (
            "exports",
            "exports=2/bulk",
            "a pool's key is leased per run (its slots are taken before each pull); declare it "
            "without /bulk",
        ),
        # "partner:*" covers "partner:a#0", which names the first shard record of "partner:a"
        (
            "partner:a#0",
            "partner:*=2",
            "a key may not contain # (it marks a split key's shard records)",
        ),
    ],
    ids=["leased_in_bulk", "naming_a_shard_record"],
)
def test_a_pool_key_the_pool_cannot_take_slots_of_exits_2_with_one_line(
    tmp_path: Path, key: str, limits: str, why: str
) -> None:
    result = run_command(
        "run", "--project", "p", "--subscription", "s", "--pool-concurrency", key,
        "--concurrency", limits, env=_nowhere(tmp_path),
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"workerpool: error: pool_concurrency {key!r}: {why}"
    ]


def test_a_limit_a_job_config_declares_must_agree_with_the_concurrency_table(
    tmp_path: Path,
) -> None:
    # The BigQuery plugin declares max_concurrent_exports (default 2) as its key's limit
    result = run_command(
        "run", "--project", "p", "--subscription", "s", "--concurrency", "bigquery-exports=3",
        env=_nowhere(tmp_path),
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "workerpool: error: concurrency 'bigquery-exports': [concurrency] says 3, a job's "
        "config 2; declare it once"
    ]


def test_dockerfile_runs_workerpool_as_non_root_and_drains_on_sigterm() -> None:
    text = (Path(__file__).parent.parent / "Dockerfile").read_text()
    lines = [line.strip() for line in text.splitlines() if line.strip() and line[0] != "#"]
    assert lines[0].startswith("FROM python:3.") and lines[0].endswith("-slim")
    user = [line for line in lines if line.startswith("USER ")]
    assert user and user[-1] not in ("USER root", "USER 0")
    assert 'ENTRYPOINT ["workerpool", "run"]' in lines  # exec form: signals reach the worker
    assert "STOPSIGNAL SIGTERM" in lines
    # The malloc setting tests/test_hostile_emulator.py measured RSS with
    assert "MALLOC_MMAP_THRESHOLD_=131072" in text
    secret_words = ("GOOGLE_APPLICATION_CREDENTIALS", "key.json", "SECRET", "PASSWORD", "TOKEN")
    assert not any(word in text for word in secret_words)


def test_log_level_from_flag_and_environment() -> None:
    root = logging.getLogger()
    before = root.level
    try:
        assert CliRunner().invoke(main, ["--log-level", "warning", "jobs"]).exit_code == 0
        assert root.level == logging.WARNING
        runner = CliRunner(env={"WORKERPOOL_LOG_LEVEL": "error"})
        assert runner.invoke(main, ["jobs"]).exit_code == 0
        assert root.level == logging.ERROR
        assert CliRunner().invoke(main, ["-v", "jobs"]).exit_code == 0
        assert root.level == logging.DEBUG
        refused = CliRunner().invoke(main, ["--log-level", "loud", "jobs"])
        assert refused.exit_code == 2 and "loud" in refused.output
    finally:
        root.setLevel(before)


def test_a_bad_middleware_name_exits_2_naming_it(tmp_path: Path) -> None:
    # Given a middleware name that points at nothing, given each way a name can be given
    config = tmp_path / "workerpool.toml"
    config.write_text('[worker]\nmiddleware = ["json:nothing"]\n')
    run = ["run", "--project", "p", "--subscription", "s"]
    commands = [
        [*run, "--middleware", "no-such-plugin"],
        [*run, "--config", str(config)],
        [*run, "--middleware", "workerpool.errors:ConfigError"],
    ]
    env = _nowhere(tmp_path)
    # When a worker starts with each (and one with the name only in the environment)
    results = run_commands(commands, env=env)
    results.append(run_command(*run, env={**env, "WORKERPOOL_MIDDLEWARE": "no_such_module:Audit"}))
    # Then it exits 2 with one line naming it, before it tries to connect
    says = [
        "middleware no-such-plugin: no entry point of that name in workerpool.middleware, and "
        "not a module:Name path",
        "middleware json:nothing: json has no nothing",
        "middleware workerpool.errors:ConfigError: <class 'workerpool.errors.ConfigError'> is "
        "neither a Middleware subclass nor a factory",
        "middleware no_such_module:Audit: cannot import it (No module named 'no_such_module')",
    ]
    for result, line in zip(results, says, strict=True):
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip().splitlines() == [f"workerpool: error: {line}"]


def test_jobs_lists_a_job_that_takes_an_option_of_a_named_middleware(tmp_path: Path) -> None:
    # Given a job module whose job takes the option "audited" that a middleware declares
    (tmp_path / "audit_mw.py").write_text(
        "from workerpool import Middleware\n\n"
        "class Audit(Middleware):\n    options = frozenset({'audited'})\n"
    )
    (tmp_path / "audit_jobs.py").write_text(
        "from workerpool import job\n\n"
        "@job('t.audited', audited=True)\ndef handle(ctx, payload):\n    pass\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    # When the jobs are listed without the middleware, then with it
    without, named = run_commands(
        [
            ["jobs", "--jobs", "audit_jobs"],
            ["jobs", "--jobs", "audit_jobs", "--middleware", "audit_mw:Audit"],
        ],
        env=env,
    )
    # Then the option is unknown without it, and the job is listed with it
    assert without.returncode == 2 and "unknown option(s) audited" in without.stderr
    assert named.returncode == 0, named.stderr
    assert "(audit_jobs.handle)" in named.stdout
