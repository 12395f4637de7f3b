"""Diagnose: lineage walk and tags of spawned children of a CUDA-initialised parent."""

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
    from leakcheck import procs

    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    ready = ctx.Event()
    cuda_parent = len(sys.argv) > 1
    if cuda_parent:
        import torch

        torch.zeros(1, device="cuda")
    tracker = leakcheck.Tracker(grace=0.5).start()
    tracker.begin_epoch()
    kid = ctx.Process(target=hold, args=(ready, stop))
    kid.start()
    time.sleep(0.3)
    me = os.getpid()
    print("cuda_parent", cuda_parent, "threads", len(os.listdir(f"/proc/{me}/task")))
    print("kid", kid.pid, "walk", [p.key.pid for p in procs.descendants(me)])
    print("child_pids", procs.child_pids(me), "stat ppid", open(f"/proc/{kid.pid}/stat").read().split(")")[1].split()[:2])
    raw = []
    for tid in os.listdir(f"/proc/{me}/task"):
        data = open(f"/proc/{me}/task/{tid}/children").read().strip()
        if data:
            raw.append((tid, data))
    print("raw children files", raw)
    ready.wait(60)
    info = procs.read_proc(kid.pid, session_id=tracker.session_id)
    print("read_proc", info, "tag", procs.tagged_session(kid.pid), "session", tracker.session_id)
    time.sleep(0.3)
    stop.set()
    kid.join()
    tracker.end_epoch()
    tracker.close()
    for p in tracker.report().epochs[0].processes:
        print("epoch proc", p.key.pid, p.role, p.total_gpu_bytes_peak, p.cmdline[:50])
