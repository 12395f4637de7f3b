"""``leakcheck run [options] -- CMD ...``: the command line of the run engine (launcher.py).

Every option is checked before anything starts (a bad one: one line, exit 2). The report goes
to standard error: the program's standard output stays its own. Exit status: the program's
(128 + N for signal N; NOTE [run signals] in launcher.py); 1 instead of 0 with
``--fail-on-leak`` and a leak; 2 when ``--json`` or ``--plot`` failed after a successful
program; 127 (126) when the command is not found (cannot be executed).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import Any, TextIO

from leakcheck.commands.common import (
    EXIT_LEAK,
    EXIT_USAGE,
    SHARED,
    add_options,
    check_device,
    output_paths,
    save_output,
    shared_options,
)
from leakcheck.core.errors import UsageError
from leakcheck.core.files import write_json
from leakcheck.core.options import parse_share_option
from leakcheck.core.units import parse_duration

__all__ = ["add_run_parser", "run_command", "torchrun_command"]

_LAUNCHERS = ("torchrun", "torch.distributed.run", "torch.distributed.launch")


def add_run_parser(commands: Any) -> argparse.ArgumentParser:
    """Add ``run`` to ``cli.py``'s subcommands (``commands`` is its subparsers action)."""
    run: argparse.ArgumentParser = commands.add_parser(
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
    add_options(
        run,
        (
            *SHARED,
            (
                "--hang-after",
                "SECONDS",
                "seconds a loop may wait for a batch before its process's and workers' stacks "
                "are written to stderr and the report (default 120; 0: off)",
            ),
            (
                "--rollup-share",
                "SHARE",
                "share of the time USS reads (smaps_rollup, which show copy-on-read) may take; "
                "1 reads at every epoch end (default 0.001)",
            ),
            (
                "--nproc-per-node",
                "N",
                "run the script under torchrun (--standalone) with N ranks; the report gives a "
                "verdict per rank and for the job (own torchrun options: leakcheck run -- "
                "torchrun)",
            ),
            (
                "--teardown",
                None,
                "workers release their CUDA context at exit and die with their parent",
            ),
        ),
    )
    run.add_argument(
        "program",  # not "command": cli.py's subcommand is args.command
        nargs=argparse.REMAINDER,
        metavar="-- CMD ...",
        help="the program and its arguments, after --",
    )
    return run


def torchrun_command(command: list[str], nproc: str) -> list[str]:
    """``SCRIPT``, ``python SCRIPT`` or ``python -m MODULE`` under torchrun with ``nproc`` ranks.

    Raises:
        UsageError: ``nproc`` is not a count (or auto, cpu, gpu), or no script follows.

    """
    text = str(nproc).strip()
    count = text.isascii() and text.isdigit() and 1 <= int(text) <= 4096
    if not (count or text in ("auto", "cpu", "gpu")):
        raise UsageError(
            "--nproc-per-node: expected a number of ranks from 1 to 4096 such as 2 "
            f"(or auto, cpu, gpu), got {nproc!r}"
        )
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


def run_command(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``leakcheck run``: run the program, report to ``err``, write ``--json``; the status."""
    from leakcheck.commands.launcher import LaunchError, RunOptions, run_program
    from leakcheck.judge.plot import plot_reports
    from leakcheck.observe import nvml

    command = list(args.program)
    if command[:1] == ["--"]:
        command = command[1:]
    try:
        if not command:
            raise UsageError(
                "expected a command after --, such as: leakcheck run -- python train.py"
            )
        if args.nproc_per_node is not None:
            command = torchrun_command(command, args.nproc_per_node)
        json_path, plot_path = output_paths(args.json, args.plot)
        shared = shared_options(args)
        if shared["device_index"] is not None:
            check_device(shared["device_index"], nvml.availability(), needs_gpu=False)
        hang_after = 120 if args.hang_after is None else args.hang_after
        options = RunOptions(
            teardown=bool(args.teardown),
            rollup_share=None
            if args.rollup_share is None
            else parse_share_option(args.rollup_share, "--rollup-share"),
            hang_after_s=parse_duration(hang_after, "--hang-after"),
            **shared,
        )
        result = run_program(command, options)
    except (UsageError, LaunchError) as error:
        err.write(f"leakcheck run: {error}\n")
        return error.exit_status if isinstance(error, LaunchError) else EXIT_USAGE
    err.write(result.format() + "\n")
    err.flush()
    status = result.program_status
    drawn = [(loader.label, loader.report) for loader in result.loaders if loader.report]
    if not drawn and result.tree is not None:
        drawn = [("the program's process tree", result.tree)]
    for option, path, write in (
        ("--json", json_path, lambda p: write_json(p, result.to_dict())),
        ("--plot", plot_path, lambda p: plot_reports(drawn, p)),
    ):
        if path is not None and not save_output("leakcheck run", option, path, write, err):
            status = EXIT_USAGE if status == 0 else status
    if status == 0 and args.fail_on_leak and result.leak_count:
        return EXIT_LEAK
    return status
