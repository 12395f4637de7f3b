"""Every model record survives a JSON round trip through core/records.py."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from typing import Any

import pytest

from leakcheck.core import model, readings
from leakcheck.core.records import record_from_dict, to_jsonable

RECORDS = sorted(
    {
        value
        for module in (model, readings)
        for value in vars(module).values()
        if isinstance(value, type)
        and value.__module__ == module.__name__
        and (dataclasses.is_dataclass(value) or hasattr(value, "_fields"))
    },
    key=lambda cls: cls.__name__,
)


def sample(hint: Any, depth: int = 0) -> Any:
    """A value of type ``hint`` unlike any default: nested records filled in too."""
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        return sample(next(a for a in typing.get_args(hint) if a is not type(None)), depth)
    if origin is typing.Literal:
        return typing.get_args(hint)[-1]
    if origin is tuple:
        return (sample(typing.get_args(hint)[0], depth),)
    if origin in (Mapping, dict):
        key_hint, value_hint = typing.get_args(hint)
        return {sample(key_hint, depth): sample(value_hint, depth)}
    if hint is bool:
        return True
    if hint is int:
        return 7 + depth
    if hint is float:
        return 2.5
    if hint is str:
        return f"text {depth}"
    return filled(hint, depth + 1)


def filled(cls: type[Any], depth: int = 0) -> Any:
    hints = typing.get_type_hints(cls)
    names = cls._fields if hasattr(cls, "_fields") else [f.name for f in dataclasses.fields(cls)]
    return cls(**{name: sample(hints[name], depth) for name in names})


def test_every_model_module_record_is_covered() -> None:
    names = {cls.__name__ for cls in RECORDS}
    assert {"Timeline", "ProcessEpoch", "Finding", "ProcessKey", "DeviceState"} <= names


@pytest.mark.parametrize("cls", RECORDS, ids=lambda cls: cls.__name__)
def test_record_round_trips_through_json(cls: type[Any]) -> None:
    record = filled(cls)
    data = json.loads(json.dumps(to_jsonable(record)))
    assert record_from_dict(cls, data) == record


def test_process_key_shows_its_create_time_and_reads_back_without_it() -> None:
    key = readings.ProcessKey(pid=12, start_ticks=300)
    data = to_jsonable({1: key}, create_time=lambda ticks: 1000.0 + ticks / 100)
    assert data == {"1": {"pid": 12, "start_ticks": 300, "create_time": 1003.0}}
    assert record_from_dict(readings.ProcessKey, data["1"]) == key


def test_what_json_cannot_hold_is_refused() -> None:
    with pytest.raises(TypeError, match="set"):
        to_jsonable({1, 2})
