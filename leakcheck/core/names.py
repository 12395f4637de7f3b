"""What a process is, in the words people use for it: the one place that names a process.

NOTE [process names]: decisions read a process's whole command line (``roles``); people read
a name: what an interpreter runs (``train.py --lr 0.1``, ``python -m torch.distributed.run``,
``python -c "import time"``), else the program (``sleep 60``); multiprocessing's own processes
by what they are (``resource tracker``); a loader's worker as ``worker 3 of train.py:42``.
Every report, table and snapshot shows a process through ``process_name`` (or ``culprit``,
which adds its role, rank and PID), cut by the one shortener, whatever the width.
"""

from __future__ import annotations

import os
import re
import signal

from leakcheck.core.roles import runtime_helper_name

NAME_WIDTH = 40
"""Characters a process's name takes in a finding (its role and PID come on top)."""
ELLIPSIS = "\u2026"
TIMES = "\u00d7"  # between a count and what it counts

_INTERPRETER = re.compile(r"^(?:python|pypy)\d*(?:\.\d+)?[a-z]?$")
_LINE_BREAKS = re.compile(r"[ \t]*(?:[\r\n][ \t]*)+")
# Interpreter options that take the next argument (`-X importtime`, `-W error`).
_OPTIONS_WITH_VALUE = frozenset(("-X", "-W", "--check-hash-based-pycs"))


def signal_name(number: int) -> str:
    """``SIGKILL``; ``signal 64`` for a number Python does not name."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def shorten(text: str, width: int) -> str:
    """``text`` with its whitespace collapsed, cut to ``width`` characters with ``…``."""
    text = " ".join(text.split())
    return text if len(text) <= width else text[: max(width - 1, 1)].rstrip() + ELLIPSIS


def _python_target(args: list[str]) -> str:
    """What an interpreter runs, from the arguments after the interpreter itself."""
    index = 0
    while index < len(args):
        arg = args[index]
        # `-c CODE`, `-m MODULE`, with flags joined before them (`-Bc`) or the value after
        # them (`-mpytest`, as pytester starts it)
        joined = re.fullmatch(r"-[bBdEiIOPqsSuvx]*([cm])(.*)", arg)
        if joined is not None:
            rest = " ".join([joined.group(2), *args[index + 1 :]]).strip()
            if joined.group(1) == "c":  # a script's lines as one: `import os; print(1)`
                return f'python -c "{_LINE_BREAKS.sub("; ", rest)}"'
            return f"python -m {rest}".rstrip()
        if arg in _OPTIONS_WITH_VALUE:
            index += 2
            continue
        if arg == "-":
            return "python -"
        if not arg.startswith("-"):
            script = arg.rstrip("/")
            base = os.path.basename(script)
            if base == "__main__.py":  # a package run by its folder: name the package
                base = os.path.basename(os.path.dirname(script)) or base
            return " ".join([base, *args[index + 1 :]])
        index += 1
    return "python"


def process_name(cmdline: str | None, *, width: int = NAME_WIDTH, empty: str = "?") -> str:
    """Name a process by what it runs (NOTE [process names]), at most ``width`` characters."""
    # Split on spaces only: a `python -c` script keeps its line breaks until it is named.
    args = [arg for arg in (cmdline or "").split(" ") if arg.strip()]
    if not args:
        return empty
    helper = runtime_helper_name(cmdline or "")
    if helper is not None:
        return shorten(helper, width)
    program = os.path.basename(args[0]) or args[0]
    if _INTERPRETER.match(program):
        name = " ".join(_python_target(args[1:]).split())
        if len(name) > width and name.startswith('python -c "'):
            return shorten(name[:-1], width - 1) + '"'  # keeps its closing quote
        return shorten(name, width)
    return shorten(" ".join([program, *args[1:]]), width)


def culprits(
    role: str | None,
    pids: int | list[int] | None,
    cmdline: str | None,
    *,
    rank: int | None = None,
    rule: str | None = None,
    worker_id: int | None = None,
    loader: str | None = None,
    width: int = NAME_WIDTH,
) -> str:
    """Processes as a report names them: ``rank 1 orphan sleep 60 (PID 11)``.

    A worker by its loader, ``worker 3 of train.py:42 (PID 7)``, else ``spawn worker 3``.
    Several of one name: ``6 \u00d7 sleep 60 (PIDs 11, 12, 13, \u2026)``, the first three
    PIDs. The role is left out where the rule already says it (an orphan's) or the name does.
    """
    pids = [pids] if isinstance(pids, int) else pids or []
    if role == "worker":  # by its loader, else its start method or its parent's program
        number = f" {worker_id}" if worker_id is not None and len(pids) == 1 else ""
        kind = runtime_helper_name(cmdline or "")
        if loader:
            name = shorten(f"worker{number} of {loader}", width)
        elif kind in ("spawn worker", "forkserver"):
            name = f"{'forkserver worker' if kind == 'forkserver' else kind}{number}"
        else:
            program = process_name(cmdline, width=width)
            if not program.startswith("python"):
                program = program.split()[0]  # a forked worker runs its parent's script
            name = shorten(f"worker{number} of {program}", width)
    else:
        name = process_name(cmdline, width=width)
        if role and role != rule:
            name = f"{role} {name}"
    if rank is not None:
        name = f"rank {rank} {name}"
    if len(pids) > 1:
        listed = ", ".join(str(pid) for pid in pids[:3])
        more = f", {ELLIPSIS}" if len(pids) > 3 else ""
        return f"{len(pids)} {TIMES} {name} (PIDs {listed}{more})"
    return f"{name} (PID {pids[0]})" if pids else name


culprit = culprits  # one process: culprit("orphan", 11, "sleep 60")
