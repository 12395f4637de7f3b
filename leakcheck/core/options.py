"""Options of every adapter: command line > environment > ini > default (imports nothing heavy).

``resolve`` parses the first source that sets an ``OptionSpec``, so a bad value names where it
came from (``LEAKCHECK_TOLERANCE (environment)``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Generic, Literal, TypeVar

from leakcheck.core.errors import UsageError
from leakcheck.core.units import parse_duration, parse_size

T = TypeVar("T")

Mode = Literal["fail", "warn"]
MODES: tuple[Mode, ...] = ("fail", "warn")

_SWITCHES = dict.fromkeys(("1", "true", "yes", "on", "y"), True) | dict.fromkeys(
    ("0", "false", "no", "off", "n"), False
)


def parse_bool(value: object, source: str) -> bool:
    """Parse a switch: ``1/true/yes/on`` or ``0/false/no/off`` (any case), or a bool."""
    switch = value if isinstance(value, bool) else _SWITCHES.get(str(value).strip().lower())
    if switch is None:
        raise UsageError(f"{source}: expected 1/true/yes/on or 0/false/no/off, got {value!r}")
    return switch


def parse_mode(value: object, source: str) -> Mode:
    """Parse what to do with a leak: ``fail`` or ``warn``."""
    text = str(value).strip().lower()
    if text not in MODES:
        raise UsageError(f"{source}: expected one of fail, warn, got {value!r}")
    return text


def parse_share_option(value: object, source: str) -> float:
    """Parse a share of time in (0, 1]: a number (``0.001``, ``1``) or a percentage (``0.1%``)."""
    share: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        share = float(value)
    elif isinstance(value, str):
        text = value.strip()
        with contextlib.suppress(ValueError):
            share = float(text.removesuffix("%")) * (0.01 if text.endswith("%") else 1.0)
    if share is None or not 0 < share <= 1:  # NaN fails both comparisons
        raise UsageError(
            f"{source}: expected a share of time in (0, 1] such as 0.001, 0.1% or 1, got {value!r}"
        )
    return share


MIN_INTERVAL_S = 0.001  # about what a sample of many workers takes: a shorter one spins


def parse_interval_option(value: object, source: str) -> float:
    """Parse a sampling interval in seconds, at least ``MIN_INTERVAL_S`` (``50ms``, ``0.05``)."""
    interval_s = parse_duration(value, source, negative_ok=True)
    if interval_s < MIN_INTERVAL_S:  # a negative one too: the floor says what is expected
        raise UsageError(
            f"{source}: expected 1ms or more (a shorter interval makes the sampler spin: one "
            f"sample takes about 1 ms), got {value!r}"
        )
    return interval_s


def parse_device_index(value: object, source: str) -> int:
    """Parse a GPU index (``0``, ``3``): an integer >= 0, as NVML numbers devices."""
    text = str(value).strip()
    if not (text.isascii() and text.isdigit()):
        raise UsageError(f"{source}: expected a GPU index >= 0 such as 0, got {value!r}")
    return int(text)


@dataclass(frozen=True)
class OptionSpec(Generic[T]):
    """One option, every place it can be set, and ``parse(raw, source)`` (``UsageError``)."""

    name: str
    parse: Callable[[object, str], T]
    default: T
    help: str
    cli_flag: str | None = None
    env_var: str | None = None
    ini_key: str | None = None
    attribute: str = ""  # its field of CheckOptions, where not ``name``


@dataclass(frozen=True)
class Resolved(Generic[T]):
    """A parsed value and where it came from (``default``, ``--flag (command line)``, ...)."""

    value: T
    source: str


def resolve(
    spec: OptionSpec[T],
    *,
    cli: object = None,
    environ: Mapping[str, str] | None = None,
    ini: object = None,
    ini_path: str | None = None,
) -> Resolved[T]:
    """Resolve one option: command line, then environment, then ini, then the default.

    ``cli`` None: not given; ``ini`` None or empty: absent from ``ini_path``.

    Raises:
        UsageError: The winning source holds a bad value; the message names the source.

    """
    if isinstance(ini, (list, tuple)):
        ini = ini[0] if len(ini) == 1 else ini or None
    env = None if environ is None or spec.env_var is None else environ.get(spec.env_var)
    ini_file = f"ini file {ini_path}" if ini_path else "ini file"
    for name, where, raw in (
        (spec.cli_flag, "command line", cli),
        (spec.env_var, "environment", env),
        (spec.ini_key, ini_file, ini),
    ):
        # An absent ini key reads as "" (or None, or []), as does an environment variable
        # exported empty: not set there. A flag given empty was typed: parsed (and refused).
        blank = isinstance(raw, str) and not raw.strip() and where != "command line"
        if name is not None and raw is not None and not blank:
            source = f"{name} ({where})"
            return Resolved(spec.parse(raw, source), source)
    return Resolved(spec.default, "default")


def _leak_option(
    name: str, parse: Callable[[object, str], T], default: T, help: str, attribute: str = ""
) -> OptionSpec[T]:
    """An option named ``--gpu-leak-NAME``, ``LEAKCHECK_NAME`` and ini ``gpu_leak_NAME``."""
    flag, env = "--gpu-leak-" + name.replace("_", "-"), "LEAKCHECK_" + name.upper()
    return OptionSpec(name, parse, default, help, flag, env, "gpu_leak_" + name, attribute)


ENABLED = OptionSpec(
    "enabled",
    parse_bool,
    False,
    "fail tests that leave processes, /dev/shm segments or GPU memory behind",
    "--gpu-leak-check",
    "LEAKCHECK_GPU_LEAK_CHECK",
    "gpu_leak_check",
)
TOLERANCE = _leak_option(
    "tolerance",
    parse_size,
    16 * 1024 * 1024,
    "GPU memory a test may keep without failing (16MiB, 1GB, bytes; default 16MiB)",
    "tolerance_bytes",
)
MODE: OptionSpec[Mode] = _leak_option(
    "mode", parse_mode, "fail", "what a leak does to its test: fail (default) or warn"
)
COPY_TOLERANCE = _leak_option(
    "copy_tolerance",
    parse_size,
    64 * 1024 * 1024,
    "host memory each forked loader worker may copy of its parent's (copy-on-read; default 64MiB)",
    "copy_tolerance_bytes",
)
GRACE = _leak_option(
    "grace",
    parse_duration,
    1.0,
    "seconds a process started by a test may take to exit after it (default 1)",
    "grace_s",
)


def command_line_value(
    spec: OptionSpec[T], flag: str, value: object, environ: Mapping[str, str], **changes: Any
) -> T:
    """A command's ``flag`` (None: not given), else the environment; ``changes``: to ``spec``."""
    return resolve(replace(spec, cli_flag=flag, **changes), cli=value, environ=environ).value


WARN_FLAG = "--gpu-leak-warn"  # the pytest switch that means --gpu-leak-mode=warn


SPECS: tuple[OptionSpec[Any], ...] = (ENABLED, TOLERANCE, MODE, GRACE, COPY_TOLERANCE)
"""Options of the leak check, in the order ``--help`` lists them."""


@dataclass(frozen=True)
class CheckOptions:
    """Resolved options of the leak check; ``sources``: where each came from, by name."""

    enabled: bool = False
    tolerance_bytes: int = TOLERANCE.default
    mode: Mode = "fail"
    grace_s: float = GRACE.default
    copy_tolerance_bytes: int = COPY_TOLERANCE.default
    sources: Mapping[str, str] = field(default_factory=dict)


def resolve_check_options(
    cli: Mapping[str, object] | None = None,
    environ: Mapping[str, str] | None = None,
    ini: Mapping[str, object] | None = None,
    *,
    ini_path: str | None = None,
) -> CheckOptions:
    """Resolve every option of the leak check (``resolve``'s sources, by option name).

    ``cli`` also takes ``warn``: True when ``--gpu-leak-warn`` was given.

    Raises:
        UsageError: A bad value, named with where it came from.

    """
    cli = cli or {}
    ini = ini or {}
    warn_source = f"{WARN_FLAG} (command line)"
    found: dict[str, Resolved[Any]] = {}
    for spec in SPECS:
        given = cli.get(spec.name)
        warn = cli.get("warn") if spec is MODE else None
        # --gpu-leak-warn with no --gpu-leak-mode wins; a contradiction is refused, never won
        # by coming last.
        warned = warn is not None and parse_bool(warn, warn_source)
        if warned and given is None:
            found[spec.name] = Resolved("warn", warn_source)
            continue
        found[spec.name] = resolve(
            spec, cli=given, environ=environ, ini=ini.get(spec.name), ini_path=ini_path
        )
        if warned and found[spec.name].value != "warn":
            raise UsageError(
                f"{warn_source}: contradicts {MODE.cli_flag} {given!r}; pass one of them"
            )
    return CheckOptions(
        **{spec.attribute or spec.name: found[spec.name].value for spec in SPECS},
        sources={name: value.source for name, value in found.items()},
    )


def apply_marker(
    options: CheckOptions,
    args: tuple[object, ...],
    kwargs: Mapping[str, object],
    *,
    where: str,
) -> CheckOptions:
    """Override options with a marker's arguments; ``where`` names the marker in errors.

    A lone positional argument is ``enabled``; a marker that does not say it enables its
    test, unless ``enabled`` was chosen explicitly before.

    Raises:
        UsageError: An unknown argument or a bad value.

    """
    if len(args) > 1:
        raise UsageError(f"{where}: takes at most one positional argument (enabled), got {args!r}")
    accepted = [spec.name for spec in SPECS]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise UsageError(
            f"{where}: unknown argument(s) {', '.join(unknown)}; expected {', '.join(accepted)}"
        )
    values: dict[str, object] = dict(kwargs)
    if args:
        if "enabled" in values:
            raise UsageError(f"{where}: enabled given twice")
        values["enabled"] = args[0]
    elif "enabled" not in values and options.sources.get("enabled") in (None, "default"):
        # An explicit choice elsewhere (--no-gpu-leak-check, a farther marker's) stands.
        values["enabled"] = True
    sources = dict(options.sources)
    changes: dict[str, object] = {}
    for spec in SPECS:
        if spec.name in values:
            sources[spec.name] = source = f"{spec.name}= of {where}"
            changes[spec.attribute or spec.name] = spec.parse(values[spec.name], source)
    return replace(options, sources=sources, **changes)  # type: ignore[arg-type]
