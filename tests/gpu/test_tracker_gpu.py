"""Tracker on a real GPU: attribution per PID, orphans, growth, a clean run.

Each scenario runs in its own interpreter (the job's root), so CUDA is never initialised in
the pytest process (forked tests elsewhere would break) and each job's lineage is its own.
"""

from __future__ import annotations

import tempfile
import textwrap
from typing import Any

import pytest

from tests.gpu.scenario import leaks, run_job

pytestmark = pytest.mark.gpu

MIB = 2**20

# Shared by every scenario: children that allocate a known amount and wait to be told to go.
PRELUDE = textwrap.dedent(
    """
    import json, multiprocessing as mp, os, subprocess, sys, time
    import leakcheck
    from leakcheck.observe import procs
    MIB = 2**20

    def hold(mib, ready, stop):
        import torch
        x = torch.empty(mib * MIB, dtype=torch.uint8, device="cuda") if mib else None
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
        ready.set()
        stop.wait(120)

    def grow(step_mib, epochs, go, done, stop):
        import torch
        cache = []
        torch.zeros(1, device="cuda")
        for epoch in range(epochs):
            go.wait(60); go.clear()
            cache.append(torch.empty(step_mib * MIB, dtype=torch.uint8, device="cuda"))
            torch.cuda.synchronize()
            done.set()
        stop.wait(120)

    def wait_all(events, kids, timeout_s=90):
        deadline = time.monotonic() + timeout_s
        for event in events:
            while not event.wait(0.2):
                dead = [k.pid for k in kids if k.exitcode is not None]
                if dead or time.monotonic() > deadline:
                    raise SystemExit(f"children {dead} died or timed out before they were ready")

    def emit(report, **extra):
        print("RESULT " + json.dumps({"report": report.to_dict(), **extra}))
    """
)


def run_scenario(body: str, timeout_s: float = 120) -> dict[str, Any]:
    # A file, not `python -c`: spawned children re-import __main__ by path to find targets.
    with tempfile.NamedTemporaryFile("w", suffix=".py", prefix="leakcheck-scenario-") as handle:
        handle.write(PRELUDE + textwrap.dedent(body))
        handle.flush()
        return run_job(handle.name, timeout_s)


def test_parent_and_four_children_attributed_to_their_pids() -> None:
    result = run_scenario(
        """
        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            amounts = [0, 256, 512, 768, 1024]  # child 0 measures one bare context
            ready = [ctx.Event() for _ in amounts]
            stop = ctx.Event()
            import torch
            parent_tensor = torch.empty(128 * MIB, dtype=torch.uint8, device="cuda")
            with leakcheck.Tracker(grace=1.0) as tracker:
                with tracker.epoch("hold"):
                    kids = [
                        ctx.Process(target=hold, args=(m, r, stop))
                        for m, r in zip(amounts, ready)
                    ]
                    for kid in kids:
                        kid.start()
                        tracker.register_worker(kid.pid)  # known workers (no mailbox here)
                    wait_all(ready, kids)
                    time.sleep(0.5)
                    stop.set()
                    for kid in kids: kid.join(60)
            emit(tracker.report(), pids=[k.pid for k in kids], amounts=amounts, parent=os.getpid())
        """
    )
    epoch = result["report"]["epochs"][0]
    by_pid = {p["key"]["pid"]: p for p in epoch["processes"]}
    peaks = {pid: sum(p["gpu_bytes_peak"].values()) for pid, p in by_pid.items()}
    seen = {pid: (p["role"], peaks[pid], p["cmdline"][:60]) for pid, p in by_pid.items()}
    assert set(result["pids"]) <= set(by_pid), (
        result["pids"],
        seen,
        epoch["samples"],
        result["report"]["failures"],
    )
    context_bytes = peaks[result["pids"][0]]
    assert 200 * MIB < context_bytes < 1200 * MIB, context_bytes
    for pid, mib in zip(result["pids"][1:], result["amounts"][1:], strict=True):
        assert by_pid[pid]["role"] == "worker"
        held = peaks[pid]
        assert mib * MIB <= held <= mib * MIB + context_bytes + 2 * MIB, (pid, mib, held)
        assert abs(held - (mib * MIB + context_bytes)) <= 2 * MIB, (pid, mib, held)
    parent = by_pid[result["parent"]]
    assert parent["role"] == "parent"
    assert peaks[result["parent"]] >= 128 * MIB
    assert leaks(result["report"]) == []


def test_grandchild_reparented_to_init_is_an_orphan_with_its_memory() -> None:
    result = run_scenario(
        """
        GRANDCHILD = (
            "import torch, time; x = torch.empty(300 * 2**20, dtype=torch.uint8, device='cuda');"
            "torch.cuda.synchronize(); time.sleep(60)"
        )

        def worker(pid_file):
            child = subprocess.Popen([sys.executable, "-c", GRANDCHILD])
            with open(pid_file, "w") as handle:
                handle.write(str(child.pid))

        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            pid_file = f"/tmp/leakcheck-orphan-{os.getpid()}"
            with leakcheck.Tracker(grace=0.5) as tracker:
                with tracker.epoch():
                    kid = ctx.Process(target=worker, args=(pid_file,))
                    kid.start(); kid.join()
                    grandchild = int(open(pid_file).read())
                    # Wait for the grandchild's allocation to show up.
                    from leakcheck.observe import nvml
                    for _ in range(300):
                        if any(p.pid == grandchild for p in nvml.get().processes()):
                            break
                        time.sleep(0.1)
                    time.sleep(0.3)
            report = tracker.report()
            os.kill(grandchild, 9)
            emit(report, grandchild=grandchild)
        """
    )
    orphans = [f for f in leaks(result["report"]) if f["rule"] == "orphan"]
    assert [f["pid"] for f in orphans] == [result["grandchild"]]
    assert orphans[0]["gpu_bytes"] >= 300 * MIB


def test_persistent_child_growing_64_mib_per_epoch_is_growth() -> None:
    result = run_scenario(
        """
        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            go, done, stop = ctx.Event(), ctx.Event(), ctx.Event()
            with leakcheck.Tracker(grace=1.0, persistent_workers=True, warmup_epochs=1) as tracker:
                kid = None
                for epoch in range(5):
                    with tracker.epoch():
                        if kid is None:
                            kid = ctx.Process(target=grow, args=(64, 5, go, done, stop))
                            kid.start()
                            tracker.register_worker(kid.pid)
                        go.set(); wait_all([done], [kid]); done.clear()
                        time.sleep(0.2)
                report = tracker.report()
                stop.set(); kid.join(60)
            emit(report, pid=kid.pid)
        """
    )
    growth = [f for f in leaks(result["report"]) if f["rule"] == "growth"]
    assert [f["pid"] for f in growth] == [result["pid"]]
    assert growth[0]["bytes_per_epoch"] == pytest.approx(64 * MIB, rel=0.1)


def test_clean_five_epochs_have_no_findings() -> None:
    result = run_scenario(
        """
        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            with leakcheck.Tracker(grace=1.0) as tracker:
                for epoch in range(5):
                    with tracker.epoch():
                        ready, stop = [ctx.Event() for _ in range(2)], ctx.Event()
                        kids = [ctx.Process(target=hold, args=(64, r, stop)) for r in ready]
                        for kid in kids: kid.start()
                        wait_all(ready, kids)
                        stop.set()
                        for kid in kids: kid.join(60)
            emit(tracker.report())
        """
    )
    report = result["report"]
    assert report["attribution"] == "ok"
    assert len(report["epochs"]) == 5
    assert leaks(report) == []
    assert report["verdict"] == "clean"


def test_forked_child_holding_the_parents_nvidia_descriptors_is_named_with_its_count() -> None:
    """A child forked after CUDA started in the parent holds the parent's /dev/nvidia*
    descriptors and no context: the descriptor-holder finding names it with their count."""
    result = run_scenario(
        """
        import torch
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
        me = os.getpid()
        by_link = {
            fd: target for fd, target in procs._fd_targets(me).items()
            if procs.is_nvidia_device_target(target)
        }
        with leakcheck.Tracker(grace=0.0) as tracker:
            with tracker.epoch("fork"):
                read, write = os.pipe()
                child = os.fork()
                if child == 0:
                    os.read(read, 1)  # waits, touching nothing of CUDA's
                    os._exit(0)
                time.sleep(0.5)
                inherited = procs.nvidia_fds(child)
            os.write(write, b"x")
            os.waitpid(child, 0)
        emit(
            tracker.report(), child=child, by_link=sorted(by_link),
            inherited=sorted(inherited or {}),
        )
        """
    )
    assert result["by_link"], result
    assert set(result["inherited"]) >= set(result["by_link"]), result
    holders = [
        f for f in result["report"]["findings"]
        if f["rule"] == "descriptor-holder" and f["pid"] == result["child"]
    ]  # fmt: skip
    assert len(holders) == 1, result["report"]["findings"]
    # NVML's own descriptors, opened for leakcheck after CUDA's, are left out of the count.
    assert holders[0]["nvidia_fds"] >= len(result["by_link"]), holders
    assert leaks(result["report"]) == []
