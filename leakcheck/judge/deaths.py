"""The ``died`` rule: a process of the job ended by a signal, and what the evidence says why.

NOTE [death evidence]: a signal names no sender, so the finding says only what was read as
the death was noted, never more: SIGKILL with the cgroup's OOM-kill count risen or the
machine's available memory nearly gone is the OOM killer; SIGBUS with ``/dev/shm`` at the shm
rule's pressure is ``/dev/shm`` exhausted; SIGSEGV, SIGABRT, SIGBUS, SIGILL, SIGFPE are a
crash in native code, with the faulthandler's stack; anything else is sender unknown, but
SIGPIPE: the kernel's, the reader of its output gone (`| head`), no death.
"""

from __future__ import annotations

import os
import re
import signal

from leakcheck.core.model import Death, Finding, RuleConfig, Timeline
from leakcheck.core.names import culprit, signal_name
from leakcheck.core.units import format_size

__all__ = ["died", "hang", "shutdown_hang"]

# Available memory under this share of the machine's: the machine-wide OOM killer's condition.
_NEAR_FULL_FRACTION = 0.05

_CRASHES = frozenset({signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGILL, signal.SIGFPE})

_FRAME = re.compile(r'^\s*File "([^"]*)", line (\d+) in (\S+)', re.MULTILINE)


def crashing_thread(stack: str) -> str:
    """The crashing thread's part of what faulthandler wrote (``Current thread`` and frames)."""
    lines = stack.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("Current thread")), None)
    if start is None:
        return stack
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].strip()), len(lines))
    return "\n".join(lines[start:end])


def innermost_frames(stack: str, count: int = 2) -> str | None:
    """The first ``count`` frames of the crashing thread, ``func (file:line)``, inner first."""
    frames: list[str] = []
    for line in crashing_thread(stack).splitlines():
        match = _FRAME.match(line)
        if match is not None:
            path, number, function = match.groups()
            frames.append(f"{function} ({os.path.basename(path)}:{number})")
        elif frames:
            break  # without a "Current thread" line: the next thread's frames are not it
        if len(frames) == count:
            break
    return " < ".join(frames) or None


def _what(death: Death, config: RuleConfig) -> tuple[str, str]:
    """What the evidence says of one death, and its fix (NOTE [death evidence])."""
    name = signal_name(death.signal_number)
    when = f" in epoch {death.epoch}" if death.epoch is not None else ""
    if death.signal_number == signal.SIGKILL:
        evidence: list[str] = []
        if death.oom_kills:
            evidence.append(f"OOM kills of its memory cgroup +{death.oom_kills}")
        total, free = death.memory_total_bytes, death.memory_available_bytes
        if total and free is not None and free < _NEAR_FULL_FRACTION * total:
            evidence.append(f"{format_size(free)} of {format_size(total)} memory available")
        if evidence:
            held = ""
            if death.rss_bytes_last is not None:
                held = f"; held {format_size(death.rss_bytes_last)}"
                if death.rss_bytes_birth is not None:
                    grown = death.rss_bytes_last - death.rss_bytes_birth
                    held += f", {'+' if grown >= 0 else '-'}{format_size(abs(grown))} since birth"
            return (
                f"was killed by the OOM killer (SIGKILL){when}: {', '.join(evidence)}{held}",
                "find what grows in it (host-growth, copy-on-read), or fewer workers, a smaller "
                "prefetch_factor, more memory",
            )
    total_shm, used_shm = death.shm_total_bytes, death.shm_used_peak_bytes
    if (
        death.signal_number == signal.SIGBUS
        and total_shm
        and used_shm is not None
        and used_shm >= config.shm_pressure_fraction * total_shm
    ):
        return (
            f"died of a bus error (SIGBUS){when}: /dev/shm exhausted, "
            f"{format_size(used_shm)} of {format_size(total_shm)} used",
            "docker run --shm-size=8g or --ipc=host, or set_sharing_strategy('file_system')",
        )
    if death.signal_number in _CRASHES:
        frames = innermost_frames(death.stack) if death.stack else None
        where = f"; stack: {frames}" if frames else "; no Python stack was written"
        return (
            f"crashed in native code ({name}){when}{where}",
            "see the stack for the call that crashed (a C extension, a library not fork-safe)",
        )
    return (
        f"was killed by {name} (sender unknown){when}",
        "no evidence of an OOM kill: look for the sender (a scheduler's limit, a kill by hand)",
    )


def died(timeline: Timeline, config: RuleConfig) -> tuple[Finding, ...]:
    """One ``died`` finding per process of the job a signal ended (NOTE [death evidence])."""
    findings: list[Finding] = []
    for death in timeline.deaths:
        if death.signal_number == signal.SIGPIPE:  # its output's reader left (`| head`)
            continue
        # Its latest record names its role, command line and rank.
        records = (p for rec in reversed(timeline.epochs) for p in rec.processes)
        record = next((p for p in records if p.key == death.key), None)
        role, cmdline, rank = (record.role, record.cmdline, record.rank) if record else (None,) * 3
        who = culprit(role, death.key.pid, cmdline, rank=rank, rule="died")
        what, remedy = _what(death, config)
        bus_shm_bytes = death.shm_used_peak_bytes if death.signal_number == signal.SIGBUS else None
        stack = crashing_thread(death.stack) if death.stack else None
        findings.append(
            Finding(
                rule="died", severity="leak", message=f"{who} {what}", remedy=remedy,
                pid=death.key.pid, start_ticks=death.key.start_ticks, role=role, cmdline=cmdline,
                epoch=death.epoch, host_bytes=death.rss_bytes_last, size_bytes=bus_shm_bytes,
                rank=rank, stack=stack,
            )
        )
    return tuple(findings)


def _waits(stacks: str) -> list[tuple[str, str]]:
    """(PID, innermost frame of its main thread) for each worker's section of a stall's stacks."""
    waits: list[tuple[str, str]] = []
    for section in stacks.split("--- worker PID ")[1:]:
        pid, _, text = section.partition(" ---\n")
        # Its main thread, where __getitem__ runs: faulthandler lists it last (newest first),
        # and "Current thread" is whichever thread took the signal.
        threads = [t for t in text.split("\n--- ")[0].split("\n\n") if t.strip()]
        frame = innermost_frames(threads[-1], 1) if threads else None
        if frame is not None:
            waits.append((pid, frame))
    return waits


def hang(timeline: Timeline, config: RuleConfig) -> tuple[Finding, ...]:
    """One ``hang`` finding per stall of an epoch, with the job's stacks (NOTE [hang watch])."""
    return tuple(
        Finding(
            rule="hang", severity="info",
            message=(
                f"no batch for {stall.waited_s:.0f} s"
                + (f" in epoch {stall.epoch}" if stall.epoch is not None else "")
                + "".join(f"; worker PID {pid} in {frame}" for pid, frame in _waits(stall.stacks))
                + "; the job's stacks follow"
            ),
            remedy="see where each waits (a worker's __getitem__, a lock, a full queue)",
            epoch=stall.epoch, stack=stall.stacks or None,
        )
        for stall in timeline.stalls
        if stall.pid is None
    )


def shutdown_hang(timeline: Timeline, config: RuleConfig) -> tuple[Finding, ...]:
    """A finding per worker alive past its shutdown's join time (NOTE [exit watch] in hang.py).

    Not in an epoch a Ctrl-C ended: its workers took the SIGINT too, and one that left its loop
    so waits at exit to hand its last batches to a parent that no longer reads them.
    """
    interrupted = {e.index for e in timeline.epochs if e.end_reason == "interrupt"}
    return tuple(
        Finding(
            rule="shutdown-hang", severity="info",
            message=(
                f"DataLoader worker (PID {stall.pid}) did not exit within {stall.waited_s:.0f} s "
                "of its shutdown: terminated"
                + "".join(f" in {frame}" for _, frame in _waits(stall.stacks)[:1])
            ),
            remedy="see its stack: a __getitem__ still running, a non-daemon thread, a "
            "worker_init_fn that blocks",
            pid=stall.pid, epoch=stall.epoch, stack=stall.stacks or None,
        )
        for stall in timeline.stalls
        if stall.pid is not None and stall.epoch not in interrupted
    )
