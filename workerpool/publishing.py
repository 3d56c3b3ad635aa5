"""Publishing jobs by the message contract: JSON object data, ``job`` and ``job_id`` attributes."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from workerpool import constants as c
from workerpool.errors import ConfigError


@dataclass(frozen=True)
class JobMessage:
    job: str
    data: Mapping[str, Any]
    job_id: str = ""
    attributes: Mapping[str, str] | None = None

    def encode(self) -> tuple[bytes, dict[str, str]]:
        attributes = dict(self.attributes or {})
        attributes[c.ATTR_JOB] = self.job
        if self.job_id:
            attributes[c.ATTR_JOB_ID] = self.job_id
        return json.dumps(self.data, separators=(",", ":")).encode(), attributes


def publish(publisher: Any, topic: str, message: JobMessage, *, timeout: float = 60) -> str:
    """Publish one job and wait for its message id."""
    data, attributes = message.encode()
    message_id: str = publisher.publish(topic, data, **attributes).result(timeout=timeout)
    return message_id


def publish_many(publisher: Any, topic: str, messages: Iterable[JobMessage]) -> Iterator[str]:
    """Publish in the client's batches; yield message ids in order as they are confirmed."""
    futures = []
    for message in messages:
        data, attributes = message.encode()
        futures.append(publisher.publish(topic, data, **attributes))
    for future in futures:
        yield future.result(timeout=60)


def read_jsonl(lines: Iterable[str], source: str) -> list[JobMessage]:
    """Parse ``{"job": ..., "job_id": ..., "data": {...}}`` lines; a bad line is a ConfigError."""
    messages = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            if not isinstance(entry, dict) or not isinstance(entry.get("data", {}), dict):
                raise ValueError("expected an object with an object 'data'")
            messages.append(
                JobMessage(str(entry["job"]), entry.get("data", {}), str(entry.get("job_id", "")))
            )
        except (ValueError, KeyError) as exc:
            raise ConfigError(f"{source}:{number}: {exc}") from exc
    return messages
