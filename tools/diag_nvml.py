"""Diagnose: what each NVML call of a sampler tick costs, with CUDA children on the GPU.

Starts ``--children`` processes that each hold GPU memory, then times, in this process
(which never initialises CUDA), each call alone: the binding's running-process lists, the
same lists through leakcheck's reused buffer (NOTE [process lists] in nvml.py), the memory
read, and ``Nvml.processes()``. Prints the median wall time and the mean thread CPU time per
call, and checks that the buffer path returns what the binding returns.

Usage: PYTHONPATH=. python3 tools/diag_nvml.py [--children 4] [--rounds 300]
"""

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())


def _gpu(mib, ready, stop):
    import torch

    torch.empty(mib * 2**20, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    ready.set()
    stop.wait(600)


def _time(call, rounds):
    wall, cpu = [], 0.0
    for _ in range(rounds):
        start_cpu, start = time.thread_time(), time.perf_counter()
        call()
        wall.append(time.perf_counter() - start)
        cpu += time.thread_time() - start_cpu
    return statistics.median(wall) * 1e3, cpu / rounds * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--children", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()

    import pynvml

    from leakcheck import nvml

    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    readies = [ctx.Event() for _ in range(args.children)]
    kids = [
        ctx.Process(target=_gpu, args=(64 * (i + 1), ready, stop))
        for i, ready in enumerate(readies)
    ]
    for kid in kids:
        kid.start()
    try:
        for ready in readies:
            ready.wait(120)
        handle_api = nvml.get()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        print(
            "pynvml",
            getattr(pynvml, "__version__", "?"),
            "driver",
            handle_api.driver_version(),
            "children",
            args.children,
        )
        calls = {}
        for short, name in (
            ("compute", "nvmlDeviceGetComputeRunningProcesses"),
            ("graphics", "nvmlDeviceGetGraphicsRunningProcesses"),
        ):
            bound = getattr(pynvml, name)
            raw = nvml._RawProcessList.open(pynvml, name)
            try:
                bound_pairs = sorted((int(p.pid), p.usedGpuMemory) for p in bound(handle))
            except pynvml.NVMLError as exc:
                print(f"{short}: binding raises {exc}")
                continue
            raw_pairs = sorted(raw.read(handle)) if raw is not None else None
            print(
                f"{short}: {len(bound_pairs)} entries; buffer path "
                f"{'unavailable' if raw is None else 'same' if raw_pairs == bound_pairs else f'DIFFERS {raw_pairs} vs {bound_pairs}'}"
            )
            calls[f"binding {short}"] = lambda bound=bound: bound(handle)
            if raw is not None:
                calls[f"buffer {short}"] = lambda raw=raw: raw.read(handle)
        calls["memory info"] = lambda: pynvml.nvmlDeviceGetMemoryInfo(handle)
        calls["Nvml.processes()"] = handle_api.processes
        calls["Nvml.memory()"] = handle_api.memory
        print(f"{'call':24} {'wall ms (median)':>17} {'CPU ms (mean)':>14}")
        for label, call in calls.items():
            wall_ms, cpu_ms = _time(call, args.rounds)
            print(f"{label:24} {wall_ms:17.3f} {cpu_ms:14.3f}")
    finally:
        stop.set()
        for kid in kids:
            kid.join(30)


if __name__ == "__main__":
    main()
