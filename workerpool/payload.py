"""Convert a decoded JSON object into a job's declared payload dataclass, checking types.

A mismatch raises ``PayloadError`` naming the field path (``items[2].count``), so the failure
record tells the publisher exactly what to fix.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar, Union

T = TypeVar("T")


class PayloadError(ValueError):
    """The payload does not match the declared dataclass."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path or 'payload'}: {problem}")
        self.path = path


def convert(cls: type[T], data: object) -> T:
    """Build ``cls`` (a dataclass) from ``data``, or raise ``PayloadError``."""
    result: T = _convert(cls, data, "")
    return result


def _join(path: str, part: str) -> str:
    return f"{path}.{part}" if path and not part.startswith("[") else f"{path}{part}"


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _convert(tp: Any, value: object, path: str) -> Any:
    if tp is Any or tp is object:
        return value
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return _convert_union(tp, value, path)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _convert_dataclass(tp, value, path)
    if origin is list:
        (item_type,) = typing.get_args(tp) or (Any,)
        if not isinstance(value, list):
            raise PayloadError(path, f"expected a list, got {_type_name(value)}")
        return [_convert(item_type, item, _join(path, f"[{i}]")) for i, item in enumerate(value)]
    if origin is dict:
        _, value_type = typing.get_args(tp) or (str, Any)
        if not isinstance(value, dict):
            raise PayloadError(path, f"expected an object, got {_type_name(value)}")
        return {k: _convert(value_type, v, _join(path, f"[{k!r}]")) for k, v in value.items()}
    if origin is typing.Literal:
        if not any(_same_literal(value, v) for v in typing.get_args(tp)):
            raise PayloadError(path, f"expected one of {list(typing.get_args(tp))}, got {value!r}")
        return value
    return _convert_scalar(tp, value, path)


def _same_literal(value: object, literal: object) -> bool:
    # True == 1 and 1.0 == 1, yet neither is the literal 1 (nor 1 the literal True).
    numeric = isinstance(literal, int | float) or isinstance(value, int | float)
    return value == literal and (type(value) is type(literal) or not numeric)


def _convert_union(tp: Any, value: object, path: str) -> Any:
    members = typing.get_args(tp)
    if value is None and type(None) in members:
        return None
    errors = []
    for member in members:
        if member is type(None):
            continue
        try:
            return _convert(member, value, path)
        except PayloadError as exc:
            errors.append(str(exc))
    raise PayloadError(path, f"matches none of {tp}: {'; '.join(errors)}")


def _convert_scalar(tp: Any, value: object, path: str) -> Any:
    # JSON has one number type: accept an int where a float is declared, never a bool for either.
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # JSON allows 4300 digits; a float holds about 308
            raise PayloadError(path, "expected float, got an integer beyond its range") from None
    if tp in (int, float) and isinstance(value, bool):
        raise PayloadError(path, f"expected {tp.__name__}, got bool")
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    name = getattr(tp, "__name__", str(tp))
    raise PayloadError(path, f"expected {name}, got {_type_name(value)}")


def _convert_dataclass(cls: type[Any], value: object, path: str) -> Any:
    if not isinstance(value, dict):
        raise PayloadError(path, f"expected an object, got {_type_name(value)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unexpected = sorted(set(value) - set(fields))
    if unexpected:
        raise PayloadError(_join(path, unexpected[0]), "unexpected field")
    kwargs = {}
    for name, field in fields.items():
        if name in value:
            kwargs[name] = _convert(hints[name], value[name], _join(path, name))
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise PayloadError(_join(path, name), "required field is missing")
    try:
        return cls(**kwargs)
    except PayloadError:
        raise
    except (TypeError, ValueError) as exc:  # the dataclass's own checks (``__post_init__``)
        raise PayloadError(path, f"{type(exc).__name__}: {exc}") from None
