"""The engine of ``leakcheck run``: an unmodified program, tracked inside and out.

``run_program`` starts the command with the run shim (NOTE [run shim] in
``_shim/sitecustomize.py``; inside: NOTE [run instrumentation] in instrument.py), watches its
process tree from outside with a ``Tracker`` rooted at it, then reads the loaders' records.

NOTE [run tag]: ``LEAKCHECK_RUN=<run folder>``, in the program's initial environment and
inherited unchanged by every process it starts, is the outside tracker's session tag (the
trackers inside export their own ``LEAKCHECK_SESSION``).

NOTE [run signals]: a terminal's Ctrl-C reaches the program itself; ``kill -INT
<leakcheck>`` only the launcher, which blocks SIGINT, SIGTERM, SIGHUP and SIGCHLD (the
program gets its mask back before exec) and forwards only what a process sent (``si_code``
<= 0): a second SIGINT could break the program's cleanup. ``waitid(WNOWAIT)`` keeps the
exited program a zombie until the tree is read, so its PID is not reused.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from leakcheck.adapters.distributed import read_rank_reports
from leakcheck.commands.instrument import (
    OPTIONS_FILE,
    RUN_ENV,
    LoaderResult,
    RunOptions,
    read_loader,
)
from leakcheck.core.errors import LeakCheckError
from leakcheck.core.files import environment, write_json
from leakcheck.core.model import EndReason, ProcessEpoch, ProcessKey, Timeline
from leakcheck.core.names import process_name, signal_name
from leakcheck.core.ranks import rank_label
from leakcheck.core.records import to_jsonable
from leakcheck.core.units import format_size, plural
from leakcheck.judge.job import JobReport, RankReport, finding_identity, judge_job
from leakcheck.judge.report import (
    SCHEMA_VERSION,
    Report,
    build_report,
    combined_verdict,
    gpu_unchecked,
)
from leakcheck.observe import mailbox, procs
from leakcheck.track.tracker import Tracker

__all__ = ["LaunchError", "LoaderResult", "RunOptions", "RunResult", "run_program"]

RUN_SCHEMA_VERSION = 2
"""Version of ``RunResult.to_dict``'s layout."""

_HELD = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD}


class LaunchError(LeakCheckError):
    """The command could not be started; ``exit_status`` is the shell's (126 or 127)."""

    def __init__(self, message: str, exit_status: int) -> None:
        super().__init__(message)
        self.exit_status = exit_status


@dataclass(frozen=True)
class RunResult:
    """Everything ``leakcheck run`` observed and judged (``tree``: the outside tracker's)."""

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
    environment: Mapping[str, Any] = field(default_factory=dict)
    rank_reports: tuple[RankReport, ...] = ()

    @property
    def gpu_reason(self) -> str:
        """Why GPU memory was not checked; empty where it was."""
        timeline = self.tree.timeline if self.tree is not None else None
        if timeline is None or timeline.attribution not in ("nvml-unavailable", "no-gpu"):
            return ""
        return timeline.attribution_reason or "no GPU"

    @property
    def program_status(self) -> int:
        """The program's exit status as a shell gives it (128 + N for signal N)."""
        if self.signal_number is not None:
            return 128 + self.signal_number
        return self.exit_code if self.exit_code is not None else 1

    @property
    def leak_count(self) -> int:
        """Leaks over the loaders and the tree, each leaking process counted once."""
        return len({finding_identity(f) for report in self._reports() for f in report.leaks})

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
        """The distributed job's verdicts, per rank and overall; None outside a job."""
        entries = [  # one per loader: judge_job gathers a rank's processes
            RankReport(
                info=loader.rank,
                pid=loader.pid,
                reports=(loader.report,) if loader.report is not None else (),
                missing=() if loader.report is not None else (f"{loader.label}: {loader.missing}",),
            )
            for loader in self.loaders
            if loader.rank is not None
        ]
        tree = [self.tree] if self.tree is not None else []
        roots = rank_roots(self.tree.timeline) if self.tree is not None else {}
        if not entries and not roots and not self.rank_reports:
            return None
        return judge_job([*entries, *self.rank_reports], tree, rank_roots=roots)

    def to_dict(self) -> dict[str, Any]:
        """Everything as JSON-able data, with ``schema`` and ``schema_version``."""
        return {
            "schema": "leakcheck.run",
            "schema_version": RUN_SCHEMA_VERSION,
            "report_schema_version": SCHEMA_VERSION,
            "command": list(self.command),
            "options": to_jsonable(self.options),
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
        """The text report: findings under the loader (or tree) that found them, each once."""
        options = self.options
        quiet = self.verdict == "clean" and not any(report.said for report in self._reports())
        how = f"exited with status {self.exit_code}"
        if self.signal_number is not None:
            how = f"was ended by {signal_name(self.signal_number)}"
        interrupted = " (interrupted)" if self.interrupted else ""
        gpu = f"; {gpu_unchecked(self.gpu_reason)}" if self.gpu_reason else ""
        lines = [
            f"leakcheck run: {process_name(' '.join(self.command))}: program PID {self.pid} "
            f"{how}{interrupted} after {self.wall_s:.1f} s{gpu}"
        ]
        if not quiet:
            lines.append(
                f"  tolerance {format_size(options.tolerance_bytes)}, grace {options.grace_s:g} "
                f"s, sampling every {options.interval_s * 1000:g} ms, "
                f"teardown {'on' if options.teardown else 'off'}"
            )
        gap = [] if quiet else [""]
        shown: set[tuple[object, ...]] = set()  # a finding of the program's own process: once
        for loader in self.loaders:
            lines += gap + _loader_lines(loader, shown)
        if not self.loaders:
            lines += [
                *gap,
                "loaders: none tracked: no DataLoader iterated in a Python process of the run, "
                "or PYTHONPATH ignored (-E, -I, -S)",
            ]
        lines += gap + self._tree_lines()
        lines += [f"  leakcheck itself: {failure}" for failure in self.failures]
        job = self.job
        if job is not None:
            lines += gap + job.format_lines(named=False)  # the loaders' lines name them
        ranks = f", {len(job.ranks)} ranks" if job is not None else ""
        missing = sum(loader.report is None for loader in self.loaders)
        unread = f" ({missing} without a report)" if missing else ""
        lines += [
            *gap,
            f"leakcheck run: verdict {self.verdict}, {plural(self.leak_count, 'leak')} "
            f"({plural(len(self.loaders), 'loader')}{unread}{ranks} and the process tree); "
            f"program exit status {self.program_status}",
        ]
        return "\n".join(lines)

    def _tree_lines(self) -> list[str]:
        tree = self.tree
        head = f"process tree of PID {self.pid}, watched from outside"
        if tree is None:
            return [f"{head}: not tracked"]
        # What a loader blamed is left to it: it knows its workers from their own reports.
        shown = {finding_identity(f) for r in self.loaders if r.report for f in r.report.leaks}
        repeated = [f for f in tree.findings if finding_identity(f) in shown]
        # Sampled from outside it misses short-lived workers; their loaders saw each of them.
        keys = tree.process_keys.union(*(r.report.process_keys for r in self.loaders if r.report))
        processes = plural(len(keys), "process", "processes")
        line = f"{head} ({processes}): verdict {tree.verdict.upper()}"
        if repeated:
            line += f"; {plural(len(repeated), 'finding')} named above"
        rest = [f for f in tree.findings if f not in repeated]
        return [line, *tree.finding_lines(rest, indent="  ")]


def _loader_lines(loader: LoaderResult, shown: set[tuple[object, ...]]) -> list[str]:
    report = loader.report
    who = f"{rank_label(loader.rank.rank if loader.rank else None)}PID {loader.pid}"
    if report is None:
        return [f"loader {loader.label} ({who}): no report: {loader.missing}"]
    early = [epoch.end_reason for epoch in report.epochs if epoch.end_reason != "completed"]
    ended = f", {len(early)} not completed ({', '.join(sorted(set(early)))})" if early else ""
    processes = plural(len(report.process_keys), "process", "processes")
    fresh = [f for f in report.said if (f.rule, *finding_identity(f)) not in shown]
    shown.update((f.rule, *finding_identity(f)) for f in report.said)
    repeated = len(report.said) - len(fresh)
    named = f"; {plural(repeated, 'finding')} named above" if repeated else ""
    return [
        f"loader {loader.label} ({who}): {plural(len(report.epochs), 'epoch')}{ended}, "
        f"{processes}; verdict {report.verdict.upper()}{named}{report.growth_unjudged()}",
        *report.finding_lines(fresh, indent="  ", loader=loader.label),
    ]


# --------------------------------------------------------------------------- running


def shim_folder() -> str:
    """The run shim's folder, put first on the program's ``PYTHONPATH``."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_shim")


def child_environment(environ: Mapping[str, str], folder: str) -> dict[str, str]:
    """``environ`` with the shim first on ``PYTHONPATH`` and ``LEAKCHECK_RUN`` (NOTE [run tag])."""
    paths = [shim_folder()] + [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**environ, "PYTHONPATH": os.pathsep.join(paths), RUN_ENV: folder}


@contextlib.contextmanager
def _signals_held() -> Iterator[set[int | signal.Signals]]:
    """Hold the forwarded signals and SIGCHLD, drained after; yields the program's mask."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
    try:
        yield held
    finally:
        while signal.sigtimedwait(_HELD, 0) is not None:
            pass
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _start(command: Sequence[str], folder: str, mask: set[int | signal.Signals]) -> Any:
    env = child_environment(os.environ, folder)
    restore = functools.partial(signal.pthread_sigmask, signal.SIG_SETMASK, mask)
    try:  # the mask is restored in the program, between fork and exec
        return subprocess.Popen(list(command), env=env, preexec_fn=restore)
    except OSError as error:
        status, why = 126, error.strerror or str(error)
        if isinstance(error, FileNotFoundError):
            status, why = 127, "no such command"
        elif isinstance(error, PermissionError):
            why = "permission denied"
        raise LaunchError(f"cannot run {command[0]!r}: {why}", status) from None


def _wait(pid: int) -> tuple[int | None, int | None, bool, set[int]]:
    """(code, signal, interrupted, signals forwarded) once the program exited (unreaped)."""
    interrupted, forwarded = False, set[int]()
    while True:
        state = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if state is not None and state.si_pid == pid:
            if state.si_code == os.CLD_EXITED:
                return state.si_status, None, interrupted, forwarded
            return None, state.si_status, interrupted, forwarded
        info = signal.sigtimedwait(_HELD, 0.5)
        if info is None or info.si_signo == signal.SIGCHLD:
            continue
        interrupted |= info.si_signo == signal.SIGINT
        if info.si_code <= 0:  # sent by a process (kill), not the terminal's kernel
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, info.si_signo)
                forwarded.add(info.si_signo)


# A process of the run still writing its reports at exit (a rank after the program) is not yet
# a survivor: on a loaded machine its exit handlers may take seconds past the grace.
_EXIT_WAIT_S = 10.0


def _exits_awaited(folder: str, limit_s: float) -> None:
    """Wait, at most ``limit_s``, while a process of the run that iterated a loader is alive.

    It is still in its exit: before its report is written or after (exit handlers run after
    leakcheck's, the interpreter's teardown); judged now, it would read as an orphan.
    """
    deadline = time.monotonic() + limit_s
    owners: dict[str, ProcessKey | None] = {}  # a record's process, read once by its file name
    while time.monotonic() < deadline:
        for name in os.listdir(folder):
            if name.startswith("loader-") and name not in owners:
                record = read_loader(os.path.join(folder, name))
                if record is not None:
                    ticks = record.start_ticks
                    owners[name] = None if ticks is None else ProcessKey(record.pid, ticks)
        if not any(procs.is_alive(key) for key in owners.values() if key is not None):
            return
        time.sleep(0.05)


def _end_reason(
    code: int | None, signal_number: int | None, interrupted: bool
) -> tuple[EndReason, str | None]:
    if interrupted or signal_number == signal.SIGINT:
        return "interrupt", "KeyboardInterrupt"
    if signal_number is not None:
        return "exception", f"ended by signal {signal_number}"
    return ("exception", f"exit status {code}") if code else ("completed", None)


def run_program(command: Sequence[str], options: RunOptions) -> RunResult:
    """Run ``command`` tracked inside and out; judged once it ended.

    Raises:
        LaunchError: The command could not be started.

    """
    failures: list[str] = []
    tree: Report | None = None
    tree_cost: dict[str, Any] | None = None
    folder = tempfile.mkdtemp(prefix="leakcheck-run-")
    try:
        write_json(os.path.join(folder, OPTIONS_FILE), to_jsonable(options))
        with _signals_held() as mask:
            proc = _start(command, folder, mask)
            started_unix_s = time.time()
            started = time.monotonic()
            tracker: Tracker | None = None
            try:
                tracker = Tracker(
                    root_pid=proc.pid, session_tag=(RUN_ENV, folder), **options.tracker_options()
                )
                tracker.begin_epoch("program")
            except LeakCheckError as error:
                failures.append(f"the process tree is not tracked: {error}")
            code, signal_number, interrupted, forwarded = _wait(proc.pid)
            wall_s = time.monotonic() - started
            _exits_awaited(folder, max(_EXIT_WAIT_S, options.grace_s))
            if tracker is not None:
                # A death by what run passed on has its sender; by SIGINT, it is an interrupt
                # (an uncaught KeyboardInterrupt ends Python so too).
                unsent = signal_number not in (signal.SIGINT, *forwarded)
                if signal_number is not None and unsent and not interrupted:
                    # Unreaped yet: the machine's evidence is read while it is still there.
                    tracker.note_exit(proc.pid, -signal_number)
                tracker.end_epoch(*_end_reason(code, signal_number, interrupted))
                tracker.close()
                tree = tracker.report()
                tree_cost = to_jsonable(tracker.cost())
            proc.wait()  # reap it only now (NOTE [run signals])
        loaders = _read_loaders(folder, failures)
        gathered, unread = read_rank_reports(folder)
        failures.extend(unread)
        if tree is not None:
            own = [r for loader in loaders if (r := loader.report) is not None]
            own += [report for entry in gathered for report in entry.reports]
            tree = with_ranks(tree, loaders, own)
        _remove_mailboxes(loaders)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    torch = [("torch", loader.torch) for loader in loaders if loader.torch]
    return RunResult(
        command=tuple(command),
        options=options,
        pid=proc.pid,
        exit_code=code,
        signal_number=signal_number,
        interrupted=interrupted,
        wall_s=wall_s,
        tree=tree,
        tree_cost=tree_cost,
        loaders=loaders,
        rank_reports=tuple(gathered),
        failures=tuple(failures),
        started_unix_s=started_unix_s,
        environment={**environment(executable=sys.executable), **dict(torch[:1])},
    )


def _read_loaders(folder: str, failures: list[str]) -> tuple[LoaderResult, ...]:
    """The loaders' records, rank by rank in the order they started; failures to ``failures``."""
    loaders: list[LoaderResult] = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.startswith("loader-"):
            loader = read_loader(path)
            if loader is None:
                failures.append(f"a loader's record cannot be read: {name}")
            else:
                loaders.append(loader)
        elif name.startswith("failure-"):
            with contextlib.suppress(OSError, ValueError), open(path, encoding="utf-8") as handle:
                failures.append(handle.read().strip())
    # Ranks start their loaders at once: the order of starts is a race, the rank's is not.
    return tuple(
        sorted(loaders, key=lambda r: (r.rank.rank if r.rank else -1, r.started_unix_s, r.index))
    )


def _processes(timeline: Timeline) -> list[ProcessEpoch]:
    final = timeline.final.processes if timeline.final is not None else ()
    return [p for rec in timeline.epochs for p in rec.processes] + list(final)


def rank_roots(timeline: Timeline) -> dict[int, list[int]]:
    """Rank -> PIDs of the processes that are the rank itself (whose parent is not of it)."""
    processes = _processes(timeline)
    rank_of = {p.key.pid: p.rank for p in processes}
    roots: dict[int, set[int]] = {}
    for proc in processes:
        if proc.rank is not None and rank_of.get(proc.ppid) != proc.rank and proc.role != "orphan":
            roots.setdefault(proc.rank, set()).add(proc.key.pid)
    return {rank: sorted(pids) for rank, pids in roots.items()}


def with_ranks(tree: Report, loaders: Sequence[LoaderResult], reports: Sequence[Report]) -> Report:
    """The tree judged again with the ranks (and devices) its loaders name, where they differ.

    A spawned rank is known outside only through its loaders' records (NOTE [exported rank]
    in ranks.py); the ranks' reports say which device each chose.
    """
    rank_of = {
        ProcessKey(loader.pid, loader.start_ticks): loader.rank.rank
        for loader in loaders
        if loader.rank is not None and loader.start_ticks is not None
    }
    by_pid = {proc.key.pid: proc for proc in _processes(tree.timeline)}

    def rank_above(proc: ProcessEpoch) -> int | None:
        for _ in range(len(by_pid)):  # up the parents the tree recorded; never round a loop
            own = proc.rank if proc.rank is not None else rank_of.get(proc.key)
            parent = by_pid.get(proc.ppid)
            if own is not None or parent is None:
                return own
            proc = parent
        return None

    above = {p.key: rank_above(p) for p in by_pid.values() if p.rank is None}
    ranked = {key: rank for key, rank in above.items() if rank is not None}
    chosen = {k: v for report in reports for k, v in report.timeline.rank_devices.items()}
    if not ranked and not chosen:
        return tree

    def give(processes: tuple[ProcessEpoch, ...]) -> tuple[ProcessEpoch, ...]:
        return tuple(replace(p, rank=ranked.get(p.key, p.rank)) for p in processes)

    timeline = tree.timeline
    final = timeline.final and replace(timeline.final, processes=give(timeline.final.processes))
    timeline = replace(
        timeline,
        epochs=tuple(replace(rec, processes=give(rec.processes)) for rec in timeline.epochs),
        final=final,
        rank_devices={**timeline.rank_devices, **chosen},
    )
    return build_report(timeline, tree.config)


def _remove_mailboxes(loaders: Sequence[LoaderResult]) -> None:
    """Remove the mailboxes of loader trackers whose process died before closing them."""
    for loader in loaders:
        folder, pid, ticks = loader.mailbox, loader.pid, loader.start_ticks
        if not folder or not os.path.basename(folder).startswith(mailbox.MAILBOX_PREFIX):
            continue
        if ticks is None or procs.process_key(pid) != ProcessKey(pid, ticks):  # by identity
            mailbox.remove(folder)
