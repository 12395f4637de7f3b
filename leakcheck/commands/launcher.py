"""The engine of ``leakcheck run``: an unmodified program, tracked inside and out.

``run_program(command, options)`` starts the command with the run shim on its
``PYTHONPATH`` (NOTE [run shim] in ``_shim/sitecustomize.py``), so that each DataLoader the
program's Python processes iterate is tracked per epoch by a tracker in that process (NOTE
[run instrumentation] in instrument.py); and it watches the program's whole process tree
from outside with a ``Tracker`` of its own whose root is the program. The outside view sees
what no tracker inside can: processes that outlive the program (orphans, survivors), the
GPU memory of every process of the tree, non-Python children. When the program has ended it
reads the loaders' reports from the run folder and returns one ``RunResult``.

NOTE [run tag]: the outside tracker must find the program's descendants after they were
reparented away (a worker's child, once the worker exited; everything, once the program
exited), and the session tag is how trackers do it (NOTE [session tag] in procs.py). But the
outside tracker cannot export ``LEAKCHECK_SESSION`` to a process it did not start itself
after its own start, and the trackers inside the program export their own
``LEAKCHECK_SESSION`` to the workers they start (each loader judges its own workers by it),
so that variable cannot carry the run's tag. The run folder's variable can:
``LEAKCHECK_RUN=<run folder>`` is set in the program's initial environment by the launcher,
is inherited by every process the program starts (exec'd ones in their initial
environment, forked ones by sharing the program's), and nothing inside ever changes it. The
outside tracker is given it as its ``session_tag`` (``Tracker(session_tag=(NAME, VALUE))``):
its tag scans and its adoption of unknown GPU processes look for that variable and value
instead of its own session id. A process started with an environment of its own (``env=``
without the variable) is found only through the lineage, as under any tracker.

NOTE [run signals]: Ctrl-C in a terminal reaches every process of the foreground process
group, the program included; ``kill -INT <leakcheck>`` reaches only the launcher. The
launcher forwards what the program would otherwise miss, and only that: it blocks SIGINT,
SIGTERM, SIGHUP and SIGCHLD in its own thread (the program gets its mask back before it
execs), waits for them with ``sigtimedwait``, and forwards a signal that a process sent
(``si_code`` <= 0) but not one the kernel sent on the terminal's behalf: a second SIGINT
could break the program's own cleanup, its loaders' reports included. A signal sent to the
whole process group (``kill -INT -PGID``) arrives as one sent to the launcher alone (both say
``SI_USER``), so the program gets it twice: a known limit. SIGCHLD ends the wait
when the program exits; ``waitid(WNOWAIT)`` leaves it a zombie until the outside tracker is
closed, so its PID cannot be reused by another process while the tree is still read. Where
this cannot be done (not the main thread; no ``sigtimedwait``), the launcher just waits
and a Ctrl-C forwarded by the terminal still reaches the program.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from leakcheck.adapters.distributed import read_rank_reports
from leakcheck.commands.instrument import RUN_ENV, ShimOptions, read_records, write_options
from leakcheck.core.errors import LeakCheckError
from leakcheck.core.files import environment
from leakcheck.core.model import (
    MIB,
    EndReason,
    Finding,
    ProcessEpoch,
    ProcessKey,
    RankInfo,
    Timeline,
)
from leakcheck.core.names import process_name
from leakcheck.core.ranks import rank_label
from leakcheck.core.units import format_size, plural
from leakcheck.judge.job import (
    JobReport,
    RankReport,
    finding_identity,
    judge_job,
    rank_info_from_dict,
)
from leakcheck.judge.report import (
    SCHEMA_VERSION,
    Report,
    build_report,
    combined_verdict,
    gpu_unchecked,
    report_from_dict,
)
from leakcheck.observe import procs
from leakcheck.track.tracker import Tracker

__all__ = [
    "RUN_SCHEMA_VERSION",
    "LaunchError",
    "LoaderResult",
    "RunOptions",
    "RunResult",
    "child_environment",
    "run_program",
    "shim_folder",
]

RUN_SCHEMA_VERSION = 2
"""Version of ``RunResult.to_dict``'s layout; bumped on any change of it. 2 added each
loader's ``rank`` and the distributed ``job`` (None outside a torchrun job)."""

_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_WAIT_TICK_S = 0.5
_MAILBOX_PREFIX = "leakcheck-mailbox-"


class LaunchError(LeakCheckError):
    """The command could not be started; ``exit_status`` is the shell's (126 or 127)."""

    def __init__(self, message: str, exit_status: int) -> None:
        super().__init__(message)
        self.exit_status = exit_status


@dataclass(frozen=True)
class RunOptions:
    """How to track the program.

    Attributes:
        tolerance_bytes: Growth or residual below this is noise.
        grace_s: How long a process born in an epoch may outlive it (the program's run is
            the outside tracker's one epoch).
        interval_s: Sampling interval, inside and outside.
        teardown: Install the teardown policy in the loaders' workers.
        device_index: The one device to watch (None: all).
        rollup_share: Share of time the loaders' trackers may spend on USS reads (None:
            ``Tracker``'s default).
        copy_tolerance_bytes: What each forked worker may copy of its parent's memory
            (the copy-on-read rule).

    """

    tolerance_bytes: int = 16 * MIB
    grace_s: float = 2.0
    interval_s: float = 0.05
    teardown: bool = False
    device_index: int | None = None
    rollup_share: float | None = None
    copy_tolerance_bytes: int = 64 * MIB

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return asdict(self)

    def shim(self) -> ShimOptions:
        """What the trackers inside the program use."""
        return ShimOptions(
            tolerance_bytes=self.tolerance_bytes,
            grace_s=self.grace_s,
            interval_s=self.interval_s,
            teardown=self.teardown,
            devices=None if self.device_index is None else (self.device_index,),
            rollup_share=self.rollup_share,
            copy_tolerance_bytes=self.copy_tolerance_bytes,
        )


@dataclass(frozen=True)
class LoaderResult:
    """One loader of the run: its label, its process, its report.

    Attributes:
        label: Where the program made it (``file:line``, ``via LIBRARY`` where a library
            made it for the program's line, ``#2`` for a second one alive at once from the
            same site).
        pid: The process that iterated it.
        argv: That process's ``sys.argv``.
        report: Its judged report (None when it never came).
        cost: What its tracker cost until the program's exit began (``TrackerCost``).
        exit_s: Seconds its tracker took at exit (close, report, write).
        missing: Why there is no report.
        rank: The distributed rank of its process (None outside a distributed job; NOTE
            [process rank] in instrument.py).

    """

    label: str
    pid: int
    argv: tuple[str, ...] = ()
    report: Report | None = None
    cost: Mapping[str, Any] | None = None
    exit_s: float | None = None
    missing: str | None = None
    rank: RankInfo | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {
            "label": self.label,
            "pid": self.pid,
            "argv": list(self.argv),
            "report": self.report.to_dict() if self.report is not None else None,
            "cost": dict(self.cost) if self.cost is not None else None,
            "exit_s": self.exit_s,
            "missing": self.missing,
            "rank": asdict(self.rank) if self.rank is not None else None,
        }


@dataclass(frozen=True)
class RunResult:
    """Everything ``leakcheck run`` observed and judged.

    Attributes:
        command: The command as given.
        options: How it was tracked.
        pid: The program's PID.
        exit_code: Its exit code (None when a signal ended it).
        signal_number: The signal that ended it, if one did.
        interrupted: ``leakcheck run`` got SIGINT while the program ran.
        wall_s: From the start to the program's end.
        tree: The outside tracker's judged report (None if it failed).
        tree_cost: What the outside tracker cost (``TrackerCost``).
        loaders: Each loader's result, in the order their trackers started.
        failures: Lines about what leakcheck itself could not do.
        started_unix_s: When the program started.
        gpu_reason: Why GPU memory was not checked (empty when it was).
        environment: Versions and machine, for the record.
        rank_reports: What ranks wrote with ``leakcheck.gather_reports`` into the run
            folder (their ``watch()``ed loaders' reports).

    """

    command: tuple[str, ...]
    options: RunOptions
    pid: int
    exit_code: int | None
    signal_number: int | None
    interrupted: bool
    wall_s: float
    tree: Report | None
    tree_cost: Mapping[str, Any] | None
    loaders: tuple[LoaderResult, ...]
    failures: tuple[str, ...] = ()
    started_unix_s: float = 0.0
    gpu_reason: str = ""
    environment: Mapping[str, Any] = field(default_factory=dict)
    rank_reports: tuple[RankReport, ...] = ()

    @property
    def program_status(self) -> int:
        """The program's exit status as a shell gives it (128 + N for signal N)."""
        if self.signal_number is not None:
            return 128 + self.signal_number
        return self.exit_code if self.exit_code is not None else 1

    @property
    def leaks(self) -> list[Finding]:
        """Every leak, each leaking process once (a loader's before the tree's)."""
        found: list[Finding] = []
        seen: set[tuple[object, ...]] = set()
        for report in self._reports():
            for finding in report.leaks:
                key = _identity(finding)
                if key not in seen:
                    seen.add(key)
                    found.append(finding)
        return found

    @property
    def leak_count(self) -> int:
        """Leaks over the loaders and the tree, each leaking process counted once."""
        return len(self.leaks)

    @property
    def verdict(self) -> str:
        """``leak``, ``blind`` (a report could not attribute) or ``clean``."""
        return combined_verdict(report.verdict for report in self._reports())

    def _reports(self) -> list[Report]:
        reports = [loader.report for loader in self.loaders if loader.report is not None]
        reports += [report for entry in self.rank_reports for report in entry.reports]
        return reports + ([self.tree] if self.tree is not None else [])

    @property
    def job(self) -> JobReport | None:
        """The distributed job's verdicts, per rank and overall; None outside a torchrun job.

        Each loader of a rank's process is a report of that rank; the tree's findings go to
        the rank their culprit carries; a rank the tree saw but that sent nothing (killed
        before its exit handlers ran) still gets a verdict.
        """
        return job_of(self.loaders, self.tree, self.rank_reports)

    def to_dict(self) -> dict[str, Any]:
        """Everything as JSON-able data, with ``schema`` and ``schema_version``."""
        return {
            "schema": "leakcheck.run",
            "schema_version": RUN_SCHEMA_VERSION,
            "report_schema_version": SCHEMA_VERSION,
            "command": list(self.command),
            "options": self.options.to_dict(),
            "started_unix_s": self.started_unix_s,
            "wall_s": self.wall_s,
            "program": {
                "pid": self.pid,
                "exit_code": self.exit_code,
                "signal": self.signal_number,
                "exit_status": self.program_status,
                "interrupted": self.interrupted,
            },
            "environment": dict(self.environment),
            "gpu": {"checked": not self.gpu_reason, "reason": self.gpu_reason},
            "verdict": self.verdict,
            "leak_count": self.leak_count,
            "loaders": [loader.to_dict() for loader in self.loaders],
            "job": job.to_dict() if (job := self.job) is not None else None,
            "tree": {
                "report": self.tree.to_dict() if self.tree is not None else None,
                "cost": dict(self.tree_cost) if self.tree_cost is not None else None,
            },
            "failures": list(self.failures),
        }

    def format(self) -> str:
        """The text report: the program, each loader's findings, then the tree's."""
        return format_run(self)


_identity = finding_identity


# --------------------------------------------------------------------------- text


def _program_line(result: RunResult) -> str:
    if result.signal_number is not None:
        try:
            name = signal.Signals(result.signal_number).name
        except ValueError:
            name = f"signal {result.signal_number}"
        how = f"was ended by {name}"
    else:
        how = f"exited with status {result.exit_code}"
    interrupted = " (interrupted)" if result.interrupted else ""
    return f"program PID {result.pid} {how}{interrupted} after {result.wall_s:.1f} s"


def format_run(result: RunResult) -> str:
    """Render a run as text (see ``RunResult.format``).

    Quiet where nothing is wrong: a clean run is its first line, a line per loader, one for
    the process tree and the verdict. Findings come under the loader (or the tree) that
    found them, a process named once; the thresholds are said where something was found.
    """
    options = result.options
    quiet = result.verdict == "clean" and not any(report.said for report in result._reports())
    command = process_name(" ".join(result.command))
    gpu = f"; {gpu_unchecked(result.gpu_reason)}" if result.gpu_reason else ""
    lines = [f"leakcheck run: {command}: {_program_line(result)}{gpu}"]
    if not quiet:
        lines.append(
            f"  tolerance {format_size(options.tolerance_bytes)}, grace {options.grace_s:g} s, "
            f"sampling every {options.interval_s * 1000:g} ms, "
            f"teardown {'on' if options.teardown else 'off'}"
        )
    gap = [] if quiet else [""]
    shown: set[tuple[object, ...]] = set()
    for loader in result.loaders:
        lines.extend(gap)
        lines.extend(_loader_lines(loader))
        if loader.report is not None:
            shown.update(_identity(f) for f in loader.report.leaks)
    if not result.loaders:
        lines.extend(gap)
        lines.append(
            "loaders: none tracked: no DataLoader iterated in a Python process of the run, each "
            "one watch()ed by the program, or PYTHONPATH ignored (-E, -I, -S)"
        )
    lines.extend(gap)
    lines.extend(_tree_lines(result, shown))
    for failure in result.failures:
        lines.append(f"  leakcheck itself: {failure}")
    job = result.job
    if job is not None:
        lines.extend(gap)
        lines.extend(job.format_lines(named=False))  # the loaders' lines name them
    lines.extend(gap)
    count = result.leak_count
    loaders = len(result.loaders)
    ranks = f", {len(job.ranks)} ranks" if job is not None else ""
    lines.append(
        f"leakcheck run: verdict {result.verdict}, {plural(count, 'leak')} "
        f"({plural(loaders, 'loader')}{ranks} and the process tree); "
        f"program exit status {result.program_status}"
    )
    return "\n".join(lines)


def _loader_lines(loader: LoaderResult) -> list[str]:
    report = loader.report
    who = f"{rank_label(loader.rank.rank if loader.rank else None)}PID {loader.pid}"
    if report is None:
        return [f"loader {loader.label} ({who}): no report: {loader.missing}"]
    epochs = report.epochs
    reasons = sorted({epoch.end_reason for epoch in epochs} - {"completed"})
    ended = f", not completed: {', '.join(reasons)}" if reasons else ""
    processes = plural(len(report.process_keys), "process", "processes")
    lines = [
        f"loader {loader.label} ({who}): {plural(len(epochs), 'epoch')}{ended}, "
        f"{processes}; verdict {report.verdict.upper()}"
    ]
    lines.extend(report.finding_lines(indent="  ", loader=loader.label))
    return lines


def _tree_lines(result: RunResult, shown: set[tuple[object, ...]]) -> list[str]:
    tree = result.tree
    head = f"process tree of PID {result.pid}, watched from outside"
    if tree is None:
        return [f"{head}: not tracked"]
    # What a loader blamed is left to it, also where the tree's words differ: a loader knows
    # its workers from their own reports, the tree only what its samples caught.
    repeated = [f for f in tree.findings if _identity(f) in shown]
    processes = plural(len(tree.process_keys), "process", "processes")
    line = f"{head} ({processes}): verdict {tree.verdict.upper()}"
    if repeated:
        line += f"; {plural(len(repeated), 'finding')} named above"
    lines = [line]
    lines.extend(tree.finding_lines([f for f in tree.findings if f not in repeated], indent="  "))
    return lines


# --------------------------------------------------------------------------- running


def shim_folder() -> str:
    """The folder put first on the program's ``PYTHONPATH`` (the run shim)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_shim")


def child_environment(environ: Mapping[str, str], folder: str) -> dict[str, str]:
    """The program's environment: the caller's, with the shim and the run's tag.

    ``PYTHONPATH`` gets the shim first and the caller's entries after it; ``LEAKCHECK_RUN``
    names the run folder (NOTE [run tag]). The caller's own environment is not changed.
    """
    env = dict(environ)
    paths = [shim_folder()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env[RUN_ENV] = folder
    return env


class _Waiter:
    """Waits for the program and forwards signals to it (NOTE [run signals])."""

    def __init__(self) -> None:
        self.interrupted = False
        self.forwarded: list[int] = []
        self._mask = {*_FORWARDED, signal.SIGCHLD}
        self._held = (
            threading.current_thread() is threading.main_thread()
            and hasattr(signal, "sigtimedwait")
            and hasattr(os, "waitid")
        )
        self._old_mask: set[int | signal.Signals] | None = None

    @contextlib.contextmanager
    def holding(self) -> Iterator[_Waiter]:
        """Hold the signals while the program runs; drain and restore them after."""
        if self._held:
            self._old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, self._mask)
        try:
            yield self
        finally:
            if self._held and self._old_mask is not None:
                while signal.sigtimedwait(self._mask, 0) is not None:
                    pass
                signal.pthread_sigmask(signal.SIG_SETMASK, self._old_mask)

    def restore_in_child(self) -> None:
        """Run in the program between fork and exec: its signal mask as it was."""
        if self._old_mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, self._old_mask)

    def wait(self, proc: subprocess.Popen[bytes]) -> tuple[int | None, int | None]:
        """Wait until the program exits; it stays a zombie. Returns (code, signal)."""
        if not self._held:
            try:
                code = proc.wait()
            except KeyboardInterrupt:
                self.interrupted = True
                code = proc.wait()
            return (code, None) if code >= 0 else (None, -code)
        while True:
            state = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if state is not None and state.si_pid == proc.pid:
                if state.si_code == os.CLD_EXITED:
                    return state.si_status, None
                return None, state.si_status
            info = signal.sigtimedwait(self._mask, _WAIT_TICK_S)
            if info is None or info.si_signo == signal.SIGCHLD:
                continue
            if info.si_signo == signal.SIGINT:
                self.interrupted = True
            if info.si_code <= 0:  # sent by a process (kill), not the terminal's kernel
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, info.si_signo)
                self.forwarded.append(info.si_signo)


def _start(command: Sequence[str], env: dict[str, str], waiter: _Waiter) -> subprocess.Popen[bytes]:
    try:
        return subprocess.Popen(list(command), env=env, preexec_fn=waiter.restore_in_child)
    except FileNotFoundError:
        raise LaunchError(f"cannot run {command[0]!r}: no such command", 127) from None
    except PermissionError:
        raise LaunchError(f"cannot run {command[0]!r}: permission denied", 126) from None
    except OSError as error:
        raise LaunchError(f"cannot run {command[0]!r}: {error.strerror or error}", 126) from None


def _end_reason(
    code: int | None, signal_number: int | None, interrupted: bool
) -> tuple[EndReason, str | None]:
    if interrupted or signal_number == signal.SIGINT:
        return "interrupt", "KeyboardInterrupt"
    if signal_number is not None:
        return "exception", f"ended by signal {signal_number}"
    if code:
        return "exception", f"exit status {code}"
    return "completed", None


def run_program(command: Sequence[str], options: RunOptions) -> RunResult:
    """Run ``command`` with the tracker around its process tree; see the module docstring.

    Args:
        command: The program and its arguments.
        options: How to track it.

    Returns:
        What was observed and judged, once the program ended and the grace period passed.

    Raises:
        LaunchError: The command could not be started.

    """
    failures: list[str] = []
    folder = tempfile.mkdtemp(prefix="leakcheck-run-")
    try:
        write_options(folder, options.shim())
        env = child_environment(os.environ, folder)
        waiter = _Waiter()
        tracker: Tracker | None = None
        with waiter.holding():
            proc = _start(command, env, waiter)
            started_unix_s = time.time()
            started = time.monotonic()
            try:
                tracker = Tracker(
                    root_pid=proc.pid,
                    interval=options.interval_s,
                    tolerance=options.tolerance_bytes,
                    grace=options.grace_s,
                    devices=None if options.device_index is None else [options.device_index],
                    session_tag=(RUN_ENV, folder),
                    copy_tolerance=options.copy_tolerance_bytes,
                )
                tracker.begin_epoch("program")
            except LeakCheckError as error:
                failures.append(f"the process tree is not tracked: {error}")
                tracker = None
            code, signal_number = waiter.wait(proc)
            wall_s = time.monotonic() - started
            tree = tree_cost = None
            if tracker is not None:
                if signal_number is not None and not waiter.interrupted:
                    # Unreaped yet: the machine's evidence is read while it is still there.
                    tracker.note_exit(proc.pid, -signal_number)
                tracker.end_epoch(*_end_reason(code, signal_number, waiter.interrupted))
                tracker.close()
                tree = tracker.report()
                tree_cost = asdict(tracker.cost())
            proc.wait()  # reap it only now (NOTE [run signals])
        records = read_records(folder)
        program_torch = _program_torch(records.started)
        failures.extend(records.failures)
        loaders = _loader_results(records.started, records.reports)
        gathered, unread = read_rank_reports(folder)
        failures.extend(unread)
        if tree is not None:
            own = [loader.report for loader in loaders if loader.report is not None]
            own += [report for entry in gathered for report in entry.reports]
            tree = with_rank_devices(with_record_ranks(tree, records.started), own)
        _remove_mailboxes(records.started)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    gpu_reason = ""
    if tree is not None and tree.timeline.attribution in ("nvml-unavailable", "no-gpu"):
        gpu_reason = tree.timeline.attribution_reason or "no GPU"
    return RunResult(
        command=tuple(command),
        options=options,
        pid=proc.pid,
        exit_code=code,
        signal_number=signal_number,
        interrupted=waiter.interrupted,
        wall_s=wall_s,
        tree=tree,
        tree_cost=tree_cost,
        loaders=loaders,
        rank_reports=tuple(gathered),
        failures=tuple(failures),
        started_unix_s=started_unix_s,
        gpu_reason=gpu_reason,
        environment={**environment(executable=sys.executable), **program_torch},
    )


def _program_torch(started: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """``{"torch": version}`` as the program's loaders recorded it; empty when none did."""
    versions = [r["torch"] for r in started if isinstance(r.get("torch"), str)]
    return {"torch": versions[0]} if versions else {}


def _loader_results(
    started: Sequence[Mapping[str, Any]], reports: Sequence[Mapping[str, Any]]
) -> tuple[LoaderResult, ...]:
    by_key = {(r.get("pid"), r.get("index")): r for r in reports}
    results: list[LoaderResult] = []
    for record in started:
        key = (record.get("pid"), record.get("index"))
        report_record = by_key.pop(key, None)
        results.append(_loader_result(record, report_record))
    results.extend(_loader_result(record, record) for record in by_key.values())
    return tuple(results)


def _loader_result(
    record: Mapping[str, Any], report_record: Mapping[str, Any] | None
) -> LoaderResult:
    label = str(record.get("label", "?"))
    pid = record.get("pid")
    argv = record.get("argv")
    common: dict[str, Any] = {
        "label": label,
        "pid": pid if isinstance(pid, int) else 0,
        "argv": tuple(str(a) for a in argv) if isinstance(argv, list) else (),
        "rank": _record_rank(report_record or record),
    }
    if report_record is None:
        return LoaderResult(
            **common,
            missing="its process ended without its exit handlers (os._exit, a signal) or "
            "outlived the run",
        )
    try:
        report = report_from_dict(report_record["report"])
    except (LeakCheckError, KeyError, TypeError, ValueError) as error:
        return LoaderResult(**common, missing=f"its report cannot be read: {error}")
    cost = report_record.get("cost")
    exit_s = report_record.get("exit_s")
    return LoaderResult(
        **common,
        report=report,
        cost=cost if isinstance(cost, dict) else None,
        exit_s=float(exit_s) if isinstance(exit_s, (int, float)) else None,
    )


def _record_rank(record: Mapping[str, Any]) -> RankInfo | None:
    """The rank a loader record names (a report's, with its device choice, else .started's)."""
    data = record.get("rank")
    if not isinstance(data, Mapping):
        return None
    try:
        return rank_info_from_dict(data)
    except (KeyError, TypeError, ValueError):
        return None


def job_of(
    loaders: Sequence[LoaderResult],
    tree: Report | None,
    rank_reports: Sequence[RankReport] = (),
) -> JobReport | None:
    """The job's verdicts from the loaders of ranks and the tree (see ``RunResult.job``).

    None when no loader is a rank's and no process of the tree carries a rank.
    """
    entries: dict[tuple[int, int], RankReport] = {}
    for loader in loaders:
        if loader.rank is None:
            continue
        key = (loader.rank.rank, loader.pid)
        entry = entries.get(key) or RankReport(info=loader.rank, pid=loader.pid)
        if loader.report is not None:
            entry = replace(entry, reports=(*entry.reports, loader.report))
        else:
            entry = replace(entry, missing=(*entry.missing, f"{loader.label}: {loader.missing}"))
        entries[key] = entry
    roots = rank_roots(tree.timeline) if tree is not None else {}
    if not entries and not roots and not rank_reports:
        return None
    return judge_job(
        [*entries.values(), *rank_reports], [tree] if tree is not None else [], rank_roots=roots
    )


def rank_roots(timeline: Timeline) -> dict[int, list[int]]:
    """Rank -> PIDs of the processes that are the rank itself (whose parent is not of it)."""
    processes = [p for rec in timeline.epochs for p in rec.processes]
    if timeline.final is not None:
        processes.extend(timeline.final.processes)
    rank_of = {p.key.pid: p.rank for p in processes}
    roots: dict[int, set[int]] = {}
    for proc in processes:
        if proc.rank is not None and rank_of.get(proc.ppid) != proc.rank and proc.role != "orphan":
            roots.setdefault(proc.rank, set()).add(proc.key.pid)
    return {rank: sorted(pids) for rank, pids in roots.items()}


def with_record_ranks(tree: Report, started: Sequence[Mapping[str, Any]]) -> Report:
    """The tree judged again with the ranks the loaders' records name, where it had none.

    A rank no launcher variable names (a ``torch.multiprocessing.spawn`` child) is known to
    the outside tracker only through what it execs after its first loader (NOTE [exported
    rank] in ranks.py); its own record names the rank process, and its descendants the tree
    saw below it (its workers, their forked children) are that rank's too.
    """
    rank_of: dict[ProcessKey, int] = {}
    for record in started:
        pid, ticks, info = record.get("pid"), record.get("start_ticks"), _record_rank(record)
        if isinstance(pid, int) and isinstance(ticks, int) and info is not None:
            rank_of[ProcessKey(pid, ticks)] = info.rank
    timeline = tree.timeline
    records = [*(rec.processes for rec in timeline.epochs)]
    if timeline.final is not None:
        records.append(timeline.final.processes)
    by_pid = {proc.key.pid: proc for processes in records for proc in processes}

    def rank_above(proc: ProcessEpoch) -> int | None:
        for _ in range(len(by_pid)):  # up the parents the tree recorded; never round a loop
            if proc.rank is not None:
                return proc.rank
            own = rank_of.get(proc.key)  # by identity: NOTE [process identity] in procs.py
            if own is not None:
                return own
            parent = by_pid.get(proc.ppid)
            if parent is None or parent is proc:
                return None
            proc = parent
        return None

    ranked = {
        proc.key: rank
        for proc in by_pid.values()
        if proc.rank is None and (rank := rank_above(proc)) is not None
    }
    if not ranked:
        return tree

    def give(processes: tuple[ProcessEpoch, ...]) -> tuple[ProcessEpoch, ...]:
        return tuple(
            replace(p, rank=ranked[p.key]) if p.rank is None and p.key in ranked else p
            for p in processes
        )

    epochs = tuple(replace(rec, processes=give(rec.processes)) for rec in timeline.epochs)
    final = timeline.final
    if final is not None:
        final = replace(final, processes=give(final.processes))
    return build_report(replace(timeline, epochs=epochs, final=final), tree.config)


def with_rank_devices(tree: Report, reports: Sequence[Report]) -> Report:
    """The tree judged again with the devices the ranks chose (``set_device``), if any.

    Each rank's own report records its choice (``Timeline.rank_devices``); the outside
    tracker cannot see it, and would judge by ``LOCAL_RANK`` alone.
    """
    chosen: dict[int, int] = {}
    for report in reports:
        chosen.update(report.timeline.rank_devices)
    if not chosen:
        return tree
    timeline = replace(tree.timeline, rank_devices={**tree.timeline.rank_devices, **chosen})
    return build_report(timeline, tree.config)


def _remove_mailboxes(started: Sequence[Mapping[str, Any]]) -> None:
    """Remove the mailboxes of loader trackers whose process is gone without closing them.

    A tracker removes its mailbox when it closes; a process killed before its exit handlers
    ran leaves it behind. Only folders named as leakcheck names them, of processes that are
    gone (by identity), are removed.
    """
    for record in started:
        folder, pid = record.get("mailbox"), record.get("pid")
        ticks = record.get("start_ticks")
        if not isinstance(folder, str) or not os.path.basename(folder).startswith(_MAILBOX_PREFIX):
            continue
        owner = ProcessKey(pid, ticks) if isinstance(pid, int) and isinstance(ticks, int) else None
        if owner is not None and procs.process_key(owner.pid) == owner:
            continue  # still running (by identity: NOTE [process identity] in procs.py)
        shutil.rmtree(folder, ignore_errors=True)
