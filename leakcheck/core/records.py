"""The model's records as JSON-able data and back (by the field types): one converter."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

from leakcheck.core.readings import ProcessKey

__all__ = ["record_from_dict", "to_jsonable"]


def _field_names(cls: type[Any]) -> list[str] | None:
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls)]
    return list(cls._fields) if issubclass(cls, tuple) and hasattr(cls, "_fields") else None


def to_jsonable(value: Any, create_time: Callable[[int], float] | None = None) -> Any:
    """Convert model values to JSON types: records to dicts, mapping keys to strings.

    A ``ProcessKey`` also gets ``create_time(start_ticks)`` (for people, never read back).

    Raises:
        TypeError: A value of no JSON form.

    """
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, ProcessKey):
        shown = None if create_time is None else create_time(value.start_ticks)
        return {"pid": value.pid, "start_ticks": value.start_ticks, "create_time": shown}
    names = None if isinstance(value, type) else _field_names(type(value))
    if names is not None:
        return {name: to_jsonable(getattr(value, name), create_time) for name in names}
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v, create_time) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v, create_time) for v in value]
    raise TypeError(f"cannot put {type(value).__name__} into a report dict")


def _read(hint: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _read(args[0], value) if len(args) == 1 else value
    if isinstance(hint, type) and _field_names(hint) is not None:
        return record_from_dict(hint, value)
    if origin is tuple:
        return tuple(_read(typing.get_args(hint)[0], v) for v in value)
    if origin in (Mapping, dict):
        key_hint, value_hint = typing.get_args(hint)
        return {_read(key_hint, k): _read(value_hint, v) for k, v in value.items()}
    return hint(value) if hint in (int, float) else value


def record_from_dict(cls: type[Any], data: Mapping[str, Any]) -> Any:
    """A dataclass or named tuple ``cls`` from ``to_jsonable``'s form (unknown keys ignored).

    Raises:
        TypeError: A required field is missing.
        ValueError: A number field holds no number.

    """
    hints = typing.get_type_hints(cls)
    names = _field_names(cls) or []
    return cls(**{name: _read(hints[name], data[name]) for name in names if name in data})
