"""What the ``leakcheck`` commands share: exit codes, option tables, writing outputs.

Imports at load only what Python's start did (NOTE [lean start] in cli.py).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys

from leakcheck.core.errors import UsageError
from leakcheck.core.errors import one_line as one_line  # the commands import it from here

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping
    from typing import Any, TextIO, TypedDict

    Parse = Callable[[str, str], Any]

    class SharedFields(TypedDict):
        """The option fields ``sweep`` and ``run`` share, by their dataclasses' names."""

        device_index: int | None
        tolerance_bytes: int
        grace_s: float
        interval_s: float
        copy_tolerance_bytes: int

EXIT_CLEAN = 0
EXIT_LEAK = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report Ctrl-C


# NOTE [option tables]: a command's options are one table of (flag, metavar, help[, parse]):
# argparse is built from it (`add_options`; a None metavar makes a switch) and
# `option_values` turns each given text into its value with `parse(text, flag)`, which
# raises a `UsageError` naming the flag (no parse: the text). Checks that join two options,
# and the defaults, stay with the command.
Option = tuple[str, "str | None", str] | tuple[str, "str | None", str, "Parse"]


def checked(expected: str, convert: Callable[[str], Any], ok: Callable[[Any], bool]) -> Parse:
    """A parse: ``convert(text)`` where ``ok`` takes it, else one line naming the flag."""

    def parse(text: str, flag: str) -> Any:
        with contextlib.suppress(ValueError):  # int() also refuses numbers of over 4300 digits
            value = convert(str(text).strip())
            if ok(value):
                return value
        raise UsageError(f"{flag}: expected {expected}, got {text!r}")

    return parse


def parser_of(name: str, module: str = "leakcheck.core.options") -> Parse:
    """``module.name(text, flag)``, imported when first used (NOTE [lean start] in cli.py)."""

    def parse(text: str, flag: str) -> Any:
        return getattr(importlib.import_module(module), name)(text, flag)

    return parse


SHARED: tuple[Option, ...] = (  # the tolerances and grace: `shared_options`
    ("--tolerance", "SIZE", "growth below this is noise (default: $LEAKCHECK_TOLERANCE, 16MiB)"),
    (
        "--copy-tolerance",
        "SIZE",
        "what each forked worker may copy of its parent's memory (default: "
        "$LEAKCHECK_COPY_TOLERANCE, 64MiB)",
    ),
    (
        "--grace",
        "SECONDS",
        "how long a process may outlive its epoch (run: and the program; default: "
        "$LEAKCHECK_GRACE, 2)",
    ),
    ("--interval", "SECONDS", "sampling (50ms)", parser_of("parse_interval_option")),
    (
        "--device",
        "N",
        "GPU index to watch (sweep: and use; default: all, sweep uses 0)",
        parser_of("parse_device_index"),
    ),
    ("--json", "PATH", "write everything as JSON (schema-versioned)"),
    ("--plot", "PATH.png", "draw memory per epoch (matplotlib)"),
    ("--fail-on-leak", None, "exit 1, not 0, when a leak was found"),
)
"""Options of ``sweep`` and ``run``."""


def add_options(parser: Any, options: Iterable[Option]) -> None:
    """Add each option of a table to ``parser`` (NOTE [option tables])."""
    for flag, metavar, text, *_ in options:
        if metavar is None:
            parser.add_argument(flag, action="store_true", help=text)
        else:
            parser.add_argument(flag, metavar=metavar, help=text)


def option_values(args: Any, options: Iterable[Option]) -> dict[str, Any]:
    """Flag -> value of each option of a table (None where not given; NOTE [option tables])."""
    values = {}
    for flag, _, _, *parse in options:
        given = getattr(args, flag[2:].replace("-", "_"))
        values[flag] = parse[0](given, flag) if parse and given is not None else given
    return values


def shared_options(values: Mapping[str, Any]) -> SharedFields:
    """``SHARED``'s values as option fields; tolerances and grace: flag, environment, default."""
    from leakcheck.core import options as specs

    def resolved(spec: Any, flag: str, **changes: Any) -> Any:
        return specs.command_line_value(spec, flag, values[flag], os.environ, **changes)

    interval_s = values["--interval"]
    return {
        "device_index": values["--device"],
        "tolerance_bytes": resolved(specs.TOLERANCE, "--tolerance"),
        "grace_s": resolved(specs.GRACE, "--grace", default=2.0),
        "interval_s": 0.05 if interval_s is None else interval_s,
        "copy_tolerance_bytes": resolved(specs.COPY_TOLERANCE, "--copy-tolerance"),
    }


def output_paths(json: str | None, plot: str | None) -> tuple[str | None, str | None]:
    """``--json`` and ``--plot``, checked before anything runs: writable, two files, matplotlib."""
    import importlib.util

    from leakcheck.core.files import check_output_path

    json_path = check_output_path(json, "--json")
    plot_path = check_output_path(plot, "--plot", ".png")
    if json_path and plot_path and os.path.realpath(json_path) == os.path.realpath(plot_path):
        raise UsageError(
            f"--plot: expected a file other than --json's, got {plot!r} for both "
            "(the plot would overwrite the JSON)"
        )
    if plot_path is not None and importlib.util.find_spec("matplotlib") is None:
        raise UsageError(
            "--plot: needs matplotlib, which is not installed "
            "(pip install 'dataloader-leakcheck[plot]')"
        )
    return json_path, plot_path


def check_device(index: int | None, gpu: tuple[bool, str], *, needs_gpu: bool) -> None:
    """Refuse ``--device`` beyond the GPUs NVML lists; with ``needs_gpu`` (sweep), without any.

    ``run``'s report says that no GPU was checked; a sweep would print "n/a".
    """
    from leakcheck.core.errors import LeakCheckError
    from leakcheck.observe import nvml

    available, reason = gpu
    if index is None or not (available or needs_gpu):
        return
    if available:
        try:
            count = nvml.get().device_count()
        except LeakCheckError:
            return  # NVML answered a moment ago: the report says what failed
        if count or not needs_gpu:
            if index >= count:
                raise UsageError(f"--device: expected a GPU index below {count}, got {index}")
            return
        reason = "NVML lists no device"
    # The reason's tail says that process checks still run: true, but not with --device.
    reason = reason.split("; GPU memory is not checked")[0]
    raise UsageError(
        f"--device: expected a GPU index, but NVML sees no GPU here ({reason}), got {index}; "
        "leave out --device to run the host-side checks only"
    )


def emit(out: TextIO, text: str, prog: str, *, flush: bool = False) -> int | None:
    """Write ``text``: None when written, else the status to end with.

    A reader that left (``| head``) ends the command cleanly (0), a failed write (a full disk)
    with 2, said on standard error; ``out`` is then on /dev/null (its buffer is not tried again).
    """
    try:
        out.write(text)
        if flush:
            out.flush()
        return None
    except BrokenPipeError:
        status = EXIT_CLEAN
    except (OSError, ValueError) as exc:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.write(f"{prog}: could not write the output: {exc}\n")
        status = EXIT_USAGE
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
    return status


def finish(
    prog: str,
    result: Any,
    report_to: TextIO,
    err: TextIO,
    outputs: Iterable[tuple[str, str | None, Callable[[str], object]]],
    status: int,
    fail_on_leak: bool,
) -> int:
    """Write ``result``'s report, then each ``(option, path, write)`` output; the exit status.

    ``status`` (the program's, 0 for a sweep) stays, but 0 becomes 2 where an output failed,
    else 1 with ``fail_on_leak`` and a leak. A failed output is one line on ``err``; one the
    path refuses now (a folder removed, a disk full) is written elsewhere.
    """
    # A report that cannot be written (`2>&1 | head`, a full disk) loses neither the outputs
    # nor the program's status.
    ended = emit(report_to, result.format() + "\n", prog, flush=True)
    status = status or ended or 0
    for option, path, write in outputs:
        if path is None:
            continue
        try:
            write(path)
            continue
        except OSError as exc:
            saved = _write_elsewhere(path, write)
            where = (
                f"wrote it to {saved!r} instead"
                if saved is not None
                else "no other place (next to it, the current folder, the temporary folder) took it"
            )
            err.write(f"{prog}: {option}: cannot write {path!r}: {exc}; {where}\n")
        except Exception as exc:  # matplotlib could not draw it
            verb = "draw" if option == "--plot" else "write"
            err.write(f"{prog}: {option}: cannot {verb} {path!r}: {one_line(exc)}\n")
        status = status or EXIT_USAGE
    return EXIT_LEAK if status == 0 and fail_on_leak and result.leak_count else status


def _write_elsewhere(intended: str, write: Callable[[str], object]) -> str | None:
    """A new file next to ``intended``, else in the current or the temporary folder; its path."""
    import tempfile

    stem, extension = os.path.splitext(os.path.basename(intended))
    folders = [os.path.dirname(os.path.abspath(intended))]
    with contextlib.suppress(OSError):  # the current folder may have been removed
        folders.append(os.getcwd())
    folders.append(tempfile.gettempdir())
    for folder in dict.fromkeys(folders):
        try:
            handle, path = tempfile.mkstemp(
                prefix=f"{stem or 'leakcheck'}.leakcheck-", suffix=extension, dir=folder
            )
            os.close(handle)
        except OSError:
            continue
        try:
            write(path)
            return path
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(path)
    return None
