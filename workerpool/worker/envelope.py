"""Turn a received message into a Job, or into a Rejection that says why it can never run.

Decoding never raises: every way a message can be malformed becomes a ``Rejection`` with an
``error_type`` from ``constants``, which the processor records on the dead-letter topic.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from workerpool import constants as c
from workerpool.payload import PayloadError, convert
from workerpool.registry import JobSpec, Registry
from workerpool.worker.delivery import Delivery
from workerpool.worker.text import truncate_utf8

log = logging.getLogger(__name__)


# Not frozen: one is made per message, and a frozen dataclass's __init__ costs several times
# as much (see ``outcome.Facts``). Nothing changes it once made.
@dataclass(slots=True)
class Job:
    spec: JobSpec
    job_id: str
    payload: Any
    message_id: str
    delivery_attempt: int
    published: float | None  # POSIX seconds (``Delivery.published``)
    attributes: dict[str, str]

    # The spec's, read several times a run: an attribute, not a property's call each time.
    name: str = field(init=False)

    def __post_init__(self) -> None:
        self.name = self.spec.name


@dataclass(frozen=True)
class Rejection:
    error_type: str
    error_message: str
    job_name: str
    job_id: str


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON (RFC 8259 has no NaN or infinities)")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):  # 1e400: a number JSON allows, a float cannot hold
        raise ValueError(f"number {text[:40]} is out of range")
    return value


# One decoder for every message: json.loads with hooks builds a new one per call.
_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite_float)


def parse_json(data: bytes) -> Any:
    """Strict RFC 8259: NaN, Infinity and numbers beyond a float's range are errors, not
    values a handler has to guard against."""
    return _DECODER.decode(data.decode("utf-8"))


class _Invalid(Exception):
    def __init__(self, error_type: str, message: str) -> None:
        super().__init__(message)
        self.error_type = error_type
        self.message = message


def _payload(spec: JobSpec, data: bytes) -> Any:
    """What the handler gets from the message data; raises ``_Invalid`` saying why not."""
    try:
        value = parse_json(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise _Invalid(c.ERR_NOT_JSON, f"payload is not UTF-8 JSON: {exc}") from None
    except RecursionError:
        raise _Invalid(c.ERR_NOT_JSON, "payload is JSON nested too deeply to parse") from None
    if not isinstance(value, dict):
        raise _Invalid(c.ERR_NOT_OBJECT, f"payload is JSON {type(value).__name__}, not an object")
    if spec.payload is None:
        return value
    try:
        return convert(spec.payload, value)
    except PayloadError as exc:
        raise _Invalid(c.ERR_INVALID_PAYLOAD, str(exc)) from None
    except RecursionError:  # a recursive payload type, and JSON nested almost to the limit
        raise _Invalid(c.ERR_INVALID_PAYLOAD, "payload is nested too deeply to convert") from None
    except Exception as exc:  # a payload class the converter cannot handle: still a record
        log.exception("job %s: converting its payload to %s failed", spec.name, spec.payload)
        raise _Invalid(c.ERR_INVALID_PAYLOAD, f"payload conversion failed: {exc!r}") from None


def job_id_of(delivery: Delivery) -> str:
    return delivery.attributes.get(c.ATTR_JOB_ID) or delivery.message_id


def first_message_id(attributes: Mapping[str, str], message_id: str) -> str:
    """The id of the message this one first was: a copy made on a last delivery names it, so
    that a claim taken for one of them is known for the same message by all the others."""
    return attributes.get(c.ATTR_COPY_OF) or message_id


def copy_attributes(delivery: Delivery) -> dict[str, str]:
    """The attributes that publish ``delivery`` again as the same job: its job id written
    out (a message without one goes by its message id, which a copy would not share), if
    Pub/Sub's limit on attributes leaves room for it. Not ``fired_at``: a copy made now may
    be due later, and is scheduled as any delayed job is."""
    attributes = dict(delivery.attributes)
    attributes.pop(c.ATTR_FIRED_AT, None)
    if c.ATTR_JOB_ID in attributes or len(attributes) < c.MAX_ATTRIBUTES:
        attributes[c.ATTR_JOB_ID] = job_id_of(delivery)
    return attributes


def decode(
    delivery: Delivery,
    registry: Registry,
    *,
    attempt: int,
    max_payload_bytes: int = c.MAX_MESSAGE_BYTES,
) -> Job | Rejection:
    name = delivery.attributes.get(c.ATTR_JOB, "")
    job_id = job_id_of(delivery)

    def reject(error_type: str, message: str) -> Rejection:
        # Cut as the failure record will be: a hostile field name or value may be megabytes,
        # and the processor logs this message too.
        return Rejection(error_type, truncate_utf8(message), name, job_id)

    if len(delivery.data) > max_payload_bytes:
        return reject(
            c.ERR_OVERSIZE, f"payload is {len(delivery.data)} bytes, limit is {max_payload_bytes}"
        )
    if not name:
        return reject(c.ERR_MISSING_JOB, f"message has no {c.ATTR_JOB!r} attribute")
    spec = registry.get(name)
    if spec is None:
        return reject(c.ERR_UNKNOWN_JOB, f"no job named {name!r} is registered")
    try:
        payload = _payload(spec, delivery.data)
    except _Invalid as exc:
        return reject(exc.error_type, exc.message)
    if c.ATTR_JOB_ID not in delivery.attributes:
        log.warning("message %s has no job_id attribute; using the message id", job_id)
    return Job(
        spec=spec,
        job_id=job_id,
        payload=payload,
        message_id=delivery.message_id,
        delivery_attempt=attempt,
        published=delivery.published,
        attributes=delivery.attributes,
    )
