"""Each speed mechanism with and without, at realistic sizes: does it pay against its budget?

One section per mechanism in benchmarks/results/mechanisms-<machine>.md. The "without" arm
switches the mechanism off inside this process only (a monkeypatch, or the code path that
would be left without it); arms alternate block by block, so drift and the machine's load hit
both alike. Each figure is a median over blocks with its 95% bootstrap interval (stats.py),
turned into what it costs where it runs: a share of the loop for the tracker (budget 0.5%),
milliseconds per test for the pytest plugin (budget 1 ms).

- ``cache``: NOTE [descriptor cache] and NOTE [quick walk] in leakcheck/observe/procs.py. A
  sampler walk of N children (quick, cached) against the same walk with no descriptor kept
  (every /proc file opened, read, closed; no quick walk can serve without the cache), and a
  full walk (epoch end) with and without. The tracker walks every 4th tick of 50 ms: 5 a second.
- ``tagscan``: NOTE [incremental tag scan]. ``TagScan.scan`` again against a fresh TagScan
  (every entry of /proc read), once per epoch end.
- ``idle``: NOTE [idle ticks] in leakcheck/track/pacing.py. This process's CPU per second
  while an idle tracker without NVML (N children) sleeps through ticks with nothing to do,
  against one that wakes at every tick (``ticks_until_work`` always 1).
- ``pidmark``: NOTE [cheap snapshots]. The mark at a test's start and its new PIDs at its end,
  by /proc/loadavg's last PID, against two listings of /proc compared (``last_pid`` unknown).

Two mechanisms measured here did not pay and were removed with their arms (git history has
both): the mailbox's quick read (0.003% of the loop) and ``fstat`` for this process's own
descriptors (0.039% of a 1.7 s epoch with 400 descriptors).

``--machine-procs`` idle processes (not the benchmark's descendants) stand in for a machine
with a few hundred processes.

Usage: python benchmarks/bench_mechanisms.py [--mechanism cache ...] [--children 64]
       [--machine-procs 300] [--rounds 20] [--write]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import stats
from results_io import host_meta, result_stem, write_result

from leakcheck.observe import procs
from leakcheck.track import pacing
from leakcheck.track.pacing import Pacing
from leakcheck.track.tracker import Tracker

WALKS_PER_S = 1 / (0.05 * pacing.WALK_EVERY)  # the default interval's walking ticks
WATCH_BUDGET_PCT = 0.5
PLUGIN_BUDGET_MS = 1.0
EPOCH_S = 1.726  # watch-cpu.md's epoch of 200 batches with 8 workers


def _hold_processes(count: int) -> int:
    """``count`` idle processes outside this one's tree; they exit when this one does."""
    read_end, write_end = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.close(write_end)
        for _ in range(count):
            if os.fork() == 0:
                os.read(read_end, 1)  # EOF once the benchmark's write end is gone
                os._exit(0)
        os._exit(0)
    os.close(read_end)
    os.waitpid(middle, 0)
    return write_end


def _children(count: int) -> list[int]:
    """``count`` idle children of this process (the tracked job)."""
    pids = []
    for _ in range(count):
        pid = os.fork()
        if pid == 0:
            time.sleep(3600)
            os._exit(0)
        pids.append(pid)
    return pids


@contextmanager
def _patched(target: Any, name: str, value: Any) -> Iterator[None]:
    saved = getattr(target, name)
    setattr(target, name, value)
    try:
        yield
    finally:
        setattr(target, name, saved)


def _drop_cache() -> None:
    with procs._fd_lock:
        procs._evict(procs._generation + 2)


def _arms(arms: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each arm's per-block value, the arms' order rotating per round."""
    values: dict[str, list[float]] = {name: [] for name in arms}
    names = list(arms)
    for index in range(rounds):
        for name in names[index % len(names) :] + names[: index % len(names)]:
            values[name].append(arms[name]())
    return values


def _block_ms(
    call: Callable[[], object], calls: int, setup: Callable[[], object] = lambda: None
) -> Callable[[], float]:
    def block() -> float:
        setup()
        call()  # warm: the arm's caches as they are in steady state
        return statistics.median(stats.time_ms(call, calls))

    return block


def _cache(args: argparse.Namespace) -> dict[str, Any]:
    root = os.getpid()
    no_cache = lambda: 0  # noqa: E731

    def uncached(quick: bool) -> Callable[[], object]:
        def walk() -> object:
            with _patched(procs, "_cached_fd_limit", no_cache):
                return procs.descendants(root, with_cmdline=False, quick=quick)

        return walk

    def cached(quick: bool) -> Callable[[], object]:
        return lambda: procs.descendants(root, with_cmdline=False, quick=quick)

    assert len(procs.descendants(root, with_cmdline=False)) == args.children
    values = _arms(
        {
            "tick walk, cache (quick)": _block_ms(cached(True), 40),
            "tick walk, no cache": _block_ms(uncached(True), 40, _drop_cache),
            "full walk, cache": _block_ms(cached(False), 40),
            "full walk, no cache": _block_ms(uncached(False), 40, _drop_cache),
        },
        args.rounds,
    )
    rows = [
        ("sampler walk", values["tick walk, cache (quick)"], values["tick walk, no cache"],
         WALKS_PER_S, "walks/s"),
        ("epoch-end walk", values["full walk, cache"], values["full walk, no cache"],
         1 / EPOCH_S, "per epoch"),
    ]  # fmt: skip
    return _loop_share("Descriptor cache + quick walk", f"{args.children} children", rows)


def _tagscan(args: argparse.Namespace) -> dict[str, Any]:
    kids = args.job_pids
    first = procs.process_key(kids[0])
    assert first is not None
    known = {key for pid in kids if (key := procs.process_key(pid)) is not None}
    session = "bench-mechanisms"
    kept = procs.TagScan(session, born_since=first)
    values = _arms(
        {
            "incremental": _block_ms(lambda: kept.scan(known), 20),
            "fresh": _block_ms(lambda: procs.TagScan(session, born_since=first).scan(known), 20),
        },
        args.rounds,
    )
    rows = [("tag scan", values["incremental"], values["fresh"], 1 / EPOCH_S, "per epoch")]
    return _loop_share("Incremental tag scan", _procs_note(), rows)


def _idle(args: argparse.Namespace) -> dict[str, Any]:
    def every_tick(self: Pacing, now_s: float) -> int:
        return 1

    def block(patched: bool) -> Callable[[], float]:
        def run() -> float:
            saved = Pacing.ticks_until_work
            if patched:
                Pacing.ticks_until_work = every_tick  # type: ignore[method-assign]
            try:
                with Tracker(grace=0.0, use_nvml=False) as tracker, tracker.epoch():
                    time.sleep(0.3)  # past the first ticks
                    cpu_s, wall_s = time.process_time(), time.monotonic()
                    time.sleep(args.idle_s)
                    cpu_s, wall_s = time.process_time() - cpu_s, time.monotonic() - wall_s
            finally:
                Pacing.ticks_until_work = saved  # type: ignore[method-assign]
            return cpu_s * 1000 / wall_s  # CPU ms per second = per mille of the loop

        return run

    arms = {"idle ticks": block(False), "every tick": block(True)}
    values = _arms(arms, max(6, args.rounds // 3))
    rows = [("process CPU ms per s", values["idle ticks"], values["every tick"], 1.0, "per s")]
    return _loop_share("Idle ticks (no NVML)", f"{args.children} children, tracker idle", rows)


def _pidmark(args: argparse.Namespace) -> dict[str, Any]:
    def one_test() -> object:
        return procs.PidMark.now().pids_since()

    def names_only() -> object:
        with _patched(procs, "last_pid", lambda: None):
            return procs.PidMark.now().pids_since()

    values = _arms(
        {"last PID": _block_ms(one_test, 40), "two listings": _block_ms(names_only, 40)},
        args.rounds,
    )
    with_ms = stats.summarize(values["last PID"])
    without_ms = stats.summarize(values["two listings"])
    saved = stats.summarize(
        [b - a for a, b in zip(values["last PID"], values["two listings"], strict=True)]
    )
    share = 100 * saved.median / PLUGIN_BUDGET_MS
    text = (
        f"{_procs_note()}; a test's mark and its new PIDs (the plugin does both per test)\n\n"
        "| arm | median ms per test | 95% CI |\n| --- | ---: | ---: |\n"
        f"| with (/proc/loadavg last PID) | {with_ms.median:.4f} | "
        f"[{with_ms.ci_low:.4f}, {with_ms.ci_high:.4f}] |\n"
        f"| without (two listings of /proc) | {without_ms.median:.4f} | "
        f"[{without_ms.ci_low:.4f}, {without_ms.ci_high:.4f}] |\n\n"
        f"Saved: {saved.median:.4f} ms per test [{saved.ci_low:.4f}, {saved.ci_high:.4f}], "
        f"{share:.1f}% of the plugin's {PLUGIN_BUDGET_MS:g} ms budget."
    )
    return {
        "title": "PidMark (plugin)",
        "text": text,
        "data": {"with_ms": with_ms.to_dict(), "without_ms": without_ms.to_dict(),
                 "saved_ms": saved.to_dict(), "budget_share_pct": share},
    }  # fmt: skip


def _procs_note() -> str:
    count = sum(1 for name in os.listdir("/proc") if name.isdigit())
    return f"{count} processes on the machine"


def _loop_share(
    title: str, setting: str, rows: list[tuple[str, list[float], list[float], float, str]]
) -> dict[str, Any]:
    """A table of with/without medians per call and the saving as a share of the loop."""
    lines = [
        f"{setting}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs",
        "",
        "| call | with: median ms [95% CI] | without: median ms [95% CI] | saved per call ms "
        "[95% CI] | how often | saved, % of the loop | of the 0.5% budget |",
        "| --- | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    data = []
    for name, with_values, without_values, per_s, how in rows:
        w, wo = stats.summarize(with_values), stats.summarize(without_values)
        saved = stats.summarize([b - a for a, b in zip(with_values, without_values, strict=True)])
        pct = saved.median * per_s / 10  # ms per s -> % of wall time
        lines.append(
            f"| {name} | {w.median:.4f} [{w.ci_low:.4f}, {w.ci_high:.4f}] | {wo.median:.4f} "
            f"[{wo.ci_low:.4f}, {wo.ci_high:.4f}] | {saved.median:+.4f} [{saved.ci_low:+.4f}, "
            f"{saved.ci_high:+.4f}] | {how} ({per_s:.2f}/s) | {pct:+.4f}% | "
            f"{100 * pct / WATCH_BUDGET_PCT:+.1f}% |"
        )
        data.append(
            {"call": name, "with_ms": w.to_dict(), "without_ms": wo.to_dict(),
             "saved_ms": saved.to_dict(), "per_s": per_s, "saved_loop_pct": pct}
        )  # fmt: skip
    lines.append("")
    lines.append(
        f"Medians over blocks (arms alternating); an epoch of {EPOCH_S * 1000:.0f} ms as in "
        f"watch-cpu.md; a walk every {pacing.WALK_EVERY} ticks of 50 ms."
    )
    return {"title": title, "text": "\n".join(lines), "data": {"setting": setting, "rows": data}}


MECHANISMS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "cache": _cache,
    "tagscan": _tagscan,
    "idle": _idle,
    "pidmark": _pidmark,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mechanism", action="append", choices=list(MECHANISMS))
    parser.add_argument("--children", type=int, default=64)
    parser.add_argument("--machine-procs", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--idle-s", type=float, default=3.0)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    keep = _hold_processes(args.machine_procs)
    args.job_pids = _children(args.children)
    time.sleep(0.5)
    try:
        for name in args.mechanism or list(MECHANISMS):
            result = MECHANISMS[name](args)
            text = f"# {result['title']}\n\n{host_meta()['date']}: {result['text']}"
            print(text, flush=True)
            if args.write:
                payload = {**host_meta(), "children": args.children, **result["data"]}
                setting = f"{name}-{args.children}children" if name in ("cache", "idle") else name
                print(write_result(result_stem("mechanisms", setting), payload, text))
    finally:
        for pid in args.job_pids:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        os.close(keep)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
