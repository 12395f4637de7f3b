"""The ``leakcheck`` command: ``sweep``, ``snapshot``, ``run`` and ``explain``.

Exit status: 0 clean (or leaks without ``--fail-on-leak``), 1 leaks with ``--fail-on-leak``,
2 bad usage (one line naming the option, what was expected and what was given), a loader
that cannot be imported, called or iterated, or an output not written; 130 Ctrl-C. ``run``:
the program's status (128 + N for signal N; NOTE [run signals] in launcher.py), 1 instead of 0
with ``--fail-on-leak`` and a leak, 2 when an output failed after a successful program, 127
(126) when the command is not found (cannot be executed).
"""

from __future__ import annotations

import contextlib
import os
import sys
from types import SimpleNamespace

from leakcheck.commands.common import (
    EXIT_CLEAN,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    SHARED,
    add_options,
    check_device,
    checked,
    emit,
    finish,
    one_line,
    option_values,
    output_paths,
    parser_of,
    shared_options,
)
from leakcheck.core.errors import UsageError

# NOTE [lean start]: `leakcheck snapshot` is run by hand and in loops, and every module a
# start imports costs time: this module imports at load only what Python's start (and
# contextlib) did, each command what it needs when it runs; a plain `snapshot` line is read
# without argparse (`_plain_snapshot_args`), and `typing` is not imported.
# NOTE [quick exit]: a process that used NVML spends a noticeable part of a snapshot in its
# normal exit (the driver library's teardown: benchmarks/results/README.md). A snapshot has
# nothing left to do once its text is flushed, so the executable (`command`) ends it with
# os._exit after flushing. `main` returns as always, for callers in the same process.
TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable, Iterable, Sequence
    from typing import Any, NoReturn, TextIO, TypeVar

    from leakcheck.commands.common import Option, Parse
    from leakcheck.commands.sweep import SweepOptions
    from leakcheck.commands.workload import WorkloadSpec
    from leakcheck.core.model import ProcessKey

    _T = TypeVar("_T")

_PROG = "leakcheck"

WORKERS_PER_CPU = 8
"""Worker counts allowed per usable CPU without ``--max-workers`` (beyond, memory runs out)."""

WATCH_MIN_S = 0.1
"""The shortest ``snapshot --watch`` period: each frame reads NVML and all of /proc."""
WATCH_MAX_S = 1e9  # as units.MAX_SECONDS (not imported: NOTE [lean start]): sleep() overflows

_LAUNCHERS = ("torchrun", "torch.distributed.run", "torch.distributed.launch")
_NPROC_WORDS = ("auto", "cpu", "gpu")


def _digits(text: str) -> int:
    # isascii: str.isdigit() also accepts digits int() rejects (superscripts).
    if not (text.isascii() and text.isdigit()):
        raise ValueError(text)
    return int(text)


def _count(minimum: int, example: str) -> Parse:
    return checked(f"an integer >= {minimum} such as {example}", int, lambda n: n >= minimum)


def _one_of(choices: Sequence[str]) -> Parse:
    return checked(f"one of {', '.join(choices)}", str, choices.__contains__)


_NPROC = checked(
    "a number of ranks from 1 to 4096 such as 2 (or auto, cpu, gpu)",
    lambda text: text if text in _NPROC_WORDS else str(_digits(text)),
    lambda text: text in _NPROC_WORDS or 1 <= int(text) <= 4096,
)
_DURATION = parser_of("parse_duration", "leakcheck.core.units")

SNAPSHOT: tuple[Option, ...] = (
    ("--json", None, "print JSON instead of text"),
    ("--telemetry", None, "also read each GPU's temperature, clocks and power"),
    (
        "--pid",
        "PID",
        "a job's root process: also list its descendants with their roles and its "
        "tagged orphans, each with its host memory",
        checked("a process ID > 0", _digits, lambda pid: 0 < pid < 10**20),
    ),
    (
        "--watch",
        "SECONDS",
        f"a new snapshot every SECONDS (>= {WATCH_MIN_S}) until Ctrl-C: redrawn on a "
        "terminal, else each after a line with its time (--json: one document per "
        "line)",
        checked(
            f"a number of seconds >= {WATCH_MIN_S} and below 1e9 such as 2",
            float,
            lambda seconds: WATCH_MIN_S <= seconds < WATCH_MAX_S,  # NaN fails `<=` too
        ),
    ),
)

RUN: tuple[Option, ...] = (
    *SHARED,
    (
        "--hang-after",
        "SECONDS",
        "seconds a loop may wait for a batch before its process's and workers' stacks "
        "are written to stderr and the report (default 120; 0: off)",
        _DURATION,
    ),
    (
        "--rollup-share",
        "SHARE",
        "share of the time USS reads (smaps_rollup, which show copy-on-read) may take; "
        "1 reads at every epoch end (default 0.001)",
        parser_of("parse_share_option"),
    ),
    (
        "--nproc-per-node",
        "N",
        "run the script under torchrun (--standalone) with N ranks; the report gives a "
        "verdict per rank and for the job (own torchrun options: leakcheck run -- "
        "torchrun)",
        _NPROC,
    ),
    ("--teardown", None, "workers release their CUDA context at exit and die with their parent"),
)


def _sweep_options() -> tuple[Option, ...]:
    from leakcheck.commands.workload import SCENARIOS, START_METHODS

    return (
        (
            "--loader",
            "MODULE:FACTORY",
            "your loader: FACTORY(num_workers) returns an iterable loader; MODULE is a "
            "module name or a path/to/file.py (default: the built-in workload)",
        ),
        (
            "--workers",
            "N,N,...",
            "worker counts (default 0,4,8; 0,N,2N where N < 4 CPUs are usable)",
            checked(
                "comma-separated integers >= 0 such as 0,4,8",
                lambda text: tuple(_digits(part.strip()) for part in text.split(",")),
                bool,
            ),
        ),
        (
            "--max-workers",
            "N",
            f"allow worker counts up to N (default: {WORKERS_PER_CPU} per CPU this process "
            "may use, within the room the user's process limit RLIMIT_NPROC leaves)",
            _count(0, "64"),
        ),
        ("--epochs", "N", "epochs per configuration (5)", _count(1, "5")),
        ("--persistent", None, "persistent_workers=True (built-in workload)"),
        ("--no-teardown", None, "no teardown policy in the workers (they still report)"),
        (
            "--start-method",
            f"{{{','.join(START_METHODS)}}}",
            "built-in workload: how workers start (default spawn: forked workers cannot "
            "use CUDA once the parent did)",
            _one_of(START_METHODS),
        ),
        (
            "--scenario",
            f"{{{','.join(SCENARIOS)}}}",
            "built-in workload: clean, a leak to find, or a failure staged (docs/FAILURES.md)",
            _one_of(SCENARIOS),
        ),
        ("--batches", "N", "built-in workload: batches per epoch (16)", _count(1, "16")),
        *SHARED,
        (
            "--cooldown-temp",
            "C",
            "before each configuration, wait for GPU <= C °C",
            checked(
                "degrees Celsius between 0 and 150 such as 45",
                float,
                lambda celsius: 0 < celsius < 150,
            ),
        ),
        ("--cooldown-timeout", "SECONDS", "wait at most this (600)", _DURATION),
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``leakcheck`` argument parser (values are checked later: NOTE [option tables])."""
    import argparse
    import re

    from leakcheck import __version__

    class Parser(argparse.ArgumentParser):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # A value such as -5MiB or -1s is a value (refused by its option, naming it), not
            # an unknown option that leaves the one before "expected one argument".
            self._negative_number_matcher = re.compile(r"^-\.?\d")

        def error(self, message: str) -> NoReturn:  # one line, exit 2
            self.exit(EXIT_USAGE, f"{self.prog}: {message}\n")

    parser = Parser(
        prog=_PROG, description="Find GPU memory and process leaks caused by data-loader workers."
    )
    parser.add_argument("--version", action="version", version=f"leakcheck {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sweep = commands.add_parser(
        "sweep",
        help="iterate a loader with several worker counts for several epochs and report "
        "GPU memory per process, per epoch",
        description="Iterate a DataLoader with each worker count for several epochs under a "
        "tracker; print memory per process and epoch, then a verdict per configuration. "
        "Without --loader a built-in workload runs (its workers touch the GPU if there is "
        "one). Exit 0 clean, 1 leak found (with --fail-on-leak), 2 bad usage.",
    )
    add_options(sweep, _sweep_options())
    snapshot = commands.add_parser(
        "snapshot",
        help="who holds GPU memory now, as process trees",
        description="Show which processes hold GPU memory (and /dev/nvidia* descriptors) now, "
        "as process trees; orphans and descriptor holders are flagged. Exit 0, also without "
        "a GPU (it says so); 2 on bad arguments.",
    )
    add_options(snapshot, SNAPSHOT)
    run = commands.add_parser(
        "run",
        help="run an unmodified program with the tracker around its process tree; each "
        "DataLoader iteration is an epoch of its loader",
        description="Run CMD unmodified. Each DataLoader iteration in a Python process of the "
        "run (children and torchrun ranks included) is an epoch of that loader, labelled by "
        "the file:line of your code that made it; the process tree is watched from outside "
        "too (orphans, survivors, GPU memory of every process). The report goes to standard "
        "error when the program ends, however it ends. Exit status: the program's (130 on "
        "Ctrl-C); 1 with --fail-on-leak and a leak; 2 bad usage; 127/126 command not found / "
        "not executable.",
        usage="leakcheck run [options] -- CMD [ARG ...]",
    )
    add_options(run, RUN)
    run.add_argument(
        "program",  # not "command": the subcommand is args.command
        nargs=argparse.REMAINDER,
        metavar="-- CMD ...",
        help="the program and its arguments, after --",
    )
    explain = commands.add_parser(
        "explain",
        help="the whole story of a rule: what it finds, why, and every fix",
        description="Tell what a rule of leakcheck's findings means, its causes and every "
        "fix. Without RULE, list the rules. Exit 0; 2 for an unknown rule.",
    )
    explain.add_argument("rule", nargs="?", metavar="RULE", help="a rule's name")
    return parser


def run_explain_command(rule: str | None, out: TextIO, err: TextIO) -> int:
    """``leakcheck explain [RULE]``: a rule's story, or the list of rules (2: unknown rule)."""
    from leakcheck.judge.stories import STORIES, headline

    text = STORIES.get(rule) if rule is not None else None
    if text is not None:
        return emit(out, text, f"{_PROG} explain", flush=True) or EXIT_CLEAN
    if rule is not None:  # one line, the rules' names its list
        err.write(f"{_PROG} explain: unknown rule {rule!r}; the rules are: {', '.join(STORIES)}\n")
        return EXIT_USAGE
    width = max(len(name) for name in STORIES)
    lines = ["leakcheck's rules (leakcheck explain RULE tells one):"]
    lines.extend(f"  {name.ljust(width)}  {headline(name)}" for name in STORIES)
    return emit(out, "\n".join(lines) + "\n", f"{_PROG} explain", flush=True) or EXIT_CLEAN


# --------------------------------------------------------------------------- sweep


def default_workers() -> tuple[int, ...]:
    """``0,4,8``, or ``0,N,2N`` where N < 4 CPUs are usable (more would only queue)."""
    cpus = _usable_cpus()
    return (0, 4, 8) if cpus >= 4 else (0, cpus, 2 * cpus)


def worker_bound() -> tuple[int, str]:
    """The most workers a sweep starts without ``--max-workers``, and why.

    ``WORKERS_PER_CPU`` per usable CPU, or the room RLIMIT_NPROC leaves where that is less.
    """
    import resource

    cpus = _usable_cpus()
    bound = (cpus * WORKERS_PER_CPU, f"{cpus} CPUs x {WORKERS_PER_CPU}")
    # RLIMIT_NPROC caps the processes and threads of the real user ID, whatever runs them
    # already included; the kernel does not apply it to user ID 0.
    limit, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if limit == resource.RLIM_INFINITY or limit < 0 or os.getuid() == 0:
        return bound
    running = _tasks_of_user(os.getuid())
    if limit - running >= bound[0]:
        return bound
    return max(limit - running, 0), (
        f"RLIMIT_NPROC {limit} minus {running} processes and threads this user runs"
    )


def _usable_cpus() -> int:
    # The CPUs this process may run on (taskset, cpusets), as torch counts them for its warning.
    return max(len(os.sched_getaffinity(0)), 1)


def _tasks_of_user(uid: int) -> int:
    """Threads (what RLIMIT_NPROC counts) of the processes whose real user ID is ``uid``."""
    import psutil

    count = 0
    for process in psutil.process_iter(["uids", "num_threads"]):  # skips those that exit
        uids, threads = process.info["uids"], process.info["num_threads"]
        if uids is not None and uids.real == uid:
            count += threads or 1
    return count


def resolve_sweep(args: argparse.Namespace) -> tuple[SweepOptions, WorkloadSpec | None]:
    """Every ``sweep`` option checked in one place (a ``UsageError`` names the bad one).

    The workload is None with ``--loader``; ``--json`` and ``--plot`` are checked here too.
    """
    from leakcheck.commands.sweep import SweepOptions
    from leakcheck.commands.workload import FAILURES, HANG_AFTER_S, WorkloadSpec

    if args.loader is not None:  # said before any value of these is checked
        # --persistent: the loader's own persistent_workers decides; it would only mislabel it.
        for option in ("--scenario", "--start-method", "--batches", "--persistent"):
            if getattr(args, option[2:].replace("-", "_")) not in (None, False):
                raise UsageError(
                    f"{option}: applies to the built-in workload only, not with --loader"
                )
    given = option_values(args, _sweep_options())
    workers = given["--workers"] or default_workers()
    allowed = given["--max-workers"]
    if allowed is not None and max(workers) > allowed:
        raise UsageError(
            f"--workers: {max(workers)} workers is more than --max-workers {allowed} allows"
        )
    if allowed is None and max(workers) > (bound := worker_bound())[0]:
        raise UsageError(
            f"--workers: {max(workers)} workers is more than this machine should start (at most "
            f"{bound[0]}: {bound[1]}); pass --max-workers N to allow more"
        )
    shared = shared_options(given)
    output_paths(args.json, args.plot)
    workload = None
    if args.loader is not None:
        _split_loader(args.loader)  # the format is checked now; importing waits for the run
    else:
        workload = WorkloadSpec(
            scenario=_or(given["--scenario"], WorkloadSpec.scenario),
            batches=_or(given["--batches"], WorkloadSpec.batches),
            start_method=_or(given["--start-method"], WorkloadSpec.start_method),
            persistent=args.persistent,
            device_index=shared["device_index"] or 0,
        )
    options = SweepOptions(
        workers=workers,
        persistent=args.persistent or (workload is not None and workload.persistent_workers),
        cooldown_temp_c=given["--cooldown-temp"],
        teardown=not args.no_teardown,
        hang_after_s=HANG_AFTER_S if workload and workload.scenario == "hang" else 0.0,
        judge_failures=workload is not None and workload.scenario in FAILURES,
        epochs=_or(given["--epochs"], SweepOptions.epochs),
        cooldown_timeout_s=_or(given["--cooldown-timeout"], SweepOptions.cooldown_timeout_s),
        **shared,
    )
    return options, workload


def _or(value: _T | None, default: _T) -> _T:
    # An option not given takes its dataclass field's default.
    return default if value is None else value


def _split_loader(spec: str) -> tuple[str, str]:
    module, sep, factory = spec.rpartition(":")
    if not sep or not module.strip() or not factory.isidentifier():
        raise UsageError(
            f"--loader: expected MODULE:FACTORY or path/to/file.py:FACTORY, got {spec!r}"
        )
    return module, factory


def load_factory(spec: str) -> Callable[[int], Iterable[Any]]:
    """FACTORY of ``MODULE:FACTORY`` or ``path/to/file.py:FACTORY`` (else a ``UsageError``).

    A file is imported under its own name with its folder on ``sys.path``: spawned workers
    import what it defines.
    """
    import importlib

    module_name, factory_name = _split_loader(spec)
    try:
        if module_name.endswith(".py") or os.sep in module_name:
            module = _import_file(module_name)
        else:
            # As `python -m` does: modules of the current folder can be named.
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except (UsageError, KeyboardInterrupt):
        raise
    except BaseException as exc:  # SyntaxError, SystemExit in an import... all one line
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
    import importlib
    import importlib.util

    if not os.path.isfile(path):
        what = "a folder" if os.path.isdir(path) else "no such file"
        raise UsageError(f"--loader: expected an existing file.py, got {path!r} ({what})")
    path = os.path.abspath(path)
    folder, base = os.path.split(path)
    name = os.path.splitext(base)[0]
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module = sys.modules.get(name)
    if module is None and name.isidentifier():
        module = importlib.import_module(name)
    where = getattr(module, "__file__", None)
    if where is not None and os.path.realpath(where) == os.path.realpath(path):
        return module
    # The name is another module's: load the file under a private name (spawned workers
    # will not find classes defined in it by name, but the factory still runs).
    unique = f"leakcheck_user_loader_{abs(hash(path))}"
    file_spec = importlib.util.spec_from_file_location(unique, path)
    if file_spec is None or file_spec.loader is None:
        raise UsageError(f"--loader: cannot import {path!r} as a Python file")
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[unique] = module
    file_spec.loader.exec_module(module)
    return module


def run_sweep_command(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``leakcheck sweep``: run, print, write the outputs, pick the exit status."""
    from dataclasses import replace

    from leakcheck.commands.progress import Progress
    from leakcheck.commands.sweep import LoaderError, run_sweep
    from leakcheck.commands.workload import builtin_factory, describe, stage
    from leakcheck.core.files import write_json
    from leakcheck.judge.plot import plot_sweep
    from leakcheck.observe import nvml

    progress = None
    try:
        options, workload = resolve_sweep(args)
        gpu = nvml.availability()
        check_device(options.device_index, gpu, needs_gpu=True)
        if workload is None:
            factory, description = load_factory(args.loader), f"loader {args.loader}"
        else:
            workload = replace(workload, gpu=gpu[0])
            factory, description = builtin_factory(workload), describe(workload)
        progress = Progress(len(options.workers) * options.epochs, stream=err)
        with stage(workload):  # NOTE [failure stagings] in workload.py
            result = run_sweep(options, factory, loader=description, progress=progress, gpu=gpu)
    except LoaderError as exc:
        assert progress is not None  # only the sweep raises it
        progress.close()
        where = f"--loader {args.loader}" if args.loader else "built-in workload"
        raise UsageError(f"{where}: {exc}") from None
    except KeyboardInterrupt:  # importing a --loader module can take a while, too
        if progress is not None:
            progress.close()
        err.write(f"{_PROG} sweep: interrupted; nothing written\n")
        return EXIT_INTERRUPTED
    outputs = (
        ("--json", args.json, lambda p: write_json(p, result.to_dict())),
        ("--plot", args.plot, lambda p: plot_sweep(result, p)),
    )
    return finish(f"{_PROG} sweep", result, out, err, outputs, EXIT_CLEAN, args.fail_on_leak)


# --------------------------------------------------------------------------- snapshot

_CLEAR_SCREEN = "\x1b[H\x1b[2J"  # ANSI: cursor home, erase the screen


def _plain_snapshot_args(tokens: Sequence[str]) -> SimpleNamespace | None:
    """A plain ``snapshot`` line read without argparse (NOTE [lean start]), else None."""
    takes_value = {flag: metavar is not None for flag, metavar, *_ in SNAPSHOT}
    unset = {flag[2:]: None if takes else False for flag, takes in takes_value.items()}
    args = SimpleNamespace(command="snapshot", **unset)
    rest = iter(tokens)
    for token in rest:
        name, equals, value = token.partition("=")
        takes = takes_value.get(name)
        if takes is None or (equals and not takes):
            return None
        if takes:
            value = value if equals else next(rest, "-")  # none left: the full parser's error
            if value.startswith("-"):
                return None
        setattr(args, name[2:], value if takes else True)
    return args


def run_snapshot_command(args: argparse.Namespace | SimpleNamespace, out: TextIO) -> int:
    """``leakcheck snapshot``: print who holds GPU memory now (and a job's lineage)."""
    from leakcheck.observe import procs

    given = option_values(args, SNAPSHOT)
    period, pid, root = given["--watch"], given["--pid"], None
    if pid is not None:
        root = procs.root_key(pid, "--pid")
    if period is None:
        text = _snapshot_text(pid, bool(args.telemetry), as_json=args.json, indent=2)
        ended = emit(out, text + "\n", f"{_PROG} snapshot")
        return EXIT_CLEAN if ended is None else ended
    return _watch(root, period, bool(args.telemetry), as_json=args.json, out=out)


def _snapshot_text(
    root_pid: int | None, telemetry: bool, *, as_json: bool, indent: int | None
) -> str:
    from leakcheck.observe import nvml

    nvml.start_in_background()  # while the snapshot's modules load (NOTE [overlapped start])
    from leakcheck.observe.snapshot import take_snapshot

    snapshot = take_snapshot(root_pid=root_pid, telemetry=telemetry)
    if not as_json:
        return snapshot.format()
    import json

    return json.dumps(snapshot.to_dict(), indent=indent)


def _watch(
    root: ProcessKey | None, period: float, telemetry: bool, *, as_json: bool, out: TextIO
) -> int:
    """Frames every ``period`` seconds until Ctrl-C, or until ``root`` (an identity) exits."""
    import time

    from leakcheck.observe import procs

    on_terminal = out.isatty()
    line = f"{_PROG} snapshot --watch {period:g}"
    root_pid = root.pid if root is not None else None
    next_frame = time.monotonic()
    try:
        while True:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            if root is not None and not procs.is_alive(root):
                sys.stderr.write(
                    f"{line}: PID {root.pid} exited (seen gone at {stamp}); its tree can no "
                    "longer be told from other processes, so the watch ends\n"
                )
                return EXIT_CLEAN
            indent = 2 if on_terminal else None
            text = _snapshot_text(root_pid, telemetry, as_json=as_json, indent=indent)
            if on_terminal:
                frame = f"{_CLEAR_SCREEN}{line}  {stamp}  (Ctrl-C stops)\n{text}\n"
            else:
                frame = f"{text}\n" if as_json else f"--- {stamp} ---\n{text}\n"
            ended = emit(out, frame, f"{_PROG} snapshot", flush=True)
            if ended is not None:
                return ended
            # A fixed rhythm, not a fixed pause: a slow snapshot does not stretch the period.
            next_frame = max(next_frame + period, time.monotonic())
            time.sleep(max(0.0, next_frame - time.monotonic()))
    except KeyboardInterrupt:
        return EXIT_CLEAN


# --------------------------------------------------------------------------- run


def torchrun_command(command: list[str], nproc: str) -> list[str]:
    """``SCRIPT``, ``python SCRIPT`` or ``python -m MODULE`` under torchrun with ``nproc`` ranks."""
    import importlib.util

    text = _NPROC(nproc, "--nproc-per-node")
    rest = list(command)
    name = os.path.basename(rest[0]) if rest else ""
    if name.startswith("python") and all(c.isdigit() or c == "." for c in name[6:]):
        rest = rest[1:]
    module = rest[:1] == ["-m"]
    target = rest[1] if module and len(rest) > 1 else (rest[0] if rest and not module else "")
    if os.path.basename(target) in _LAUNCHERS or target in _LAUNCHERS:
        raise UsageError(
            f"--nproc-per-node: expected a training script after --, got the launcher "
            f"{target!r} (wrap it without --nproc-per-node: leakcheck run -- torchrun ...)"
        )
    if not target or target.startswith("-"):
        raise UsageError(
            "--nproc-per-node: expected a script after --, such as: leakcheck run "
            f"--nproc-per-node 2 -- train.py, got {' '.join(command)!r}"
        )
    if importlib.util.find_spec("torch") is None:
        raise UsageError(
            f"--nproc-per-node: expected torch (torch.distributed.run) in {sys.executable}, "
            f"got {nproc!r} without it"
        )
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*launcher, "--nproc-per-node", text, *rest]


def run_run_command(args: argparse.Namespace, err: TextIO) -> int:
    """``leakcheck run``: run the program, report to ``err`` (not the program's stdout)."""
    from leakcheck.commands.launcher import LaunchError, RunOptions, run_program
    from leakcheck.core.files import write_json
    from leakcheck.judge.plot import plot_reports
    from leakcheck.observe import nvml

    command = args.program[1:] if args.program[:1] == ["--"] else list(args.program)
    if not command:
        raise UsageError("expected a command after --, such as: leakcheck run -- python train.py")
    if args.nproc_per_node is not None:
        command = torchrun_command(command, args.nproc_per_node)
    json_path, plot_path = output_paths(args.json, args.plot)
    given = option_values(args, RUN)
    shared = shared_options(given)
    if shared["device_index"] is not None:
        check_device(shared["device_index"], nvml.availability(), needs_gpu=False)
    options = RunOptions(
        teardown=args.teardown,
        rollup_share=given["--rollup-share"],
        hang_after_s=_or(given["--hang-after"], RunOptions.hang_after_s),
        **shared,
    )
    try:
        result = run_program(command, options)
    except LaunchError as error:
        err.write(f"{_PROG} run: {error}\n")
        return error.exit_status
    drawn = [(loader.label, loader.report) for loader in result.loaders if loader.report]
    if not drawn and result.tree is not None:
        drawn = [("the program's process tree", result.tree)]
    outputs = (
        ("--json", json_path, lambda p: write_json(p, result.to_dict())),
        ("--plot", plot_path, lambda p: plot_reports(drawn, p)),
    )
    status = result.program_status
    return finish(f"{_PROG} run", result, err, err, outputs, status, args.fail_on_leak)


# --------------------------------------------------------------------------- entry points


def command() -> NoReturn:
    """The ``leakcheck`` executable: ``main()``, then exit (a snapshot: NOTE [quick exit])."""
    if sys.argv[1:2] != ["snapshot"]:
        sys.exit(main())
    try:
        status = main()
    except KeyboardInterrupt:
        status = EXIT_INTERRUPTED  # Ctrl-C: nothing more is written
    ended = emit(sys.stdout, "", f"{_PROG} snapshot", flush=True)  # what is still buffered
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.flush()
    os._exit(status if ended in (None, EXIT_CLEAN) else ended)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``leakcheck`` and ``python -m leakcheck``; returns the exit status."""
    tokens = list(sys.argv[1:] if argv is None else argv)
    name = tokens[0] if tokens[:1] == ["snapshot"] else None
    for stream in ("stdout", "stderr"):
        if getattr(sys, stream) is None:  # its descriptor closed (`2>&-`): written to nowhere
            setattr(sys, stream, open(os.devnull, "w"))  # noqa: SIM115 - open to the end
    try:
        plain = _plain_snapshot_args(tokens[1:]) if name else None
        if plain is not None:
            return run_snapshot_command(plain, sys.stdout)
        try:
            args, extra = build_parser().parse_known_args(tokens)
        except SystemExit as exc:  # the parser's own one-line error, --help or --version
            return exc.code if isinstance(exc.code, int) else EXIT_USAGE
        name = args.command
        if extra:  # named by the subcommand that got them, not by the top-level parser
            raise UsageError(f"unrecognized arguments: {' '.join(extra)}")
        if name == "sweep":
            return run_sweep_command(args, sys.stdout, sys.stderr)
        if name == "snapshot":
            return run_snapshot_command(args, sys.stdout)
        if name == "run":
            return run_run_command(args, sys.stderr)
        if name == "explain":
            return run_explain_command(args.rule, sys.stdout, sys.stderr)
        raise UsageError(
            "expected a command: sweep, snapshot, run or explain (see leakcheck --help)"
        )
    except UsageError as exc:
        sys.stderr.write(f"{_PROG}{f' {name}' if name else ''}: {exc}\n")
        return EXIT_USAGE
