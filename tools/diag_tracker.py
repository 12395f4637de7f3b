"""Diagnose: the tracker's view of a spawned CUDA child, tick by tick (GPU machine)."""

import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.getcwd())


def hold(ready, stop):
    import torch

    torch.zeros(1, device="cuda")
    ready.set()
    stop.wait(60)


if __name__ == "__main__":
    import leakcheck
    from leakcheck import nvml, procs

    ctx = mp.get_context("spawn")
    stop, ready = ctx.Event(), ctx.Event()
    tracker = leakcheck.Tracker(grace=0.5).start()
    tracker.begin_epoch()
    kid = ctx.Process(target=hold, args=(ready, stop))
    kid.start()
    me = os.getpid()
    for step in range(16):
        walk = procs.descendants(me, with_cmdline=False)
        with tracker._lock:
            mine = [
                (k.pid, round(k.create_time, 2), p.exited_s is not None, p.foreign, p.in_lineage,
                 k in tracker._workers, dict(p.gpu_bytes))
                for k, p in tracker._procs.items() if k.pid == kid.pid
            ]
            seen = [k.pid for k in (tracker._open.seen if tracker._open else ())]
        gpu = [(g.pid, g.used_gpu_bytes) for g in nvml.get().processes()]
        print(f"t={step/10:.1f} walk={[(i.key.pid, round(i.key.create_time, 2)) for i in walk]} "
              f"key={procs.process_key(kid.pid)} tracker={mine} seen={seen} nvml={gpu}", flush=True)
        time.sleep(0.1)
    ready.wait(60)
    stop.set()
    kid.join()
    tracker.end_epoch()
    tracker.close()
    print("failures", tracker.timeline().failures)
    for p in tracker.report().epochs[0].processes:
        print("epoch proc", p.key.pid, p.role, p.total_gpu_bytes_peak)
