"""Pictures of a sweep and of reports (matplotlib's object API on an Agg canvas only).

A sweep: a column per configuration: GPU memory at epoch ends stacked by role, the device's
as a line (a leak is a staircase; an unknown workers' peak is a gap and a "?", never a 0);
host memory as a report's (NOTE [report picture]) with one forked worker's private and shared
memory (NOTE [copy on read] in hostmem.py); processes; GPU temperature and SM clock.
"""

from __future__ import annotations

import importlib.util
import io
import math
import os
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from leakcheck.core.errors import UsageError
from leakcheck.core.files import write_atomic
from leakcheck.core.model import MIB
from leakcheck.core.units import plural

if TYPE_CHECKING:
    from leakcheck.core.model import EpochRecord, Finding, ProcessEpoch, Timeline

__all__ = ["plot_reports", "plot_sweep", "render", "render_reports", "report_series"]


# The sweep sits above this layer: its result (``commands.sweep.SweepResult``) and its
# configs (``ConfigResult``) are read by attribute, never imported.
_Sweep = Any
_Config = Any


class _Report(Protocol):
    """A judged report (``leakcheck.judge.report.Report``, which imports this module)."""

    @property
    def timeline(self) -> Timeline: ...
    @property
    def leaks(self) -> list[Finding]: ...
    @property
    def verdict(self) -> str: ...
    @property
    def epochs(self) -> tuple[EpochRecord, ...]: ...


# Colour-blind-safe (Okabe-Ito) colours, one per role/series.
_PARENT = "#0072B2"
_WORKERS = "#E69F00"
_OTHERS = "#D55E00"
_DEVICE = "#000000"
_ALIVE = "#CC79A7"
_ORPHANS = "#D55E00"
_TEMPERATURE = "#D55E00"
_CLOCK = "#009E73"
_SHARED = "#56B4E9"
_VERDICT_COLOURS = {"clean": "#009E73", "leak": "#D55E00", "blind": "#E69F00"}


def _gaps(values: Sequence[float | None], unit: float = 1.0) -> list[float]:
    """Values in ``unit``; an unknown one is NaN (a gap in a line), never 0."""
    return [math.nan if value is None else value / unit for value in values]


def _bars(values: Sequence[int | None]) -> list[float]:
    """MiB of stacked bars: 0 where not known (a gap in a stack would misplace those above)."""
    return [0.0 if value is None else value / MIB for value in values]


def _per_worker(row: Any, value: int | None) -> float:
    """MiB of one worker's share of a row's sum; NaN where not known."""
    return math.nan if value is None or not row.worker_count else value / MIB / row.worker_count


def _config_title(config: _Config) -> str:
    if config.num_workers == 0:
        head = "0 workers (parent does the work)"
    else:
        mode = "persistent" if config.persistent_workers else "new each epoch"
        head = f"{config.num_workers} workers ({mode})"
    rate, share = config.throughput["samples_per_s"], config.throughput["wait_share"]
    speed = "" if rate is None else f"\n{rate:,.0f} samples/s"
    if speed and share is not None:
        speed += f", {share:.0%} of the loop waiting"
    return f"{head}\n{_verdict_text(config.report)}{speed}"


def _figure(width: float, height: float) -> Any:
    """A ``Figure`` on its own Agg canvas (never the caller's ``pyplot`` backend)."""
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError(
            "plot: needs matplotlib, which is not installed (pip install "
            "'dataloader-leakcheck[plot]')"
        )
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _note(axes: Any, text: str, *, empty: bool = False) -> None:
    """Grey words in the middle of ``axes`` (``empty``: no data, so no y ticks either)."""
    if empty:
        axes.set_yticks([])
    wrapped = "\n".join(textwrap.wrap(text, 38))
    axes.text(
        0.5, 0.5, wrapped, transform=axes.transAxes, ha="center", va="center", fontsize=8,
        color="#555555",
    )  # fmt: skip


def _memory_panel(axes: Any, config: _Config, reason: str) -> None:
    """GPU memory at epoch ends stacked by role (the workers' peak on the parent), in MiB."""
    rows = config.rows
    epochs = [row.epoch for row in rows]
    axes.set_ylabel("GPU memory (MiB)")
    if not any(row.parent_gpu_bytes is not None for row in rows):
        if rows:
            used = _gaps([row.device_used_bytes for row in rows], MIB)
            axes.plot(epochs, used, color=_DEVICE, marker="o", label="device used")
            _note(axes, "per-process memory unknown: " + config.report.timeline.attribution_reason)
        else:
            _note(axes, "GPU memory not measured: " + (reason or "no GPU"), empty=True)
        return
    parent = _bars([r.parent_gpu_bytes for r in rows])
    workers = _bars([r.workers_gpu_bytes for r in rows])
    tops = [p + w for p, w in zip(parent, workers, strict=True)]
    axes.bar(epochs, parent, color=_PARENT, label="parent, at epoch end")
    axes.bar(epochs, workers, bottom=parent, color=_WORKERS, label="workers (sum), at epoch end")
    others = _bars([r.other_gpu_bytes for r in rows])
    label = "descendants + orphans,\nat epoch end"
    axes.bar(epochs, others, bottom=tops, color=_OTHERS, hatch="//", label=label)
    unknown = [r.workers_gpu_bytes_peak is None or bool(r.workers_peak_unknown) for r in rows]
    # Workers started per epoch are gone at its end: their peak shows what they held. It is
    # stacked on the parent like the workers' bar, so it never runs below that bar's top.
    if any(row.worker_count for row in rows):
        peaks = [
            math.nan if gone else max(base + row.workers_gpu_bytes_peak / MIB, top)
            for row, base, top, gone in zip(rows, parent, tops, unknown, strict=True)
        ]
        axes.plot(
            epochs, peaks, color=_WORKERS, marker="D", linestyle="--", linewidth=1.0,
            label="parent + workers' peak\nduring epoch",
        )  # fmt: skip
    if any(unknown):  # a "?" on each such bar: not 0, not left out
        axes.plot(
            [epoch for epoch, gone in zip(epochs, unknown, strict=True) if gone],
            [top for top, gone in zip(tops, unknown, strict=True) if gone],
            linestyle="none", marker="$?$", markersize=11, color=_DEVICE,
            label="workers' peak unknown (a worker\nexited unseen, reported nothing)",
        )  # fmt: skip
    device_used = [row.device_used_bytes for row in rows]
    if any(value is not None for value in device_used):
        axes.plot(
            epochs, _gaps(device_used, MIB), color=_DEVICE, marker="o", linewidth=1.2,
            label="device used at epoch end\n(all processes)",
        )  # fmt: skip
    axes.set_ylim(bottom=0)


def _host_panel(axes: Any, config: _Config) -> None:
    """The report picture's host panel (NOTE [report picture]), with the copy lines."""
    rows = config.rows
    if not rows or all(row.host_source is None for row in rows):
        _note(axes, "host memory not read", empty=True)
        return
    _report_panel(axes, config.report, report_series(config.report), "host")
    if any(row.workers_copied_bytes is not None for row in rows):
        private = [
            _per_worker(r, r.workers_host_bytes)
            if r.workers_shared_bytes is not None and r.host_source == "uss"
            else math.nan
            for r in rows
        ]
        epochs = [row.epoch for row in rows]
        axes.plot(
            epochs, private, color=_WORKERS, marker="s", linewidth=1.0,
            label="one worker: private",
        )  # fmt: skip
        axes.plot(
            epochs, [_per_worker(r, r.workers_shared_bytes) for r in rows], color=_SHARED,
            marker="s", linestyle=":", linewidth=1.2,
            label="one worker: still shared\nwith the parent",
        )  # fmt: skip


def _process_panel(axes: Any, config: _Config) -> None:
    rows = config.rows
    axes.set_ylabel("processes")
    # Grouped bars, not lines: the three counts are often equal and lines would hide each other.
    series = (
        ("worker processes", [r.worker_count for r in rows], _WORKERS, ""),
        ("alive after epoch + grace", [r.alive_after for r in rows], _ALIVE, ".."),
        ("orphans alive", [r.orphans for r in rows], _ORPHANS, "//"),
    )
    width = 0.26
    for offset, (label, values, colour, hatch) in zip((-width, 0.0, width), series, strict=True):
        axes.bar(
            [row.epoch + offset for row in rows], values, width=width, color=colour, hatch=hatch,
            edgecolor="white", label=label,
        )  # fmt: skip
    top = max([1] + [max(r.worker_count, r.alive_after, r.orphans) for r in rows])
    axes.set_ylim(0, top * 1.15 + 0.2)
    axes.yaxis.get_major_locator().set_params(integer=True)


def _thermal_panel(axes: Any, config: _Config) -> Any:
    rows = config.rows
    axes.set_ylabel("GPU temperature (°C)", color=_TEMPERATURE)
    temperatures = [row.temperature_c for row in rows]
    clocks = [row.sm_clock_mhz for row in rows]
    clock_axes = axes.twinx()
    clock_axes.set_ylabel("SM clock (MHz)", color=_CLOCK)
    if all(value is None for value in temperatures + clocks):
        clock_axes.set_yticks([])
        _note(axes, "temperature and clock not measured (no GPU)", empty=True)
        return clock_axes
    epochs = [row.epoch for row in rows]
    axes.plot(epochs, _gaps(temperatures), color=_TEMPERATURE, marker="o", label="temperature")
    clock_axes.plot(
        epochs, _gaps(clocks), color=_CLOCK, marker="d", linestyle="--", label="SM clock"
    )
    axes.tick_params(axis="y", colors=_TEMPERATURE)
    clock_axes.tick_params(axis="y", colors=_CLOCK)
    clock_axes.set_ylim(bottom=0)
    return clock_axes


def _row_legend(axes_list: Sequence[Any], title: str, *, x: float = 1.03) -> None:
    """A row's legend right of its last panel (``x``: past a twin axis' labels): hides no data."""
    handles: dict[str, Any] = {}
    for axes in axes_list:
        for handle, label in zip(*axes.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    if not handles:
        return
    # Patches (bars) first, in drawing order, then lines: matplotlib lists lines first.
    ordered = sorted(handles.items(), key=lambda item: hasattr(item[1], "get_xydata"))
    axes_list[0].legend(
        [handle for _, handle in ordered], [label for label, _ in ordered], title=title,
        loc="center left", bbox_to_anchor=(x, 0.5), fontsize=8, title_fontsize=8, frameon=False,
    )  # fmt: skip


def render(result: _Sweep) -> Any:
    """Draw the sweep; a ``Figure`` (Agg canvas). Without a GPU, host and process panels."""
    columns = max(len(result.configs), 1)
    gpu = result.gpu_available
    kinds = ("memory", "host", "processes", "thermal") if gpu else ("host", "processes")
    figure = _figure(4.2 * columns + 1.6, 11.5 if gpu else 6.6)
    ratios = [3, 2, 1.4, 1.6] if gpu else [2.4, 1.4]
    grid = figure.subplots(
        len(kinds), columns, squeeze=False, sharex="col", gridspec_kw={"height_ratios": ratios}
    )
    rows = {kind: list(grid[i]) for i, kind in enumerate(kinds)}
    clocks: list[Any] = []
    for column, config in enumerate(result.configs):
        axes = {kind: rows[kind][column] for kind in kinds}
        colour = _VERDICT_COLOURS.get(config.report.verdict, "#000000")
        axes[kinds[0]].set_title(_config_title(config), fontsize=10, color=colour)
        _process_panel(axes["processes"], config)
        _host_panel(axes["host"], config)
        if gpu:
            _memory_panel(axes["memory"], config, result.gpu_reason)
            clocks.append(_thermal_panel(axes["thermal"], config))
        axes[kinds[-1]].set_xlabel("epoch")
        axes[kinds[-1]].set_xticks([row.epoch for row in config.rows])
        for panel in [*axes.values(), *clocks[column:]]:
            panel.grid(axis="y", alpha=0.3)
    # One memory scale per row for every configuration, so that they compare at a glance.
    for row_axes in (rows.get("memory", []), rows["host"]):
        tops = [axes.get_ylim()[1] for axes in row_axes if axes.has_data()]
        for axes in row_axes:
            if tops and axes.has_data():
                axes.set_ylim(0, max(tops) * 1.08)
    if gpu:
        _row_legend([rows["memory"][-1]], "GPU memory")
        _row_legend([rows["thermal"][-1], clocks[-1]], "GPU thermal state", x=1.22)
    _row_legend([rows["host"][-1]], "host memory")
    _row_legend([rows["processes"][-1]], "processes")
    width = 40 * columns + 30
    what = "GPU and host memory" if gpu else "host memory and processes"
    workers = ",".join(str(n) for n in result.options.workers)
    lines = [
        f"leakcheck sweep: {what} per epoch{' by process role' if gpu else ''} "
        f"({workers} workers x {result.options.epochs} epochs)",
        *textwrap.wrap(result.loader, width),
    ]
    if not gpu:
        reason = result.gpu_reason or "no GPU"
        lines += textwrap.wrap(f"GPU memory, temperature and clock not measured: {reason}", width)
    if result.recommendation_line:
        lines += textwrap.wrap(result.recommendation_line, width)
    figure.suptitle("\n".join(lines), fontsize=10)
    return figure


def plot_sweep(result: _Sweep, path: str) -> str:
    """Write the sweep's picture as a PNG, atomically; returns ``path``."""
    return _write_png(render, result, path)


def _write_png(draw: Callable[[Any], Any], what: Any, path: str) -> str:
    # Another name would hold PNG bytes under a name that says otherwise (x.svg, x.pdf).
    if not os.fspath(path).lower().endswith(".png"):
        raise UsageError(f"plot: expected a file name ending in .png, got {path!r}")
    figure = draw(what)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    write_atomic(path, buffer.getvalue())
    return path


# NOTE [report picture]: a report (``watch()``'s, a stage of the Lightning callback, each
# loader of ``leakcheck run``) is drawn as one column: GPU memory (where NVML attributes it
# to processes) above host memory, one point per epoch end (the x axis names the epochs),
# one line per process group and measure. A measure never changes along a line: RSS (read
# at every epoch end) is solid, USS (read where the pacing allowed, NOTE [host pacing]) is
# dashed with a gap where it was not read, as is any value not known (never a 0). Each
# leak is a red cross on its culprit's group at its epoch, named by its rule.

_GROUPS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("parent", ("parent",), _PARENT),
    ("workers", ("worker",), _WORKERS),
    ("others", ("descendant", "orphan"), _OTHERS),
)
_HOST_RULES = frozenset(("host-growth", "copy-on-read", "shm"))


def _summed(values: Sequence[int | None]) -> float:
    """MiB of a group's values; NaN where one is unknown (a gap), never a partial sum."""
    if any(value is None for value in values):
        return math.nan
    return sum(value or 0 for value in values) / MIB


def report_series(report: _Report) -> Mapping[str, Mapping[str, list[float]]]:
    """One report's lines in MiB, one value per epoch: ``{"parent": {"rss": [...]}, ...}``.

    Measures ``rss``, ``uss`` and, where NVML attributes memory to processes, ``gpu``.
    """
    from leakcheck.judge.verdict import per_pid_bytes_known

    measures: dict[str, Callable[[ProcessEpoch], int | None]] = {
        "rss": lambda p: p.rss_bytes_end,
        "uss": lambda p: p.host_bytes_end if p.host_source == "uss" else None,
    }
    if per_pid_bytes_known(report.timeline):  # a worker's peak: what it held, gone by the end
        measures["gpu"] = lambda p: (
            p.total_gpu_bytes_peak if p.role == "worker" else p.total_gpu_bytes_end
        )
    series: dict[str, dict[str, list[float]]] = {}
    for group, roles, _colour in _GROUPS:
        per_epoch = [[p for p in e.processes if p.role in roles] for e in report.epochs]
        if not any(per_epoch):
            continue
        series[group] = {
            name: [_summed([read(p) for p in procs]) if procs else math.nan for procs in per_epoch]
            for name, read in measures.items()
        }
    return series


def _report_panel(
    axes: Any, report: _Report, series: Mapping[str, Mapping[str, list[float]]], panel: str
) -> None:
    epochs = list(range(len(report.epochs)))
    styles = {"gpu": "-"} if panel == "gpu" else {"rss": "-", "uss": "--"}
    for group, _roles, colour in _GROUPS:
        lines = series.get(group, {})
        for measure in (m for m in styles if m in lines):
            name = "GPU peak" if measure == "gpu" and group == "workers" else measure.upper()
            axes.plot(
                epochs, lines[measure], styles[measure], marker="o", markersize=3, color=colour,
                label=f"{group} {name}",
            )  # fmt: skip
    gpu = "gpu" in next(iter(series.values()), {})
    for finding in report.leaks:
        # Marked on its group's line of the measure its rule reads (host: USS where read).
        on_host = finding.rule in _HOST_RULES or finding.host_bytes is not None or not gpu
        if on_host != (panel == "host"):
            continue
        last = len(epochs) - 1
        epoch = last if finding.epoch is None else min(finding.epoch, last)
        group = next((g for g, roles, _ in _GROUPS if finding.role in roles), "parent")
        lines = series.get(group, {})
        measured = [lines.get(m, []) for m in (("uss", "rss") if on_host else ("gpu",))]
        height = next((ln[epoch] for ln in measured if ln and not math.isnan(ln[epoch])), 0.0)
        axes.plot([epoch], [height], "X", color="#D00000", markersize=10, label="leak")
        axes.annotate(
            finding.rule, (epoch, height), textcoords="offset points", xytext=(4, 6),
            fontsize=8, color="#D00000",
        )  # fmt: skip
    axes.set_ylabel("GPU memory (MiB)" if panel == "gpu" else "host memory (MiB)")
    axes.set_ylim(bottom=0)
    axes.grid(axis="y", alpha=0.3)


def _verdict_text(report: _Report) -> str:
    if report.leaks:
        return f"verdict: {report.verdict.upper()}: {plural(len(report.leaks), 'leak')}"
    return f"verdict: {report.verdict}"


def render_reports(reports: Sequence[tuple[str, _Report]]) -> Any:
    """Draw ``(label, report)`` pairs side by side (NOTE [report picture]); a ``Figure``."""
    columns = max(len(reports), 1)
    drawn = [(label, report, report_series(report)) for label, report in reports]
    gpu = any("gpu" in lines for _, _, series in drawn for lines in series.values())
    panels = ["gpu", "host"] if gpu else ["host"]
    figure = _figure(4.6 * columns + 1.8, 3.4 * len(panels) + 1.2)
    grid = figure.subplots(len(panels), columns, squeeze=False, sharex="col")
    for column, (label, report, series) in enumerate(drawn):
        for row, panel in enumerate(panels):
            axes = grid[row][column]
            if not report.epochs:
                _note(axes, "no epochs")
                continue
            _report_panel(axes, report, series, panel)
        title = "\n".join(part for part in (label, _verdict_text(report)) if part)
        colour = _VERDICT_COLOURS.get(report.verdict, "#000000")
        grid[0][column].set_title(title, fontsize=10, color=colour)
        labels = [e.label for e in report.epochs]
        grid[-1][column].set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
        grid[-1][column].set_xlabel("epoch end")
    for row, panel in enumerate(panels):
        # Every column's lines and marks, right of the last column.
        axes_row = [grid[row][columns - 1], *grid[row][: columns - 1]]
        _row_legend(axes_row, "GPU memory" if panel == "gpu" else "host memory")
    lines = ["leakcheck: memory per epoch end by process group (RSS solid, USS dashed)"]
    if not gpu:
        reason = (reports[0][1].timeline.attribution_reason if reports else "") or "no GPU"
        lines += textwrap.wrap(f"GPU memory not drawn: {reason}", 40 * columns + 40)
    figure.suptitle("\n".join(lines), fontsize=10)
    return figure


def plot_reports(reports: Sequence[tuple[str, _Report]], path: str) -> str:
    """Write ``render_reports``' picture as a PNG, atomically; returns ``path``."""
    return _write_png(render_reports, reports, path)
