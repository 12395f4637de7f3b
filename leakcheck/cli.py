"""The ``leakcheck`` command: ``sweep`` (worker counts x epochs) and ``snapshot``.

Exit status: 0 when the run is clean (or leaks were found without ``--fail-on-leak``),
1 when leaks were found and ``--fail-on-leak`` was given, 2 on bad usage: a bad option
value, or a loader that cannot be imported, called or iterated. A usage error is one line
on standard error that names the option, what was expected and what was given, and
nothing is written to ``--json`` or ``--plot`` paths (they are written only at the end,
atomically). Ctrl-C exits 130 and writes nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

from leakcheck import options as option_specs
from leakcheck.errors import UsageError

if TYPE_CHECKING:
    from leakcheck.sweep import SweepOptions
    from leakcheck.workload import WorkloadSpec

EXIT_CLEAN = 0
EXIT_LEAK = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report Ctrl-C

_PROG = "leakcheck"
_SWEEP_GRACE_S = 2.0  # the Tracker's default: a worker may take up to 2 s to exit


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, ``<prog>: <message>``, exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``leakcheck`` argument parser (values are validated later, in one place)."""
    from leakcheck import __version__
    from leakcheck.workload import SCENARIOS, START_METHODS

    parser = _Parser(
        prog=_PROG,
        description="Find GPU memory and process leaks caused by data-loader workers.",
    )
    parser.add_argument("--version", action="version", version=f"leakcheck {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    sweep = commands.add_parser(
        "sweep",
        help="iterate a loader with several worker counts for several epochs and report "
        "GPU memory per process, per epoch",
        description="Iterate a DataLoader with each worker count for several epochs under a "
        "tracker; print GPU memory per process and epoch, then a verdict per configuration. "
        "Without --loader a built-in workload runs (its workers touch the GPU when there is "
        "one). Exit 0 clean, 1 leak found (with --fail-on-leak), 2 bad usage.",
    )
    what = sweep.add_argument_group("what to run")
    what.add_argument(
        "--loader",
        metavar="MODULE:FACTORY",
        help="your loader: FACTORY(num_workers) returns an iterable loader; MODULE is a module "
        "name or a path/to/file.py (default: the built-in workload)",
    )
    what.add_argument(
        "--workers", default="0,4,8", metavar="N,N,...", help="worker counts (default 0,4,8)"
    )
    what.add_argument("--epochs", default="5", metavar="N", help="epochs per configuration (5)")
    what.add_argument(
        "--persistent", action="store_true", help="workers live across epochs (persistent_workers)"
    )
    what.add_argument(
        "--device", default=None, metavar="N", help="GPU index to watch and use (default: all/0)"
    )
    builtin = sweep.add_argument_group("built-in workload (not with --loader)")
    builtin.add_argument(
        "--start-method",
        default=None,
        metavar="{" + ",".join(START_METHODS) + "}",
        help="how the workers start (default spawn: CUDA in forked workers fails once the "
        "parent used CUDA)",
    )
    builtin.add_argument(
        "--scenario",
        default=None,
        metavar="{" + ",".join(SCENARIOS) + "}",
        help="clean (default); persistent-cache: persistent workers keep 64 MiB per epoch alive; "
        "orphan: each worker starts a grandchild that outlives the loader",
    )
    builtin.add_argument(
        "--no-teardown",
        action="store_true",
        default=None,
        help="do not install leakcheck's teardown policy in the workers",
    )
    builtin.add_argument("--batches", default=None, metavar="N", help="batches per epoch (16)")
    judge = sweep.add_argument_group("judging")
    judge.add_argument(
        "--tolerance",
        default=None,
        metavar="SIZE",
        help="growth below this is noise (default: $LEAKCHECK_TOLERANCE, else 16MiB)",
    )
    judge.add_argument(
        "--grace",
        default=None,
        metavar="SECONDS",
        help="how long a process born in an epoch may outlive it "
        "(default: $LEAKCHECK_GRACE, else 2)",
    )
    judge.add_argument(
        "--interval", default="50ms", metavar="SECONDS", help="sampling interval (50ms)"
    )
    judge.add_argument(
        "--cooldown-temp",
        default=None,
        metavar="C",
        help="before each configuration, wait until the GPU is at or below C degrees Celsius",
    )
    judge.add_argument(
        "--cooldown-timeout",
        default="600",
        metavar="SECONDS",
        help="stop waiting for the cooldown after this long (600)",
    )
    judge.add_argument("--fail-on-leak", action="store_true", help="exit 1 when a leak is found")
    output = sweep.add_argument_group("output")
    output.add_argument("--json", default=None, metavar="PATH", help="write everything as JSON")
    output.add_argument(
        "--plot", default=None, metavar="PATH.png", help="draw memory per epoch (matplotlib)"
    )

    snapshot = commands.add_parser(
        "snapshot",
        help="who holds GPU memory now, as process trees",
        description="Show which processes hold GPU memory (and /dev/nvidia* descriptors) now, "
        "as process trees; orphans and descriptor holders are flagged. Exit 0, also without "
        "a GPU (it says so); 2 on bad arguments.",
    )
    snapshot.add_argument("--json", action="store_true", help="print JSON instead of text")
    snapshot.add_argument(
        "--pid",
        default=None,
        metavar="PID",
        help="a job's root process: also list its descendants with their roles (parent, "
        "worker, descendant) and its tagged orphans, GPU or not",
    )

    from leakcheck.run_cli import add_run_parser

    add_run_parser(commands)
    return parser


# --------------------------------------------------------------------------- validation


@dataclass(frozen=True)
class SweepPlan:
    """Validated ``sweep`` arguments."""

    options: SweepOptions
    workload: WorkloadSpec | None
    """None with ``--loader``."""
    loader: str | None
    json_path: str | None
    plot_path: str | None
    fail_on_leak: bool


def _int_value(text: str, option: str, *, minimum: int, example: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise UsageError(
            f"{option}: expected an integer >= {minimum} such as {example}, got {text!r}"
        )
    return value


def parse_workers(text: str) -> tuple[int, ...]:
    """Parse ``--workers`` (``0,4,8``) into worker counts.

    Raises:
        UsageError: Not comma-separated integers >= 0.

    """
    parts = [part.strip() for part in text.split(",")]
    # isascii: str.isdigit() also accepts digits int() rejects (superscripts).
    if any(not (part.isascii() and part.isdigit()) for part in parts):
        raise UsageError(
            f"--workers: expected comma-separated integers >= 0 such as 0,4,8, got {text!r}"
        )
    return tuple(int(part) for part in parts)


def _output_path(text: str | None, option: str, suffix: str | None = None) -> str | None:
    if text is None:
        return None
    if not text.strip():
        raise UsageError(f"{option}: expected a file path, got {text!r}")
    if suffix is not None and not text.lower().endswith(suffix):
        raise UsageError(f"{option}: expected a file name ending in {suffix}, got {text!r}")
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise UsageError(f"{option}: expected a path in an existing folder, got {text!r}")
    if os.path.isdir(text):
        raise UsageError(f"{option}: expected a file path, got the folder {text!r}")
    return text


def resolve_sweep(args: argparse.Namespace) -> SweepPlan:
    """Validate every ``sweep`` option in one place.

    Raises:
        UsageError: One line naming the option, what was expected, and the value.

    """
    from leakcheck.sweep import SweepOptions
    from leakcheck.workload import SCENARIOS, START_METHODS, WorkloadSpec

    workers = parse_workers(args.workers)
    epochs = _int_value(args.epochs, "--epochs", minimum=1, example="5")
    start_method = args.start_method or "spawn"
    if start_method not in START_METHODS:
        raise UsageError(
            f"--start-method: expected one of {', '.join(START_METHODS)}, got {args.start_method!r}"
        )
    device = None
    if args.device is not None:
        device = _int_value(args.device, "--device", minimum=0, example="0")
    # Shared with the other adapters: command line, then environment, then default.
    tolerance_bytes = option_specs.resolve(
        dataclasses.replace(option_specs.TOLERANCE, cli_flag="--tolerance"),
        cli=args.tolerance,
        environ=os.environ,
    ).value
    grace_s = option_specs.resolve(
        dataclasses.replace(option_specs.GRACE, cli_flag="--grace", default=_SWEEP_GRACE_S),
        cli=args.grace,
        environ=os.environ,
    ).value
    interval_s = option_specs.parse_seconds_option(args.interval, "--interval")
    if interval_s <= 0:
        raise UsageError(
            f"--interval: expected more than 0 seconds such as 50ms, got {args.interval!r}"
        )
    cooldown_temp_c = None
    if args.cooldown_temp is not None:
        try:
            cooldown_temp_c = float(args.cooldown_temp)
        except ValueError:
            cooldown_temp_c = None
        if cooldown_temp_c is None or not 0 < cooldown_temp_c < 150:
            raise UsageError(
                f"--cooldown-temp: expected degrees Celsius between 0 and 150 such as 45, "
                f"got {args.cooldown_temp!r}"
            )
    cooldown_timeout_s = option_specs.parse_seconds_option(
        args.cooldown_timeout, "--cooldown-timeout"
    )
    json_path = _output_path(args.json, "--json")
    plot_path = _output_path(args.plot, "--plot", ".png")
    if plot_path is not None and importlib.util.find_spec("matplotlib") is None:
        raise UsageError(
            "--plot: needs matplotlib, which is not installed (pip install 'leakcheck[plot]')"
        )

    workload = None
    loader = args.loader
    if loader is not None:
        for option, value in (
            ("--scenario", args.scenario),
            ("--start-method", args.start_method),
            ("--no-teardown", args.no_teardown),
            ("--batches", args.batches),
        ):
            if value is not None:
                raise UsageError(
                    f"{option}: applies to the built-in workload only, not with --loader"
                )
        _split_loader(loader)  # the format is checked now; importing waits for the run
    else:
        scenario = args.scenario or "clean"
        if scenario not in SCENARIOS:
            raise UsageError(
                f"--scenario: expected one of {', '.join(SCENARIOS)}, got {args.scenario!r}"
            )
        batches = WorkloadSpec.batches
        if args.batches is not None:
            batches = _int_value(args.batches, "--batches", minimum=1, example="16")
        workload = WorkloadSpec(
            scenario=scenario,
            batches=batches,
            start_method=start_method,
            persistent=args.persistent,
            teardown=not args.no_teardown,
            device_index=device or 0,
        )
    persistent = args.persistent or (workload is not None and workload.persistent_workers)
    options = SweepOptions(
        workers=workers,
        epochs=epochs,
        persistent=persistent,
        device_index=device,
        cooldown_temp_c=cooldown_temp_c,
        cooldown_timeout_s=cooldown_timeout_s,
        interval_s=interval_s,
        tolerance_bytes=tolerance_bytes,
        grace_s=grace_s,
    )
    return SweepPlan(
        options=options,
        workload=workload,
        loader=loader,
        json_path=json_path,
        plot_path=plot_path,
        fail_on_leak=args.fail_on_leak,
    )


# --------------------------------------------------------------------------- --loader


def _split_loader(spec: str) -> tuple[str, str]:
    module, sep, factory = spec.rpartition(":")
    if not sep or not module.strip() or not factory.isidentifier():
        raise UsageError(
            f"--loader: expected MODULE:FACTORY or path/to/file.py:FACTORY, got {spec!r}"
        )
    return module, factory


def load_factory(spec: str) -> Callable[[int], Iterable[Any]]:
    """Import ``MODULE:FACTORY`` or ``path/to/file.py:FACTORY`` and return FACTORY.

    A file is imported under its own name with its folder on ``sys.path``, so that spawned
    workers can import what it defines (datasets must be picklable by reference).

    Raises:
        UsageError: The module cannot be imported, or has no callable FACTORY.

    """
    module_name, factory_name = _split_loader(spec)
    try:
        if module_name.endswith(".py") or os.sep in module_name:
            module = _import_file(module_name)
        else:
            # As `python -m` does: modules of the current folder can be named.
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except UsageError:
        raise
    except BaseException as exc:  # SyntaxError, SystemExit in an import... all one line
        if isinstance(exc, KeyboardInterrupt):
            raise
        from leakcheck.sweep import one_line

        raise UsageError(f"--loader: cannot import {module_name!r}: {one_line(exc)}") from None
    factory = getattr(module, factory_name, None)
    if factory is None:
        raise UsageError(f"--loader: {module_name!r} has no attribute {factory_name!r}")
    if not callable(factory):
        raise UsageError(
            f"--loader: {module_name}:{factory_name} is a {type(factory).__name__}, expected "
            "a callable FACTORY(num_workers)"
        )
    return factory  # type: ignore[no-any-return]


def _import_file(path: str) -> Any:
    if not os.path.isfile(path):
        raise UsageError(f"--loader: expected an existing file.py, got {path!r} (no such file)")
    path = os.path.abspath(path)
    folder, base = os.path.split(path)
    name = os.path.splitext(base)[0]
    if folder not in sys.path:
        sys.path.insert(0, folder)
    existing = sys.modules.get(name)
    if existing is None and name.isidentifier():
        module = importlib.import_module(name)
        if _same_file(getattr(module, "__file__", None), path):
            return module
    elif existing is not None and _same_file(getattr(existing, "__file__", None), path):
        return existing
    # The name is taken by another module: load the file under a private name (spawned
    # workers will not find classes defined in it by name, but the factory still runs).
    unique = f"leakcheck_user_loader_{abs(hash(path))}"
    file_spec = importlib.util.spec_from_file_location(unique, path)
    if file_spec is None or file_spec.loader is None:
        raise UsageError(f"--loader: cannot import {path!r} as a Python file")
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[unique] = module
    file_spec.loader.exec_module(module)
    return module


def _same_file(a: str | None, b: str) -> bool:
    try:
        return a is not None and os.path.samefile(a, b)
    except OSError:
        return False


# --------------------------------------------------------------------------- commands


def run_sweep_command(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``leakcheck sweep``: run, print, write the outputs, pick the exit status."""
    from leakcheck import nvml
    from leakcheck.errors import LeakCheckError
    from leakcheck.progress import Progress
    from leakcheck.sweep import LoaderError, one_line, run_sweep, write_json

    prog = f"{_PROG} sweep"
    try:
        plan = resolve_sweep(args)
        gpu = nvml.availability()
        count = None
        if gpu[0] and plan.options.device_index is not None:
            # NVML answered a moment ago; if it fails now the sweep says so in its header.
            with contextlib.suppress(LeakCheckError):
                count = nvml.get().device_count()
            if count is not None and plan.options.device_index >= count:
                raise UsageError(
                    f"--device: expected a GPU index below {count}, got {plan.options.device_index}"
                )
        if plan.loader is not None:
            factory = load_factory(plan.loader)
            description = f"loader {plan.loader}"
        else:
            from leakcheck.workload import builtin_factory, describe, with_gpu

            assert plan.workload is not None  # resolve_sweep sets it without --loader
            spec = with_gpu(plan.workload, gpu[0])
            factory = builtin_factory(spec)
            description = describe(spec)
    except UsageError as exc:
        err.write(f"{prog}: {exc}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:  # importing a --loader module can take a while
        err.write(f"{prog}: interrupted; nothing written\n")
        return EXIT_INTERRUPTED

    progress = Progress(len(plan.options.workers) * plan.options.epochs, stream=err)
    try:
        result = run_sweep(plan.options, factory, loader=description, progress=progress, gpu=gpu)
    except LoaderError as exc:
        progress.close()
        where = f"--loader {plan.loader}" if plan.loader else "built-in workload"
        err.write(f"{prog}: {where}: {exc}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        progress.close()
        err.write(f"{prog}: interrupted; nothing written\n")
        return EXIT_INTERRUPTED

    out.write(result.format() + "\n")
    out.flush()
    status = EXIT_CLEAN
    if plan.json_path is not None:
        try:
            write_json(plan.json_path, result.to_dict())
        except OSError as exc:
            err.write(f"{prog}: --json: cannot write {plan.json_path!r}: {exc}\n")
            status = EXIT_USAGE
    if plan.plot_path is not None:
        try:
            from leakcheck.plot import plot_sweep

            plot_sweep(result, plan.plot_path)
        except Exception as exc:
            err.write(f"{prog}: --plot: cannot draw {plan.plot_path!r}: {one_line(exc)}\n")
            status = EXIT_USAGE
    if status == EXIT_CLEAN and plan.fail_on_leak and result.leak_count:
        status = EXIT_LEAK
    return status


def run_snapshot_command(args: argparse.Namespace, out: TextIO) -> int:
    """``leakcheck snapshot``: print who holds GPU memory now (and a job's lineage)."""
    from leakcheck import procs
    from leakcheck.snapshot import take_snapshot

    root_pid: int | None = None
    if args.pid is not None:
        text = str(args.pid).strip()
        if not (text.isascii() and text.isdigit()) or int(text) <= 0:
            sys.stderr.write(f"{_PROG} snapshot: --pid: expected a process ID > 0, got {text!r}\n")
            return EXIT_USAGE
        root_pid = int(text)
        if procs.process_key(root_pid) is None:
            sys.stderr.write(
                f"{_PROG} snapshot: --pid: no running process with PID {root_pid} here\n"
            )
            return EXIT_USAGE
    snapshot = take_snapshot(root_pid=root_pid)
    if args.json:
        out.write(json.dumps(snapshot.to_dict(), indent=2) + "\n")
    else:
        out.write(snapshot.format() + "\n")
    return EXIT_CLEAN


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``leakcheck`` and ``python -m leakcheck``.

    Returns:
        The exit status (0 clean, 1 leak found with ``--fail-on-leak``, 2 bad usage).

    """
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if extra:
        # Named by the subcommand that got them, not by the top-level parser.
        prog = f"{_PROG} {args.command}" if args.command else _PROG
        sys.stderr.write(f"{prog}: unrecognized arguments: {' '.join(extra)}\n")
        return EXIT_USAGE
    if args.command == "sweep":
        return run_sweep_command(args, sys.stdout, sys.stderr)
    if args.command == "snapshot":
        return run_snapshot_command(args, sys.stdout)
    if args.command == "run":
        from leakcheck.run_cli import run_command

        return run_command(args, sys.stdout, sys.stderr)
    sys.stderr.write(f"{_PROG}: expected a command: sweep or snapshot (see leakcheck --help)\n")
    return EXIT_USAGE
