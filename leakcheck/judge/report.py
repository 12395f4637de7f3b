"""A judged timeline (``build_report``), as text for people or JSON-able data for tools."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from leakcheck.core.errors import UsageError
from leakcheck.core.model import (
    DeviceState,
    EpochRecord,
    Finding,
    ProcessKey,
    RuleConfig,
    Timeline,
)
from leakcheck.core.names import ELLIPSIS, culprit, culprits, process_name
from leakcheck.core.ranks import rank_label
from leakcheck.core.records import record_from_dict, to_jsonable
from leakcheck.core.units import format_mib, format_size, plural
from leakcheck.judge.plot import plot_reports
from leakcheck.judge.verdict import (
    GROWTH_POINTS,
    LINEAGE_ROLES,
    EpochCounts,
    epoch_counts,
    judge,
    per_pid_bytes_known,
)
from leakcheck.observe.procs import create_time_s

__all__ = [
    "FINDING_WIDTH",
    "FIX_WIDTH",
    "SCHEMA_VERSION",
    "EpochRow",
    "Report",
    "Verdict",
    "about_gpu",
    "build_report",
    "combined_verdict",
    "cut",
    "epoch_row",
    "finding_lines",
    "gpu_unchecked",
    "is_said",
    "leak_short",
    "leaks_short",
    "report_from_dict",
    "verdict_of",
]

SCHEMA_VERSION = 3
"""Version of the ``to_dict`` layout (3: processes by start ticks), bumped on any change."""


Verdict = Literal["clean", "leak", "blind"]


def verdict_of(*, leaked: bool, blind: bool) -> Verdict:
    """``leak`` if anything leaked, else ``blind`` if not attributable, else ``clean``."""
    return "leak" if leaked else "blind" if blind else "clean"


def combined_verdict(verdicts: Iterable[str]) -> Verdict:
    """The verdict of several reports together: the worst of theirs."""
    found = set(verdicts)
    return verdict_of(leaked="leak" in found, blind="blind" in found)


@dataclass(frozen=True)
class Report:
    """The findings of the leak rules over one timeline, in ``verdict.judge``'s order."""

    timeline: Timeline
    findings: tuple[Finding, ...]
    config: RuleConfig

    @property
    def leaks(self) -> list[Finding]:
        """Findings of severity ``leak``."""
        return [f for f in self.findings if f.severity == "leak"]

    @property
    def infos(self) -> list[Finding]:
        """Findings of severity ``info`` (advice; never fail a check)."""
        return [f for f in self.findings if f.severity == "info"]

    @property
    def epochs(self) -> tuple[EpochRecord, ...]:
        """The observed epochs, in order."""
        return self.timeline.epochs

    @property
    def verdict(self) -> Verdict:
        """``leak``, ``blind`` or ``clean`` (``verdict_of``)."""
        return verdict_of(
            leaked=bool(self.leaks), blind=self.timeline.attribution == "blind-namespace"
        )

    @property
    def clean(self) -> bool:
        """True only when the verdict is ``clean``."""
        return self.verdict == "clean"

    @property
    def process_keys(self) -> frozenset[ProcessKey]:
        """Every process of the job's lineage that the report saw (what its summary counts)."""
        tl = self.timeline
        final = tl.final.processes if tl.final is not None else ()
        processes = [*(p for rec in tl.epochs for p in rec.processes), *final]
        return frozenset(p.key for p in processes if p.role in LINEAGE_ROLES)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able data: the timeline, ``verdict``, ``summary`` (``report_from_dict``)."""
        tl = self.timeline
        boot = tl.boot_unix_s  # process keys with their create time where it is known
        data = to_jsonable(tl, None if boot is None else lambda ticks: create_time_s(ticks, boot))
        known = per_pid_bytes_known(tl)
        for rec, epoch in zip(tl.epochs, data["epochs"], strict=True):
            for proc, out in zip(rec.processes, epoch["processes"], strict=True):
                # Totals only where NVML read per-process bytes: else unknown (null), never 0.
                read = known and not proc.gpu_bytes_unknown
                out["total_gpu_bytes_end"] = proc.total_gpu_bytes_end if read else None
                out["total_gpu_bytes_peak"] = proc.total_gpu_bytes_peak if read else None
            epoch["duration_s"] = rec.duration_s
        pop = data.pop
        return {
            "schema_version": SCHEMA_VERSION,
            "session": pop("session_id"),
            "root": pop("root"),
            "started_unix_s": pop("started_unix_s"),
            "attribution": pop("attribution"),
            "attribution_reason": pop("attribution_reason"),
            "verdict": self.verdict,
            "summary": {
                "leaks": len(self.leaks),
                "infos": len(self.infos),
                "epochs": len(tl.epochs),
                "processes": len(self.process_keys),
            },
            "config": to_jsonable(self.config),
            "baseline": {
                "devices": pop("baseline_devices"),
                "gpu_bytes": pop("baseline_gpu_bytes"),
            },
            "epochs": pop("epochs"),
            "final": pop("final"),
            "findings": to_jsonable(self.findings),
            "failures": pop("failures"),
            **data,  # the timeline's other fields, under their own names
        }

    def summary(self, *, gpu: bool = True, named: bool = True) -> str:
        """The verdict line ending ``format()`` (``gpu``: say GPU unchecked; ``named``: leaks)."""
        tl, leaks = self.timeline, self.leaks
        epochs = plural(len(tl.epochs), "epoch")
        processes = plural(len(self.process_keys), "process", "processes")
        if leaks and not named:
            line = f"leakcheck: {plural(len(leaks), 'leak')} in {epochs} ({processes})"
        elif leaks:
            line = f"leakcheck: {plural(len(leaks), 'leak')} found: {leaks_short(leaks)}"
        elif self.verdict == "blind":
            line = (
                f"leakcheck: cannot confirm no leaks in {epochs}: GPU memory could not be "
                "attributed to processes (PID namespace); device totals show no leak"
            )
        elif tl.attribution in ("nvml-unavailable", "no-gpu"):
            unchecked = "; GPU not checked" if gpu else ""
            line = f"leakcheck: no leaks in {epochs} ({processes}{unchecked})"
        else:
            peak = _device_peak(tl)
            peak_text = f", peak {format_size(peak[1])} on GPU{peak[0]}" if peak else ""
            line = f"leakcheck: no leaks in {epochs} ({processes}{peak_text})"
        return line + self._pending_text() + self.growth_unjudged()

    def growth_unjudged(self) -> str:
        """Where a clean verdict saw too few epochs for the growth rules, the clause saying so."""
        needed = self.config.warmup_epochs + GROWTH_POINTS
        if self.leaks or not 0 < len(self.timeline.epochs) < needed:
            return ""
        return f"; growth not judged (needs {needed} epochs)"

    def _pending_text(self) -> str:
        """What a report before ``close()`` could not judge yet, said rather than left out."""
        final = self.timeline.final
        named = {f.pid for f in self.leaks}  # an orphan is judged from the moment it is one
        pending = [] if final is None or final.closed else final.pending_pids
        pending = [pid for pid in pending if pid not in named]
        if not pending:
            return ""
        count = plural(len(pending), "process", "processes")
        return (
            f"; {count} of recent epochs not judged yet (alive, not yet seen more than the "
            f"grace of {self.config.grace_s:g} s after the end of the epoch "
            f"{'it was' if len(pending) == 1 else 'they were'} born in)"
        )

    def format(self, *, verbose: bool = False) -> str:
        """The report as text; ``verbose`` adds thresholds, every process and worker teardowns."""
        if self.clean and not verbose:
            return "\n".join([*self.finding_lines(self.infos), self.summary()])
        tl, config = self.timeline, self.config
        devices = tl.baseline_devices or (tl.epochs[0].devices if tl.epochs else ())
        head = [f"session {tl.session_id}", f"root PID {tl.root.pid}"]
        head += [plural(len(tl.epochs), "epoch")]
        head += [", ".join(f"GPU{d.index} {d.name}" for d in devices)] if devices else []
        lines = ["leakcheck report: " + ", ".join(head)]
        if tl.attribution == "blind-namespace":
            reason = f" ({tl.attribution_reason})" if tl.attribution_reason else ""
            lines.append(
                f"attribution blind: NVML's PIDs are from another PID namespace{reason}; "
                "only device totals are judged"
            )
        elif tl.attribution in ("nvml-unavailable", "no-gpu"):
            lines.append(gpu_unchecked(tl.attribution_reason))
        if verbose:
            lines.append(
                f"thresholds: tolerance {format_size(config.tolerance_bytes)}, host tolerance "
                f"{format_mib(config.host_tolerance_bytes)} MiB, "
                f"warm-up {plural(config.warmup_epochs, 'epoch')}, grace {config.grace_s:g} s, "
                f"high clocks >= {config.high_clock_fraction:.0%} of max"
            )
        if tl.epochs:
            lines += ["", *_epoch_table(tl, config)]
        if verbose:
            lines += [*_process_lines(tl), *_teardown_lines(tl)]
        if self.said:
            lines += ["", *self.finding_lines()]
        return "\n".join([*lines, "", self.summary(named=not self.said)])

    def finding_lines(
        self,
        findings: Sequence[Finding] | None = None,
        *,
        indent: str = "",
        loader: str | None = None,
    ) -> list[str]:
        """``finding_lines`` of ``findings`` (default: ``said``), workers named by index."""
        teardowns = self.timeline.teardowns
        worker_ids = {t.key.pid: t.worker_id for t in teardowns if t.worker_id is not None}
        chosen = [f for f in (self.findings if findings is None else findings) if is_said(f)]
        return finding_lines(chosen, indent, loader=loader, worker_ids=worker_ids)

    @property
    def said(self) -> list[Finding]:
        """The findings the text reports write (``is_said``)."""
        return [f for f in self.findings if is_said(f)]

    def plot(self, path: str, *, label: str = "") -> str:
        """Draw the report, titled ``label``, as a PNG (``plot.plot_reports``); returns ``path``."""
        return plot_reports([(label, self)], path)

    def __str__(self) -> str:
        return self.format()


def build_report(timeline: Timeline, config: RuleConfig) -> Report:
    """Judge ``timeline`` with every leak rule and wrap the result in a ``Report``."""
    return Report(timeline=timeline, findings=judge(timeline, config), config=config)


def report_from_dict(data: Mapping[str, Any]) -> Report:
    """Read back ``Report.to_dict``'s data; ``UsageError`` where it is not of this schema."""
    version = data.get("schema_version") if isinstance(data, Mapping) else None
    if version != SCHEMA_VERSION:  # an older layout names processes by create times
        raise UsageError(f"report data: expected schema_version {SCHEMA_VERSION}, got {version!r}")
    baseline = data.get("baseline") or {}
    fields = {**data, "baseline_devices": baseline.get("devices", [])}
    fields["baseline_gpu_bytes"] = baseline.get("gpu_bytes", {})
    if "session" in data:
        fields["session_id"] = data["session"]
    try:
        timeline: Timeline = record_from_dict(Timeline, fields)
        config: RuleConfig = record_from_dict(RuleConfig, data.get("config") or {})
        findings = tuple(record_from_dict(Finding, f) for f in data.get("findings") or ())
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UsageError(f"report data: malformed ({type(exc).__name__}: {exc})") from None
    return Report(timeline=timeline, findings=findings, config=config)


def _device_peak(timeline: Timeline) -> tuple[int, int] | None:
    seen: list[tuple[int, int]] = []
    for rec in timeline.epochs:
        peaks = dict(rec.device_peak_used_bytes)
        for dev in rec.devices:
            peaks[dev.index] = max(peaks.get(dev.index, 0), dev.used_bytes)
        seen += sorted(peaks.items())
    return max(seen, key=lambda item: item[1], default=None)


_GPU_RULES = frozenset(
    {
        "growth",
        "residual",
        "device-mismatch",
        "descriptor-holder",
        "context-kept",
        "high-clocks",
        "blind",
    }
)


def is_said(finding: Finding) -> bool:
    """Whether a text report writes the finding: every leak, and information one can act on.

    Not an unheld ``/dev/shm`` file nothing ties to the work, nor the copy-on-read note on
    spawned workers (true of every such loader): the JSON keeps them.
    """
    if finding.severity != "info":
        return True
    unheld_file = finding.rule == "shm" and finding.pid is None and finding.shm_name is not None
    return not (unheld_file or finding.rule == "copy-on-read")


def about_gpu(findings: Iterable[Finding]) -> bool:
    """Whether any finding is about GPUs, not only processes (a report says "GPU" then)."""
    return any(f.rule in _GPU_RULES or f.gpu_bytes or f.nvidia_fds for f in findings)


def leak_short(finding: Finding) -> str:
    """A few words for a leak in a verdict line: ``orphan rank 1 process PID 7 (612 MiB)``."""
    if finding.shm_name is not None:  # the file, also where a process holds it
        size = f" ({format_size(finding.size_bytes)})" if finding.size_bytes is not None else ""
        return f"{finding.rule} /dev/shm/{finding.shm_name}{size}"
    who, amount = "job", ""
    if finding.pid is not None:
        role = finding.role if finding.role and finding.role != finding.rule else None
        who = f"{rank_label(finding.rank)}{role or 'process'} PID {finding.pid}"
    elif finding.device_index is not None:
        who = f"GPU{finding.device_index}"
    if finding.bytes_per_epoch is not None:
        amount = f" ({format_mib(finding.bytes_per_epoch, signed=True)} MiB/epoch)"
    elif finding.gpu_bytes:
        amount = f" ({format_mib(finding.gpu_bytes)} MiB)"
    return f"{finding.rule} {who}{amount}"


def leaks_short(leaks: Sequence[Finding], shown: int = 3) -> str:
    """The first ``shown`` leaks' ``leak_short``, then ``; and N more``."""
    more = f"; and {len(leaks) - shown} more" if len(leaks) > shown else ""
    return "; ".join(leak_short(f) for f in leaks[:shown]) + more


_GPU_REASONS = (
    ("no NVIDIA driver", "no NVIDIA driver"),
    ("sees no NVIDIA GPU", "no NVIDIA GPU"),
    ("driver is not loaded", "NVIDIA driver not loaded"),
    ("no permission", "no permission to open /dev/nvidia*"),
    ("versions differ", "NVML and driver versions differ"),
)


def gpu_unchecked(reason: str) -> str:
    """``GPU: not checked (no NVIDIA driver)`` from NVML's one-line ``reason``, or empty."""
    short = next((words for marker, words in _GPU_REASONS if marker in reason), None)
    if short is None:
        short = reason.removeprefix("NVML unavailable: ").split(";")[0].strip() or "no GPU"
    return f"GPU: not checked ({cut(short, 60)})"


def or_dash(value: object | None, spec: str = "") -> str:
    """``value`` formatted with ``spec``, or ``-`` when it is unknown."""
    return "-" if value is None else format(value, spec)


@dataclass(frozen=True)
class EpochRow:
    """One epoch as the tables, the sweep's JSON and its plot show it (docs/REFERENCE.md).

    GPU bytes are summed over the watched devices, device fields are the reported device's;
    None where not read, and a workers' sum is None where any worker's figure is unknown.
    ``samples``, ``wait_s`` (inside ``next()``) and ``loop_s`` time the sweep's loop.
    """

    num_workers: int
    epoch: int
    label: str
    duration_s: float
    end_reason: str
    parent_gpu_bytes: int | None
    worker_count: int
    workers_gpu_bytes: int | None
    worker_gpu_bytes_max: int | None
    workers_gpu_bytes_peak: int | None
    alive_after: int
    orphans: int
    other_gpu_bytes: int | None
    workers_peak_reported: int | None = None
    workers_peak_unknown: int | None = None
    batches: int | None = None
    parent_host_bytes: int | None = None
    workers_host_bytes: int | None = None
    host_source: str | None = None
    workers_shared_bytes: int | None = None
    workers_copied_bytes: int | None = None
    shm_bytes: int | None = None
    device_used_bytes: int | None = None
    device_total_bytes: int | None = None
    temperature_c: int | None = None
    sm_clock_mhz: int | None = None
    power_w: float | None = None
    error: str | None = None
    samples: int | None = None
    wait_s: float | None = None
    loop_s: float | None = None

    @property
    def workers_peak_text(self) -> str:
        """The workers' GPU peak in MiB: ``?`` where a worker's is unknown, ``-`` not read."""
        return "?" if self.workers_peak_unknown else format_mib(self.workers_gpu_bytes_peak)

    @property
    def workers_host_text(self) -> str:
        """The workers' host memory in MiB: ``?`` where a worker's is unknown, ``-`` not read."""
        if self.host_source is not None and self.workers_host_bytes is None and self.worker_count:
            return "?"
        return format_mib(self.workers_host_bytes if self.host_source is not None else None)


_DEVICE_FIELDS = {
    "device_used_bytes": "used_bytes",
    "device_total_bytes": "total_bytes",
    "temperature_c": "temperature_c",
    "sm_clock_mhz": "sm_clock_mhz",
    "power_w": "power_w",
}


def epoch_row(
    record: EpochRecord,
    timeline: Timeline,
    counts: EpochCounts | None = None,
    *,
    num_workers: int = 0,
    device_index: int | None = None,
    timing: tuple[int | None, float, float] | None = None,
) -> EpochRow:
    """Fold one epoch record, what its end left running and its loop's timing into a row."""
    processes = record.processes
    parents = [p for p in processes if p.role == "parent"]
    workers = [p for p in processes if p.role == "worker"]
    worker_end = [p.total_gpu_bytes_end for p in workers]
    peaks = [p.total_gpu_bytes_peak for p in workers]  # None: unknown, never 0
    host = [p.host_bytes_end for p in workers]
    sources = {p.host_source for p in (*parents, *workers) if p.host_source is not None}
    copied = [p for p in workers if p.copied_bytes_end is not None]
    device = next((d for d in record.devices if device_index in (None, d.index)), None)
    samples, wait_s, loop_s = timing or (None, None, None)
    # peak >= end per process: the sums too
    peak = None if None in peaks else max(sum(p or 0 for p in peaks), sum(worker_end))
    gpu: dict[str, int | None] = {
        "parent_gpu_bytes": sum(p.total_gpu_bytes_end for p in parents) if parents else None,
        "workers_gpu_bytes": sum(worker_end),
        "worker_gpu_bytes_max": max(worker_end, default=0),
        "workers_gpu_bytes_peak": peak,
        "other_gpu_bytes": sum(
            p.total_gpu_bytes_end for p in processes if p.role in ("descendant", "orphan")
        ),
        "workers_peak_reported": sum(1 for p in workers if p.gpu_peak_source == "reported"),
        "workers_peak_unknown": sum(1 for p in workers if p.gpu_peak_source == "unknown"),
    }
    if not per_pid_bytes_known(timeline):
        gpu = dict.fromkeys(gpu)  # NVML's per-process figures are not this namespace's PIDs
    counts = counts or EpochCounts(0, 0)
    return EpochRow(
        num_workers=num_workers,
        epoch=record.index,
        label=record.label,
        duration_s=record.duration_s,
        end_reason=record.end_reason,
        worker_count=len(workers),
        alive_after=counts.alive_after,
        orphans=counts.orphans,
        batches=record.batches,
        shm_bytes=record.shm_bytes,
        error=record.error,
        parent_host_bytes=parents[0].host_bytes_end if parents else None,
        workers_host_bytes=None if None in host else sum(v or 0 for v in host),
        host_source="+".join(sorted(sources, reverse=True)) or None,
        workers_shared_bytes=sum(p.shared_bytes_end or 0 for p in copied) if copied else None,
        workers_copied_bytes=sum(p.copied_bytes_end or 0 for p in copied) if copied else None,
        samples=samples,
        wait_s=wait_s,
        loop_s=loop_s,
        **gpu,
        **{name: getattr(device, attr, None) for name, attr in _DEVICE_FIELDS.items()},
    )


def column_table(
    head: Sequence[str],
    rows: Sequence[Mapping[str, str]],
    empty: Collection[str],
    left: Collection[str] = (),
) -> list[str]:
    """Rows of cells by column name, aligned; a column after the third all ``empty`` goes."""
    shown = [h for i, h in enumerate(head) if i < 3 or any(r[h] not in empty for r in rows)]
    table = [shown, *([row[h] for h in shown] for row in rows)]
    return align_columns(table, {i for i, h in enumerate(shown) if h in left})


def align_columns(
    rows: Sequence[Sequence[str]], left: frozenset[int] | set[int] = frozenset()
) -> list[str]:
    """Lay out rows as columns two spaces apart; ``left`` columns are left-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    out = []
    for row in rows:
        cells = [
            cell.ljust(widths[i]) if i in left else cell.rjust(widths[i])
            for i, cell in enumerate(row)
        ]
        out.append("  ".join(cells).rstrip())
    return out


def _epoch_table(timeline: Timeline, config: RuleConfig) -> list[str]:
    """One row per epoch (and extra device): only the columns with data, as the sweep's."""
    counts = epoch_counts(timeline, config.grace_s)
    rows: list[dict[str, str]] = []
    for rec in timeline.epochs:
        row = epoch_row(rec, timeline, counts[rec.index])
        cells = {
            "epoch": str(rec.index),
            "label": rec.label if len(rec.label) <= 16 else rec.label[:13] + "...",
            "time s": f"{rec.duration_s:.1f}",
            "parent MiB": format_mib(row.parent_gpu_bytes),
            "workers": str(row.worker_count),
            "wk end MiB": format_mib(row.workers_gpu_bytes),
            "wk peak MiB": row.workers_peak_text,
            "alive after": str(row.alive_after),
            "orphans": str(row.orphans),
            "parent host MiB": format_mib(row.parent_host_bytes),
            "wk host MiB": row.workers_host_text,
            "host": row.host_source or "-",
            "pinned MiB": format_mib(rec.pinned_reserved_bytes),
        }
        devices: list[DeviceState | None] = [*sorted(rec.devices, key=lambda d: d.index)]
        for dev in devices or [None]:
            rows.append(cells | _device_cells(dev))
            cells = dict.fromkeys(cells, "")  # an extra device's row: its own cells only
    return column_table(list(rows[0]), rows, ("-", ""), ("label", "host", "GPU"))


def _device_cells(dev: DeviceState | None) -> dict[str, str]:
    if dev is None:
        return dict.fromkeys(("GPU", "used/total MiB", "temp C", "SM MHz", "power W"), "-")
    return {
        "GPU": f"GPU{dev.index}",
        "used/total MiB": f"{format_mib(dev.used_bytes)}/{format_mib(dev.total_bytes)}",
        "temp C": or_dash(dev.temperature_c),
        "SM MHz": or_dash(dev.sm_clock_mhz),
        "power W": or_dash(dev.power_w, ".0f"),
    }


def _process_lines(timeline: Timeline) -> list[str]:
    """Each epoch's processes, then those after the work; host memory at the end or at exit."""
    known = per_pid_bytes_known(timeline)
    groups = [(f"epoch {rec.index} ({rec.end_reason})", rec.processes) for rec in timeline.epochs]
    if timeline.final is not None:
        groups.append(("after the work", timeline.final.processes))
    lines: list[str] = []
    for title, procs in groups:
        lines += ["", f"{title}:"]
        rows = [["role", "PID", "GPU MiB", "peak MiB", "host MiB", "fds", "flags", "command"]]
        for p in procs:
            held = ",".join(f"GPU{d}:{format_mib(b)}" for d, b in sorted(p.gpu_bytes_end.items()))
            peak = "?" if p.total_gpu_bytes_peak is None else format_mib(p.total_gpu_bytes_peak)
            if p.gpu_peak_source == "reported" and p.total_gpu_bytes_peak is not None:
                peak += "*"
            flags = ["born"] if p.born_in_epoch else []
            flags += ["persistent"] if p.persistent else []
            flags += [] if p.alive_at_end else ["gone-at-end"]
            flags += [] if p.exited_after_s is None else [f"exited+{p.exited_after_s:.1f}s"]
            if p.last_seen_after_s is not None:
                # Seen last before the epoch's end sample by less than a rounding: +0.0, not -0.0.
                flags.append(f"seen+{max(0.0, p.last_seen_after_s):.1f}s")
            host = p.host_bytes_end
            rows.append([
                rank_label(p.rank) + p.role,
                str(p.key.pid),
                ("?" if p.gpu_bytes_unknown else held or "0") if known else "-",
                peak if known else "-",
                "-" if host is None else f"{format_mib(host)} {p.host_source}",
                or_dash(p.nvidia_fds),
                " ".join(flags) or "-",
                process_name(p.cmdline),
            ])  # fmt: skip
        if procs:
            lines.extend("  " + line for line in align_columns(rows, left={0, 6, 7}))
    return lines


def _teardown_lines(timeline: Timeline) -> list[str]:
    records = timeline.teardowns
    if not records:
        return []
    lines = ["", "worker teardowns:"]
    for rec in records:
        steps = []
        if rec.gpu_bytes_by_device:
            held = ", ".join(
                f"GPU{d} {format_mib(b)} MiB" for d, b in sorted(rec.gpu_bytes_by_device.items())
            )
            steps.append(f"held {held}")
        if rec.peak_reserved_bytes is not None:
            steps.append(f"torch peak reserved {format_mib(rec.peak_reserved_bytes)} MiB")
        if not rec.cuda_initialized:
            steps.append("no CUDA in this worker")
        elif not rec.released:
            steps.append("reported only (teardown policy off)")
        else:
            steps.append(f"freed cache {format_mib(rec.freed_cache_bytes)} MiB")
            steps.append("context released" if rec.context_released else "context kept")
        if rec.streams_joined:
            steps.append(f"{rec.streams_joined} side streams joined")
        if rec.left_nvml is not None:
            steps.append("left NVML" if rec.left_nvml else "still in NVML")
        if rec.error:
            steps.append(f"error: {rec.error}")
        worker = f" (worker {rec.worker_id})" if rec.worker_id is not None else ""
        steps.append(f"in {rec.duration_s * 1000:.0f} ms")
        lines.append(f"  PID {rec.key.pid}{worker}: {', '.join(steps)}")
    return lines


FINDING_WIDTH = 160
"""A finding's line is at most this many characters, its indent included."""
FIX_WIDTH = 120
"""A fix is at most this many characters, after ``fix: ``."""


def cut(line: str, width: int) -> str:
    """``line``, or its first ``width`` characters ending in ``…`` where it is longer."""
    return line if len(line) <= width else line[: width - 1].rstrip() + ELLIPSIS


def _culprit_and_what(finding: Finding) -> tuple[str | None, str]:
    if finding.pid is None:
        return None, finding.message
    who = culprit(finding.role, finding.pid, finding.cmdline, rank=finding.rank, rule=finding.rule)
    if finding.message.startswith(who + " "):
        return who, finding.message[len(who) + 1 :]
    return None, finding.message


def _fix_template(finding: Finding) -> str:
    """A finding's fix without its ``kill PID`` (its remedy where it has none)."""
    tail = f"kill {finding.pid}"
    if finding.pid is not None and finding.remedy.endswith(tail):
        return finding.remedy[: -len(tail)]
    return finding.remedy


def _kill_fix(template: str, pids: Sequence[int]) -> str:
    """``<template>kill 11 12 13``, as many PIDs as ``FIX_WIDTH`` holds (then ``…``)."""
    text = f"{template}kill"
    for index, pid in enumerate(pids):
        room = FIX_WIDTH - (2 if index < len(pids) - 1 else 0)  # for a closing " …"
        if len(text) + 1 + len(str(pid)) > room:
            return f"{text} {ELLIPSIS}"
        text += f" {pid}"
    return text


_STACK_ROWS = 60  # of a finding's stack in a text report (JSON keeps it whole)
_FRAME = re.compile(r'^(\s*File ")([^"]+)(", line \d+.*)$')  # a frame: file, line, function


def _stack_row(row: str, room: int) -> str:
    """A stack row in ``room`` characters: a long file path loses its folders first."""
    # Never its line and function: a checkout under a long path would cut those off.
    row = row.rstrip()
    frame = _FRAME.match(row)
    if frame is None or len(row) <= room:
        return cut(row, room)
    head, path, tail = frame.groups()
    name = "/".join(path.split("/")[-2:])
    return cut(f"{head}{ELLIPSIS}/{name}{tail}", room)


def finding_lines(
    findings: Sequence[Finding],
    indent: str = "",
    *,
    loader: str | None = None,
    worker_ids: Mapping[int, int] | None = None,
) -> list[str]:
    """The findings as a person reads them (NOTE [one line per finding] in verdict.py).

    Findings alike but for their PIDs share a line, lines with one fix share it (its ``kill``
    naming all their PIDs). ``loader`` and ``worker_ids`` (by PID) name the workers.
    """
    # Lines by fix, then by what a person reads: a process's name, not its arguments (two
    # helpers whose arguments differ are one cause).
    groups: dict[tuple[str, str, str], dict[tuple[object, ...], list[Finding]]] = {}
    for index, finding in enumerate(findings):
        who, what = _culprit_and_what(finding)
        name = process_name(finding.cmdline)
        alike = (finding.role, finding.rank, name, what) if who is not None else (index,)
        by_fix = (finding.severity, finding.rule, _fix_template(finding))
        groups.setdefault(by_fix, {}).setdefault(alike, []).append(finding)
    out: list[str] = []
    ids = worker_ids or {}
    for (severity, rule, template), lines in groups.items():
        tag = "LEAK" if severity == "leak" else "info"
        killed: list[int] = []
        for line in lines.values():
            f = line[0]
            who, text = _culprit_and_what(f)
            pids = [g.pid for g in line if g.pid is not None] if who is not None else []
            if pids:
                worker_id = ids.get(pids[0]) if len(pids) == 1 else None
                named = culprits(
                    f.role, pids, f.cmdline, rank=f.rank, rule=f.rule, worker_id=worker_id,
                    loader=loader,
                )  # fmt: skip
                text = f"{named} {text}"
            out.append(cut(f"{indent}{tag} {rule}  {text}", FINDING_WIDTH))
            if f.stack:  # a crashed worker's own Python stack, as its faulthandler wrote it
                rows = f.stack.splitlines()[:_STACK_ROWS]
                room = FINDING_WIDTH - len(indent) - 4
                out.extend(f"{indent}    {_stack_row(row, room)}" for row in rows)
            if template != f.remedy:  # its fix ends in ``kill PID``
                killed.extend(pids or ([f.pid] if f.pid is not None else []))
        fix = _kill_fix(template, killed) if killed else template
        out.append(f"{indent}  fix: {cut(fix, FIX_WIDTH)}")
    return out
