"""Diagnose: where one tracker sample spends its time, 64 idle children + 4 on the GPU.

Prints medians (ms) of the parts of one tick, each timed alone, and a cProfile of 300 ticks.
"""

import cProfile
import multiprocessing as mp
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())


def _idle(stop):
    stop.wait(600)


def _gpu(ready, stop):
    import torch

    torch.empty(2**26, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    ready.set()
    stop.wait(600)


def _median_ms(call, rounds=300):
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


if __name__ == "__main__":
    from leakcheck import nvml, procs
    from leakcheck.tracker import Tracker

    gpu = nvml.availability()[0]
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    kids = [ctx.Process(target=_idle, args=(stop,)) for _ in range(64)]
    readies = [ctx.Event() for _ in range(4 if gpu else 0)]
    kids += [ctx.Process(target=_gpu, args=(ready, stop)) for ready in readies]
    for kid in kids:
        kid.start()
    for ready in readies:
        ready.wait(120)
    time.sleep(0.5)
    tracker = Tracker(interval=3600.0).start()
    me = os.getpid()
    lineage = procs.descendants(me, with_cmdline=False)
    threads = {info.key.pid: procs._stat(info.key.pid).num_threads for info in lineage}
    print("processes", len(lineage), "threads per process",
          sorted(set(threads.values())), "root threads", procs._stat(me).num_threads)
    print("tracker.sample        ", round(_median_ms(tracker.sample), 3))
    print("descendants           ", round(_median_ms(
        lambda: procs.descendants(me, with_cmdline=False)), 3))
    if gpu:
        handle = nvml.get()
        print("nvml.processes        ", round(_median_ms(handle.processes), 3))
        print("nvml.memory           ", round(_median_ms(handle.memory), 3))
        lib = handle._lib
        dev = handle._handle(0)
        print("  compute list        ", round(_median_ms(
            lambda: lib.nvmlDeviceGetComputeRunningProcesses(dev)), 3))
        print("  graphics list       ", round(_median_ms(
            lambda: handle._running(0, dev, "nvmlDeviceGetGraphicsRunningProcesses",
                                    optional=True)), 3))
        print("  memory info         ", round(_median_ms(
            lambda: lib.nvmlDeviceGetMemoryInfo(dev)), 3))
    inbox = tracker._inbox
    if inbox is not None:
        print("mailbox read (full)   ", round(_median_ms(
            lambda: tracker._read_mailbox(inbox, quick=False)), 3))
    cProfile.run("for _ in range(300): tracker.sample()", "/tmp/tick.prof")
    pstats.Stats("/tmp/tick.prof").sort_stats("tottime").print_stats(18)
    tracker.close()
    stop.set()
    for kid in kids:
        kid.join(5)
        if kid.is_alive():  # our own child, still waiting on the event
            kid.terminate()
            kid.join(5)
