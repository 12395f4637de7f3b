"""Epoch-end cost of reading the host memory of N worker processes, and of the tracker doing it.

Each configuration runs in its own process (the parent), which first makes itself look like a
training process, then forks N children as DataLoader workers are forked, and times, in
interleaved rounds, one read of all N children by each method:
- ``rollup``: ``hostmem.read_host_memories(pids)``: /proc/PID/smaps_rollup (USS, PSS, RSS);
- ``rollup_keys``: the same through ``ProcessKey`` identities (a /proc/PID directory open and
  a stat read more per process: the PID-reuse check);
- ``status``: ``read_host_memories(pids, rollup=False)``: /proc/PID/status (RSS only);
- ``status_keys``: the same through ``ProcessKey`` identities: what the tracker reads for
  every process of the job at each epoch end, on the caller's thread;
- ``status_pread``: /proc/PID/status kept open and read again with ``pread``, as procs'
  descriptor cache reads stat files (not leakcheck's code path: what a per-tick RSS read
  through that cache would cost);
- ``shm``: what the tracker reads of /dev/shm at an epoch end: the listing, each child's
  descriptor table and maps, and statvfs.

What the parent holds when it forks: ``plain`` (a bare interpreter), ``data<N>`` (N MiB of
bytes, whose pages every child shares: the kernel walks them in each child's page tables)
or ``torch`` (torch imported, and one small tensor operation in each child). The children's
mean RSS is recorded with each configuration: smaps_rollup's cost follows it (NOTE [rollup
cost] in leakcheck/observe/hostmem.py).

Reported per configuration and method: the median (and p90) ms of one read of all children,
and the median us per process.

Then the tracker with them (``--tracker-epochs``, 0 to skip): a torch parent forks N children
(8, 64), registers them as persistent workers of a ``Tracker`` and runs epochs of
``--epoch-s`` seconds (1.4 s: the H200 loop of bench_watch.py), with the host reads as shipped
(``paced``: status at every epoch end, smaps_rollup paced to 0.1% of the time on the sampler
thread), at every epoch end (``every``: ``rollup_share=1.0``, what the sweep uses), ``off``
(the host and /dev/shm reads switched off: the tracker as before them) and ``copy``: as
shipped, with children that report their birth as DataLoader workers do through
leakcheck's ``worker_init_fn`` (one smaps_rollup read of itself in each, at its start), so
that the tracker measures their copies of the parent's memory (NOTE [copy on read] in
leakcheck/observe/hostmem.py): a read of every child at its first epoch end, whatever the
pacing (epochs of 10 s and more would be read inside too, paced: ``--epoch-s``). Reported:
the accounted cost (the sampler's CPU and the caller's time in the tracker, over the epochs'
time), the caller's time per epoch end, the smaps_rollup CPU per read, at how many epoch
ends the USS was read, and the in-epoch reads.

Usage: python benchmarks/bench_hostmem.py [--children 8,64] [--parents plain,data256,torch]
       [--rounds 100] [--tracker-epochs 8] [--epoch-s 1.4] [--write]  (writes
       benchmarks/results/hostmem-<machine>.md, see results_io.py)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from results_io import host_meta, result_stem, write_result

from leakcheck.observe import hostmem, procs

METHODS = ("rollup", "rollup_keys", "status", "status_keys", "status_pread", "shm")
ARMS = ("off", "paced", "every", "copy")
MIB = 2**20


def _fork_children(count: int, parent: str, *, births: bool = False) -> tuple[list[int], int]:
    """Fork ``count`` idle children; return their PIDs and the pipe end that keeps them.

    ``births``: each child posts its birth to the tracker's mailbox (``LEAKCHECK_MAILBOX``),
    as a DataLoader worker does through leakcheck's ``worker_init_fn``.
    """
    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()
    pids: list[int] = []
    for _ in range(count):
        pid = os.fork()
        if pid == 0:
            os.close(hold_w)
            os.close(ready_r)
            if parent == "torch":
                import torch

                torch.ones(1000).sum()  # fault in what a worker's first batch does
            if births:
                _post_birth()
            os.write(ready_w, b"k")
            os.read(hold_r, 1)  # returns at EOF: the parent closed its end
            os._exit(0)
        pids.append(pid)
    os.close(hold_r)
    os.close(ready_w)
    for _ in range(count):
        os.read(ready_r, 1)
    os.close(ready_r)
    return pids, hold_w


def _post_birth() -> None:
    """A forked worker's ``worker`` record with its birth reading (teardown.WorkerInit's)."""
    from leakcheck.observe import mailbox

    pid = os.getpid()
    key = procs.process_key(pid)
    if key is not None:
        birth = mailbox.host_fields(hostmem.read_host_memory(pid))
        record = {"pid": pid, "start_ticks": key.start_ticks, "persistent": True, **birth}
        mailbox.post("worker", record | {"forked": True, "monotonic_s": time.monotonic()})


def _status_preader(pids: list[int]) -> tuple[Callable[[], int], Callable[[], None]]:
    fds = [os.open(f"/proc/{pid}/status", os.O_RDONLY | os.O_CLOEXEC) for pid in pids]

    def read() -> int:
        return sum(len(os.pread(fd, 8192, 0)) for fd in fds)

    def close() -> None:
        for fd in fds:
            os.close(fd)

    return read, close


def run_config(children: int, parent: str, rounds: int) -> dict[str, Any]:
    """Measure one configuration in this process (the parent of the children)."""
    data: Any = None
    if parent.startswith("data"):
        data = b"\x01" * (int(parent[4:]) * MIB)  # noqa: F841 (held while the children live)
    elif parent == "torch":
        import torch  # noqa: F401
    pids, hold_w = _fork_children(children, parent)
    preader, close_preader = _status_preader(pids)
    keys = [key for key in map(procs.process_key, pids) if key is not None]
    before = procs.shm_segments()
    calls: dict[str, Callable[[], object]] = {
        "rollup": lambda: hostmem.read_host_memories(pids),
        "rollup_keys": lambda: hostmem.read_host_memories(keys),
        "status": lambda: hostmem.read_host_memories(pids, rollup=False),
        "status_keys": lambda: hostmem.read_host_memories(keys, rollup=False),
        "status_pread": preader,
        "shm": lambda: (
            hostmem.job_shm_files(before, procs.shm_segments()),
            procs.shm_open_by(pids),
            hostmem.shm_capacity(),
        ),
    }
    samples: dict[str, list[float]] = {name: [] for name in METHODS}
    try:
        memories = hostmem.read_host_memories(pids)
        assert len(memories) == children and all(
            m.source == "smaps_rollup" for m in memories.values()
        )
        warmup = 3
        for index in range(rounds + warmup):
            order = METHODS[index % len(METHODS) :] + METHODS[: index % len(METHODS)]
            for name in order:  # rotated: a drift through the run weighs on every method
                start = time.perf_counter()
                calls[name]()
                elapsed_ms = (time.perf_counter() - start) * 1000
                if index >= warmup:
                    samples[name].append(elapsed_ms)
        memories = hostmem.read_host_memories(pids)
    finally:
        close_preader()
        os.close(hold_w)
        for pid in pids:
            os.waitpid(pid, 0)
    rss = [m.rss_bytes or 0 for m in memories.values()]
    uss = [m.uss_bytes or 0 for m in memories.values()]
    results = {}
    for name, values in samples.items():
        ordered = sorted(values)
        median = statistics.median(ordered)
        results[name] = {
            "median_ms": median,
            "p90_ms": ordered[int(0.9 * (len(ordered) - 1))],
            "min_ms": ordered[0],
            "us_per_process": median * 1000 / children,
            "n": len(ordered),
        }
    mean_rss_mib = statistics.fmean(rss) / MIB
    results["rollup"]["us_per_rss_mib"] = results["rollup"]["us_per_process"] / mean_rss_mib
    return {
        "children": children,
        "parent": parent,
        "child_mean_rss_mib": mean_rss_mib,
        "child_mean_uss_mib": statistics.fmean(uss) / MIB,
        "results": results,
    }


def _switch_off_host_reads() -> None:
    """The tracker without its host-memory and /dev/shm reads (the ``off`` arm)."""
    from leakcheck.track import reads as host
    from leakcheck.track import shm

    host.HostReads.end_status = lambda self, table: None  # type: ignore[method-assign]
    host.HostReads.plan = lambda self, epoch_index, table: False  # type: ignore[method-assign]
    host.HostReads.final_reads = lambda self, table, *, closed: ({}, {})  # type: ignore[method-assign]
    shm.ShmWatch.note_usage = lambda self: None  # type: ignore[method-assign]
    # None: the epoch has no /dev/shm read, as when the read fails (the sampler's guard).
    shm.ShmWatch.epoch_end = lambda self, table: None  # type: ignore[method-assign, assignment, return-value]
    shm.ShmWatch.files = lambda self, table, *, closing=False: ()  # type: ignore[method-assign]


def run_tracker(children: int, arm: str, epochs: int, epoch_s: float) -> dict[str, Any]:
    """One tracker over ``children`` persistent workers of a torch parent (in this process)."""
    import torch  # noqa: F401  (the parent of a training job has it)

    from leakcheck.track.tracker import Tracker

    if arm == "off":
        _switch_off_host_reads()
    tracker = Tracker(
        rollup_share=1.0 if arm == "every" else None, persistent_workers=True, grace=0.1
    )
    ends_ms: list[float] = []
    # The copy arm's children are forked once the tracker runs: they post their birth to
    # its mailbox, which start() exported.
    tracker.start()
    pids, hold_w = _fork_children(children, "torch", births=arm == "copy")
    try:
        for pid in pids:
            tracker.register_worker(pid, persistent=True)
        for _ in range(epochs):
            tracker.begin_epoch()
            time.sleep(epoch_s)
            started = time.perf_counter()
            tracker.end_epoch()
            ends_ms.append((time.perf_counter() - started) * 1000)
        time.sleep(0.5)  # the sampler's reads of the last end, on its thread
        cost = tracker.cost()
        records = tracker.epochs()
        host = tracker.host
        rollup_reads, rollup_cpu_s = host.rollup_reads, host.rollup_cpu_s
        inside_reads = host.inside_reads
    finally:
        tracker.close()
        os.close(hold_w)
        for pid in pids:
            os.waitpid(pid, 0)
    epochs_s = sum(record.duration_s for record in records)
    parents = [p for r in records for p in r.processes if p.role == "parent"]
    workers = [p for r in records for p in r.processes if p.role == "worker"]
    copied = [p.copied_bytes_peak for p in workers if p.copied_bytes_peak is not None]
    return {
        "children": children,
        "arm": arm,
        "epochs": epochs,
        "epoch_s": epoch_s,
        "accounted_fraction": (cost.sampler_cpu_s + cost.caller_wall_s) / epochs_s,
        "sampler_cpu_s": cost.sampler_cpu_s,
        "caller_wall_s": cost.caller_wall_s,
        "end_epoch_ms_median": statistics.median(ends_ms),
        "rollup_reads": rollup_reads,
        "inside_reads": inside_reads,
        "rollup_cpu_s": rollup_cpu_s,
        "rollup_cpu_ms_per_read": (
            rollup_cpu_s * 1000 / (rollup_reads + inside_reads)
            if rollup_reads + inside_reads
            else None
        ),
        "rollup_us_per_process": (
            rollup_cpu_s * 1e6 / rollup_reads / (children + 1)
            if rollup_reads and not inside_reads
            else None
        ),
        "uss_epochs": sum(1 for p in parents if p.host_source == "uss"),
        "workers_with_copy_epochs": len(copied),
        "copied_mib_max": max(copied) / MIB if copied else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--children", default="8,64")
    parser.add_argument("--parents", default="plain,data256,torch")
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--tracker-epochs", type=int, default=8)
    parser.add_argument("--epoch-s", type=float, default=1.4)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: CHILDREN:PARENT
    parser.add_argument("--one-tracker", help=argparse.SUPPRESS)  # internal: CHILDREN:ARM
    args = parser.parse_args()

    if args.one:
        count, parent = args.one.split(":")
        print(json.dumps(run_config(int(count), parent, args.rounds)))
        return 0
    if args.one_tracker:
        count, arm = args.one_tracker.split(":")
        print(json.dumps(run_tracker(int(count), arm, args.tracker_epochs, args.epoch_s)))
        return 0

    load_start = os.getloadavg()
    configs = []
    for parent in args.parents.split(","):
        for count in args.children.split(","):
            out = subprocess.run(
                [sys.executable, __file__, "--one", f"{count}:{parent}", f"--rounds={args.rounds}"],
                capture_output=True,
                text=True,
                check=True,
            )
            configs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    trackers = []
    if args.tracker_epochs > 0:
        for count in args.children.split(","):
            for arm in ARMS:  # each in its own process: "off" patches the tracker
                out = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--one-tracker",
                        f"{count}:{arm}",
                        f"--tracker-epochs={args.tracker_epochs}",
                        f"--epoch-s={args.epoch_s}",
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                trackers.append(json.loads(out.stdout.strip().splitlines()[-1]))

    try:
        import torch

        torch_version: str = torch.__version__
    except ImportError:
        torch_version = "-"
    meta: dict[str, Any] = {**host_meta(), "rounds": args.rounds, "torch": torch_version}
    meta["kernel"] = os.uname().release
    # The machine may be shared: its load says how far to trust a run.
    meta["loadavg_1min_start_end"] = [load_start[0], os.getloadavg()[0]]
    payload = {"meta": meta, "configs": configs, "trackers": trackers}
    lines = [
        "# Host memory reads: one read of N forked children",
        "",
        f"{meta['date']} on {meta['host']}, {meta['cpu_count']} CPUs, kernel {meta['kernel']}, "
        f"python {meta['python']}, torch {torch_version}, {args.rounds} rounds, "
        f"load average {load_start[0]:.2f} -> {meta['loadavg_1min_start_end'][1]:.2f}",
        "",
        "| children | parent | child RSS MiB | method | median ms | p90 ms | us/process |",
        "| ---: | --- | ---: | --- | ---: | ---: | ---: |",
    ]
    for config in configs:
        for name in METHODS:
            r = config["results"][name]
            lines.append(
                f"| {config['children']} | {config['parent']} | "
                f"{config['child_mean_rss_mib']:.0f} | {name} | {r['median_ms']:.3f} | "
                f"{r['p90_ms']:.3f} | {r['us_per_process']:.1f} |"
            )
    lines += ["", "smaps_rollup, us per MiB of a child's RSS:"]
    lines += [
        f"- {c['children']} children, {c['parent']}: {c['results']['rollup']['us_per_rss_mib']:.2f}"
        for c in configs
    ]
    if trackers:
        off = {t["children"]: t["accounted_fraction"] for t in trackers if t["arm"] == "off"}
        lines += [
            "",
            f"Tracker over N persistent workers of a torch parent, {args.tracker_epochs} epochs "
            f"of {args.epoch_s:g} s; arms: off (no host or /dev/shm reads), paced (as shipped), "
            "every (USS at every epoch end), copy (as shipped, the children reporting their "
            "birth: their copies read at their first end and inside epochs):",
            "",
            "| children | arm | accounted % | added % | end_epoch ms | rollup ms/read | "
            "rollup us/process | USS at epoch ends | in-epoch reads | rollup CPU ms |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for t in trackers:
            per_read = t["rollup_cpu_ms_per_read"]
            per_process = t["rollup_us_per_process"]
            lines.append(
                f"| {t['children']} | {t['arm']} | {t['accounted_fraction'] * 100:.3f} | "
                f"{(t['accounted_fraction'] - off[t['children']]) * 100:+.3f} | "
                f"{t['end_epoch_ms_median']:.2f} | "
                f"{'-' if per_read is None else f'{per_read:.1f}'} | "
                f"{'-' if per_process is None else f'{per_process:.0f}'} | "
                f"{t['uss_epochs']} of {t['epochs']} | {t['inside_reads']} | "
                f"{t['rollup_cpu_s'] * 1000:.1f} |"
            )
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_result(result_stem("hostmem"), payload, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
