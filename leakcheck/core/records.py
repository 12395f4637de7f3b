"""The model's records as JSON-able data and back: one converter for every layer.

Dataclasses (``model.py``) and named tuples (``readings.py``) become objects keyed by field
name, mappings objects with string keys, tuples lists; ``record_from_dict`` reads them back
by the field types, nested records, tuples, mappings and optional fields included.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

from leakcheck.core.readings import ProcessKey

__all__ = ["from_jsonable", "record_from_dict", "to_jsonable"]


def to_jsonable(value: Any, create_time: Callable[[int], float] | None = None) -> Any:
    """Convert model values to JSON types: records to dicts, mapping keys to strings.

    A ``ProcessKey`` also gets its ``create_time`` from ``create_time(start_ticks)`` (None
    without it): for people, never read back (NOTE [process identity] in procs.py).

    Raises:
        TypeError: A value of no JSON form.

    """
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: to_jsonable(getattr(value, f.name), create_time)
            for f in dataclasses.fields(value)
        }
    if isinstance(value, ProcessKey):
        shown = None if create_time is None else create_time(value.start_ticks)
        return {"pid": value.pid, "start_ticks": value.start_ticks, "create_time": shown}
    if _is_record(type(value)):
        return {
            name: to_jsonable(item, create_time)
            for name, item in zip(value._fields, value, strict=True)
        }
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v, create_time) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v, create_time) for v in value]
    raise TypeError(f"cannot put {type(value).__name__} into a report dict")


def from_jsonable(hint: Any, value: Any) -> Any:
    """Inverse of ``to_jsonable`` for one value of type ``hint``."""
    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return from_jsonable(args[0], value) if len(args) == 1 else value
    if isinstance(hint, type) and (dataclasses.is_dataclass(hint) or _is_record(hint)):
        return record_from_dict(hint, value)
    if origin is tuple:
        return tuple(from_jsonable(typing.get_args(hint)[0], v) for v in value)
    if origin in (Mapping, dict):
        key_hint, value_hint = typing.get_args(hint)
        return {from_jsonable(key_hint, k): from_jsonable(value_hint, v) for k, v in value.items()}
    if hint is int:
        return int(value)
    if hint is float:
        return float(value)
    return value


def record_from_dict(cls: type[Any], data: Mapping[str, Any]) -> Any:
    """A dataclass or named tuple ``cls`` from ``to_jsonable``'s form (unknown keys ignored).

    Raises:
        TypeError: A required field is missing.
        ValueError: A number field holds no number.

    """
    hints = typing.get_type_hints(cls)
    names = cls._fields if _is_record(cls) else [f.name for f in dataclasses.fields(cls) if f.init]
    return cls(**{name: from_jsonable(hints[name], data[name]) for name in names if name in data})


def _is_record(cls: type[Any]) -> bool:
    """Whether ``cls`` is a named tuple class (the records of readings.py)."""
    return issubclass(cls, tuple) and hasattr(cls, "_fields")
