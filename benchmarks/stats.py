"""Small statistics for the loader benchmarks: medians, bootstrap intervals, verdicts.

Two ways to measure what leakcheck costs a loop, reported side by side by
``bench_watch.py`` and ``bench_sweep.py``:

A/B ratio. Per round, one block with leakcheck and one without, adjacent in time (the order
alternates per round), give a speed ratio (with / without). Its median over rounds, with a
95% bootstrap interval of that median, is the slowdown. It measures everything, but on a
noisy machine its round-to-round spread can be many times wider than a 1% goal: then the
interval says so, and the verdict is "not resolved".

Accounted cost. What leakcheck itself spent, measured directly, over the wall time of the
block: the calling thread's wall time inside tracker calls, paid in full, plus the
background sampler thread's CPU time, plus a per-batch generator step. On a machine with
spare cores the sampler can delay the training thread only while it holds the GIL, which
is at most its CPU time (its /proc reads and NVML calls release the GIL), so this sum bounds
what the training thread itself pays, and unlike the A/B ratio it does not drown in
round-to-round noise.
What it leaves out: cache and memory-bandwidth interference, the latency of handing the GIL
back, core contention where there are no spare cores (a 2-core machine running workers is
not one), and waits that leakcheck's NVML calls cause in other processes inside the driver.
Those waits could matter where workers create CUDA contexts: there an NVML read holds a
driver lock for milliseconds. A sweep's A/B cannot show them (worker start-up makes its
1-epoch runs vary far more than the goal, with or without NVML), so ``bench_driver.py``
measures them directly, on workers that make nothing but driver calls. So the accounted cost
is a bound on what the training thread pays through the GIL and the CPU; the A/B and
bench_driver measure the rest.

Everything here but ``time_ms`` (a timing loop) is a pure function of its arguments; the
bootstrap uses its own seeded ``random.Random``, so a run's intervals are reproducible from
its raw numbers.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

RESAMPLES = 2000
CONFIDENCE = 0.95
SEED = 20261129

VERDICT_MET = "met"
VERDICT_NOT_MET = "not met"
VERDICT_WIDE = "not resolved: CI wider than the goal"
VERDICT_STRADDLES = "not resolved: CI straddles the goal"


@dataclass(frozen=True)
class Summary:
    """A sample of per-round values, summarised.

    Attributes:
        n: number of values.
        median: their median.
        ci_low: lower end of the bootstrap confidence interval of the median (nan if n < 2).
        ci_high: upper end of that interval (nan if n < 2).
        minimum: smallest value.
        maximum: largest value.
        confidence: the interval's confidence level, e.g. 0.95.
        resamples: bootstrap resamples drawn.
        seed: the bootstrap RNG's seed.
    """

    n: int
    median: float
    ci_low: float
    ci_high: float
    minimum: float
    maximum: float
    confidence: float
    resamples: int
    seed: int

    def to_dict(self) -> dict[str, Any]:
        """The summary as a JSON-able dict (nan becomes None: JSON has no nan)."""
        return {
            key: None if isinstance(value, float) and math.isnan(value) else value
            for key, value in asdict(self).items()
        }


def time_ms(call: Callable[[], object], rounds: int) -> list[float]:
    """Wall milliseconds of ``rounds`` calls of ``call``, one by one."""
    samples: list[float] = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        samples.append((time.perf_counter() - start) * 1000)
    return samples


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of already sorted values, interpolating linearly.

    Args:
        sorted_values: values in ascending order, at least one.
        q: the quantile, between 0 and 1.

    Returns:
        The interpolated value at position ``q * (n - 1)``.
    """
    if not sorted_values:
        raise ValueError("quantile of no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile {q} is outside 0..1")
    position = q * (len(sorted_values) - 1)
    below = math.floor(position)
    above = min(below + 1, len(sorted_values) - 1)
    weight = position - below
    return sorted_values[below] * (1 - weight) + sorted_values[above] * weight


def bootstrap_median_ci(
    values: Sequence[float],
    *,
    confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of the median.

    Draws ``resamples`` samples of ``len(values)`` values with replacement, takes each one's
    median, and returns the ``(1 - confidence) / 2`` and ``(1 + confidence) / 2`` quantiles
    of those medians. With few values the interval is coarse (with 3 it is about their
    range), which is the honest answer.

    Args:
        values: per-round values.
        confidence: the interval's confidence level, between 0 and 1.
        resamples: bootstrap resamples to draw.
        seed: seed of the RNG, for reproducible intervals.

    Returns:
        ``(low, high)``; ``(nan, nan)`` with fewer than 2 values, where resampling cannot
        say anything about the spread.
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence {confidence} is outside (0, 1)")
    if resamples < 1:
        raise ValueError(f"resamples must be positive, got {resamples}")
    data = [float(value) for value in values]
    if len(data) < 2:
        return math.nan, math.nan
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(data, k=len(data))) for _ in range(resamples))
    tail = (1.0 - confidence) / 2.0
    return quantile(medians, tail), quantile(medians, 1.0 - tail)


def summarize(
    values: Sequence[float],
    *,
    confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> Summary:
    """Median, its bootstrap interval, minimum and maximum of per-round values.

    Args:
        values: per-round values, at least one.
        confidence: the interval's confidence level.
        resamples: bootstrap resamples to draw.
        seed: seed of the bootstrap RNG.

    Returns:
        The :class:`Summary`.
    """
    data = [float(value) for value in values]
    if not data:
        raise ValueError("summary of no values")
    low, high = bootstrap_median_ci(data, confidence=confidence, resamples=resamples, seed=seed)
    return Summary(
        n=len(data),
        median=statistics.median(data),
        ci_low=low,
        ci_high=high,
        minimum=min(data),
        maximum=max(data),
        confidence=confidence,
        resamples=resamples,
        seed=seed,
    )


def slowdown_pct(speed_ratio: float) -> float:
    """Throughput lost, in percent, from a speed ratio (with leakcheck / without).

    ``1 - ratio``: the share of the slower run's wall time that the faster one did not
    need, the same quantity the accounted cost estimates (leakcheck's time over the wall
    time of the run with it). Positive means slower with leakcheck.
    """
    return (1.0 - speed_ratio) * 100.0


def slowdown_summary(speed_ratios: Sequence[float], **kwargs: Any) -> Summary:
    """:func:`summarize` of per-round speed ratios, expressed as slowdowns in percent.

    The median and the bootstrap interval of the slowdowns are those of the ratios mapped
    through :func:`slowdown_pct` (a decreasing map: the ratio's upper end is the
    slowdown's lower end), so both views agree exactly.
    """
    return summarize([slowdown_pct(ratio) for ratio in speed_ratios], **kwargs)


def min_rounds(confidence: float = CONFIDENCE) -> int:
    """Fewest values whose range covers the median with probability ``confidence``.

    A bootstrap interval of the median never reaches past the values' range, and the range
    of ``n`` values misses the true median with probability ``2 ** (1 - n)`` (all values on
    one side of it). Below this count the percentile bootstrap claims more confidence than
    it can have: 4 values give at most 87.5%, 6 values 96.9%.
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence {confidence} is outside (0, 1)")
    n = 2
    while 1.0 - 2.0 ** (1 - n) < confidence:
        n += 1
    return n


def verdict(summary: Summary, goal: float) -> str:
    """Whether the median of a noisy cost (lower is better) is under ``goal``, at the CI's level.

    For the A/B slowdown.

    Args:
        summary: the cost's summary, in the goal's units.
        goal: the bound the cost should stay under.

    Returns:
        ``"met"`` if the whole interval lies under the goal, ``"not met"`` if it lies at
        or above it, else ``"not resolved: ..."``: too few rounds for an interval at the
        summary's confidence (:func:`min_rounds`), or the interval is wider than the goal,
        or narrower but straddling it.
    """
    needed = min_rounds(summary.confidence)
    if summary.n < needed or math.isnan(summary.ci_low) or math.isnan(summary.ci_high):
        return (
            f"not resolved: {summary.n} pairs, a {summary.confidence:.0%} interval needs {needed}"
        )
    if summary.ci_high < goal:
        return VERDICT_MET
    if summary.ci_low >= goal:
        return VERDICT_NOT_MET
    if summary.ci_high - summary.ci_low > goal:
        return VERDICT_WIDE
    return VERDICT_STRADDLES


def bound_verdict(summary: Summary, goal: float) -> str:
    """Whether per-round upper bounds of a cost stay under ``goal`` in every round.

    For the accounted cost: each round's value bounds what that round's training thread
    paid through the GIL and the CPU (not driver waits: see the module docstring) and is
    measured directly, not estimated from a difference of noisy timings, so no interval is
    needed; the verdict asks the worst round. ``"not met"`` then says the bound does not
    show the goal, not that the slowdown exceeds it; ``"met"`` does not rule out the costs
    it leaves out (the A/B ratio measures those).

    Args:
        summary: the per-round bounds' summary, in the goal's units.
        goal: the bound the cost should stay under.

    Returns:
        ``"met"`` if the largest value is under the goal, else ``"not met"``.
    """
    return VERDICT_MET if summary.maximum < goal else VERDICT_NOT_MET


def format_pct(value: float, *, signed: bool = True) -> str:
    """A percentage for the reports, ``-`` for nan."""
    if math.isnan(value):
        return "-"
    return f"{value:+.2f}%" if signed else f"{value:.2f}%"


def format_ci(summary: Summary, *, signed: bool = True) -> str:
    """The summary's interval as ``[low, high]`` in percent, ``-`` without one."""
    if math.isnan(summary.ci_low):
        return "-"
    low = format_pct(summary.ci_low, signed=signed)
    high = format_pct(summary.ci_high, signed=signed)
    return f"[{low}, {high}]"


COST_FIELDS = (
    "samples",
    "sample_wall_s",
    "sampler_cpu_s",
    "caller_wall_s",
    "nvml_wall_s",
    "nvml_cpu_s",
    "host_read_cpu_s",
)


def cost_counters(tracker: Any) -> dict[str, float]:
    """A tracker's cost counters so far (``Tracker.cost()``), as plain numbers."""
    cost = tracker.cost()
    return {name: float(getattr(cost, name)) for name in COST_FIELDS}


def cost_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What the counters grew by between two reads."""
    return {name: after[name] - before[name] for name in COST_FIELDS}
