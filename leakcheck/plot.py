"""A picture of a sweep: memory per epoch by process role, processes, thermal state.

One column per configuration (worker count), three panels each, sharing the epoch axis:

1. GPU memory at the end of each epoch, stacked by role (parent, workers, descendants and
   orphans), with the device's used memory as a line: a leak is a staircase.
2. Processes: workers seen, processes still alive after the epoch, orphans (host side, so
   this panel is drawn without a GPU too).
3. Thermal state: GPU temperature (left axis) and SM clock (right axis).

matplotlib is imported only here, and only its object-oriented API with the Agg canvas is
used: drawing a sweep never changes the backend of the caller's ``pyplot``.
"""

from __future__ import annotations

import io
import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from leakcheck.files import write_atomic
from leakcheck.model import MIB
from leakcheck.sweep import short_reason

if TYPE_CHECKING:
    from leakcheck.sweep import ConfigResult, SweepResult

# Colour-blind-safe (Okabe-Ito) colours, one per role/series.
_PARENT = "#0072B2"
_WORKERS = "#E69F00"
_OTHERS = "#D55E00"
_DEVICE = "#000000"
_ALIVE = "#CC79A7"
_ORPHANS = "#D55E00"
_TEMPERATURE = "#D55E00"
_CLOCK = "#009E73"
_VERDICT_COLOURS = {"clean": "#009E73", "leak": "#D55E00", "blind": "#E69F00"}


def _mib(values: Sequence[int | None]) -> list[float]:
    return [0.0 if value is None else value / MIB for value in values]


def _config_title(config: ConfigResult) -> str:
    if config.num_workers == 0:
        head = "0 workers (parent does the work)"
    else:
        mode = "persistent" if config.persistent_workers else "new each epoch"
        head = f"{config.num_workers} workers ({mode})"
    leaks = len(config.report.leaks)
    verdict = config.report.verdict
    tail = f"{verdict.upper()}: {leaks} leak{'s' if leaks != 1 else ''}" if leaks else verdict
    return f"{head}\nverdict: {tail}"


def _note(axes: Any, text: str) -> None:
    axes.text(
        0.5,
        0.5,
        "\n".join(textwrap.wrap(text, 38)),
        transform=axes.transAxes,
        ha="center",
        va="center",
        fontsize=8,
        color="#555555",
    )


def _memory_panel(axes: Any, config: ConfigResult, reason: str) -> None:
    rows = config.rows
    epochs = [row.epoch for row in rows]
    axes.set_ylabel("GPU memory (MiB)")
    per_process = any(row.parent_gpu_bytes is not None for row in rows)
    if not rows or not per_process:
        if rows:
            used = _mib([row.device_used_bytes for row in rows])
            axes.plot(epochs, used, color=_DEVICE, marker="o", label="device used")
            _note(axes, "per-process memory unknown: " + config.report.timeline.attribution_reason)
        else:
            axes.set_yticks([])
            _note(axes, "GPU memory not measured: " + short_reason(reason))
        return
    parent = _mib([row.parent_gpu_bytes for row in rows])
    workers = _mib([row.workers_gpu_bytes for row in rows])
    others = _mib([row.other_gpu_bytes for row in rows])
    axes.bar(epochs, parent, color=_PARENT, label="parent, at epoch end")
    axes.bar(epochs, workers, bottom=parent, color=_WORKERS, label="workers (sum), at epoch end")
    bottom = [a + b for a, b in zip(parent, workers, strict=True)]
    axes.bar(
        epochs,
        others,
        bottom=bottom,
        color=_OTHERS,
        hatch="//",
        label="descendants + orphans,\nat epoch end",
    )
    # Workers started per epoch are gone at its end: their peak shows what they held.
    peaks = [row.workers_gpu_bytes_peak for row in rows]
    if any(peaks):
        axes.plot(
            epochs,
            _mib(peaks),
            color=_WORKERS,
            marker="D",
            linestyle="--",
            linewidth=1.0,
            label="workers' peak during epoch",
        )
    device_used = [row.device_used_bytes for row in rows]
    if any(value is not None for value in device_used):
        axes.plot(
            epochs,
            _mib(device_used),
            color=_DEVICE,
            marker="o",
            linewidth=1.2,
            label="device used at epoch end\n(all processes)",
        )
    axes.set_ylim(bottom=0)


def _process_panel(axes: Any, config: ConfigResult) -> None:
    rows = config.rows
    axes.set_ylabel("processes")
    # Grouped bars, not lines: the three counts are often equal and lines would hide
    # each other.
    series = (
        ("worker processes", [r.worker_count for r in rows], _WORKERS, ""),
        ("alive after epoch + grace", [r.alive_after for r in rows], _ALIVE, ".."),
        ("orphans alive", [r.orphans for r in rows], _ORPHANS, "//"),
    )
    width = 0.26
    for offset, (label, values, colour, hatch) in zip((-width, 0.0, width), series, strict=True):
        axes.bar(
            [row.epoch + offset for row in rows],
            values,
            width=width,
            color=colour,
            hatch=hatch,
            edgecolor="white",
            label=label,
        )
    top = max([1] + [max(r.worker_count, r.alive_after, r.orphans) for r in rows])
    axes.set_ylim(0, top * 1.15 + 0.2)
    axes.yaxis.get_major_locator().set_params(integer=True)


def _thermal_panel(axes: Any, config: ConfigResult) -> Any:
    rows = config.rows
    epochs = [row.epoch for row in rows]
    axes.set_ylabel("GPU temperature (°C)", color=_TEMPERATURE)
    temperatures = [row.temperature_c for row in rows]
    clocks = [row.sm_clock_mhz for row in rows]
    clock_axes = axes.twinx()
    clock_axes.set_ylabel("SM clock (MHz)", color=_CLOCK)
    if all(value is None for value in temperatures + clocks):
        axes.set_yticks([])
        clock_axes.set_yticks([])
        _note(axes, "temperature and clock not measured (no GPU)")
        return clock_axes
    axes.plot(
        epochs,
        [float("nan") if t is None else t for t in temperatures],
        color=_TEMPERATURE,
        marker="o",
        label="temperature",
    )
    clock_axes.plot(
        epochs,
        [float("nan") if c is None else c for c in clocks],
        color=_CLOCK,
        marker="d",
        linestyle="--",
        label="SM clock",
    )
    axes.tick_params(axis="y", colors=_TEMPERATURE)
    clock_axes.tick_params(axis="y", colors=_CLOCK)
    clock_axes.set_ylim(bottom=0)
    return clock_axes


def _row_legend(axes_list: Sequence[Any], title: str) -> None:
    handles: dict[str, Any] = {}
    for axes in axes_list:
        for handle, label in zip(*axes.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    if not handles:
        return
    # Patches (bars) first, in drawing order, then lines: matplotlib lists lines first.
    ordered = sorted(handles.items(), key=lambda item: hasattr(item[1], "get_xydata"))
    handles = dict(ordered)
    anchor = axes_list[0]
    # Right of the row's last panel (past a twin axis' labels), so it never hides data.
    anchor.legend(
        list(handles.values()),
        list(handles.keys()),
        title=title,
        loc="center left",
        bbox_to_anchor=(1.22 if len(axes_list) > 1 else 1.03, 0.5),
        fontsize=8,
        title_fontsize=8,
        frameon=False,
    )


def render(result: SweepResult) -> Any:
    """Draw the sweep; returns a ``matplotlib.figure.Figure`` (Agg canvas attached).

    Without a GPU only the process panel carries data: it is drawn alone, and the title
    says why the GPU panels are missing.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    configs = result.configs
    columns = max(len(configs), 1)
    gpu = result.gpu_available
    figure = Figure(figsize=(4.2 * columns + 1.6, 9.0 if gpu else 4.6), layout="constrained")
    FigureCanvasAgg(figure)
    if gpu:
        grid = figure.subplots(
            3, columns, squeeze=False, sharex="col", gridspec_kw={"height_ratios": [3, 1.4, 1.6]}
        )
        memory_row, process_row, thermal_row = list(grid[0]), list(grid[1]), list(grid[2])
    else:
        grid = figure.subplots(1, columns, squeeze=False)
        memory_row, process_row, thermal_row = [], list(grid[0]), []
    clock_row: list[Any] = []
    for column, config in enumerate(configs):
        top = memory_row[column] if gpu else process_row[column]
        top.set_title(
            _config_title(config),
            fontsize=10,
            color=_VERDICT_COLOURS.get(config.report.verdict, "#000000"),
        )
        panels = [process_row[column]]
        _process_panel(process_row[column], config)
        if gpu:
            _memory_panel(memory_row[column], config, result.gpu_reason)
            clock_row.append(_thermal_panel(thermal_row[column], config))
            panels += [memory_row[column], thermal_row[column], clock_row[-1]]
        bottom = thermal_row[column] if gpu else process_row[column]
        bottom.set_xlabel("epoch")
        bottom.set_xticks([row.epoch for row in config.rows])
        for axes in panels:
            axes.grid(axis="y", alpha=0.3)
    # One memory scale for every configuration, so that they compare at a glance.
    tops = [axes.get_ylim()[1] for axes in memory_row if axes.has_data()]
    for axes in memory_row:
        if tops and axes.has_data():
            axes.set_ylim(0, max(tops) * 1.08)
    last = columns - 1
    if gpu:
        _row_legend([memory_row[last]], "GPU memory")
        _row_legend([thermal_row[last], clock_row[last]], "GPU thermal state")
    _row_legend([process_row[last]], "processes")
    options = result.options
    what = "GPU memory per epoch by process role" if gpu else "processes per epoch"
    lines = [
        f"leakcheck sweep: {what} "
        f"({','.join(str(n) for n in options.workers)} workers x {options.epochs} epochs)",
        *textwrap.wrap(result.loader, 40 * columns + 30),
    ]
    if not gpu:
        lines += textwrap.wrap(
            "GPU memory, temperature and clock not measured: " + short_reason(result.gpu_reason),
            40 * columns + 30,
        )
    figure.suptitle("\n".join(lines), fontsize=10)
    return figure


def plot_sweep(result: SweepResult, path: str, *, dpi: int = 110) -> str:
    """Write the sweep's picture as a PNG, atomically (a reader never sees half a file).

    Args:
        result: The sweep.
        path: Target ``.png`` file.
        dpi: Resolution.

    Returns:
        ``path``.

    """
    figure = render(result)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    write_atomic(path, buffer.getvalue())
    return path
