"""Where benchmark results go: one file per benchmark and machine, ``results/<name>.md``.

A name is the benchmark and the machine, never a date (``watch-h200``, ``snapshot-cpu``): each
run overwrites the current result of its benchmark on its machine, and git keeps the ones before
it. A benchmark run in another setting (``--variant control``, 64 children instead of 8) writes
its own section of the same file, so the file holds one current result per setting. A section is
the run's table and, at its end, its data as a fenced JSON block that ``read_results`` returns.
"""

from __future__ import annotations

import json
import os
import platform
import re
import time
from typing import Any, NamedTuple

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
_SECTION = re.compile(r"^<!-- setting: (\S+) -->$", re.MULTILINE)
_DATA = re.compile(r"\n```json\n(.*?)\n```\n?\Z", re.DOTALL)
DEFAULT_SETTING = "default"


class ResultName(NamedTuple):
    """A result's file (``<benchmark>-<machine>``) and its setting's section in that file."""

    file_stem: str
    setting: str


def host_meta() -> dict[str, Any]:
    """When and where a benchmark ran: date, host, CPU count and Python version."""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
    }


def gpu_meta() -> dict[str, str]:
    """Name of GPU 0 and the driver version, as the results record them (NVML must work)."""
    from leakcheck.observe import nvml
    handle = nvml.get()
    return {
        "gpu": handle.memory()[0].name,
        "driver": handle.driver_version() or "unknown",
    }


def machine() -> str:
    """The machine a result belongs to: GPU 0's model where NVML sees one (``h200``), or ``cpu``."""
    from leakcheck.observe import nvml
    ok, _reason = nvml.availability()
    devices = nvml.get().memory() if ok else ()
    if not devices:
        return "cpu"
    model = devices[0].name.lower().removeprefix("nvidia").strip()
    return re.sub(r"[^a-z0-9]+", "-", model).strip("-") or "gpu"


def result_stem(benchmark: str, *settings: str) -> ResultName:
    """A result's name: the file ``<benchmark>-<machine>``, the section the non-empty settings.

    Args:
        benchmark: The benchmark (``watch``, ``driver``).
        settings: What sets this run apart from the benchmark's default run on the machine
            (``64children``, ``control``, an operation); empty strings are left out.

    """
    setting = "-".join(part for part in settings if part) or DEFAULT_SETTING
    return ResultName(f"{benchmark}-{machine()}", setting)


def _sections(path: str) -> dict[str, str]:
    try:
        with open(path) as handle:
            text = handle.read()
    except FileNotFoundError:
        return {}
    parts = _SECTION.split(text)
    # parts: [before the first marker, setting, body, setting, body, ...]
    return {parts[i]: parts[i + 1].strip("\n") for i in range(1, len(parts) - 1, 2)}


def write_result(name: ResultName, payload: Any, text: str, directory: str = RESULTS_DIR) -> str:
    """Write the run's table and data as its setting's section of its file; return the path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name.file_stem + ".md")
    sections = _sections(path)
    data = "" if payload is None else "\n\n```json\n" + json.dumps(payload, indent=2) + "\n```"
    sections[name.setting] = text.rstrip("\n") + data
    order = sorted(sections, key=lambda setting: (setting != DEFAULT_SETTING, setting))
    with open(path, "w") as handle:
        handle.write(
            "\n\n".join(f"<!-- setting: {setting} -->\n{sections[setting]}" for setting in order)
            + "\n"
        )
    return path


def read_results(path: str) -> dict[str, Any]:
    """The data of each setting's section of a result file that has data, by setting."""
    found = {}
    for setting, section in _sections(path).items():
        match = _DATA.search(section + "\n")
        if match is not None:
            found[setting] = json.loads(match.group(1))
    return found
