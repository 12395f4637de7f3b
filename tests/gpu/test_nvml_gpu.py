"""leakcheck.observe.nvml on a real GPU: devices, telemetry, per-PID memory, no CUDA here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TypeVar

import pytest

from leakcheck.core.model import GpuProcess
from leakcheck.observe import nvml
from tests.pyrun import run_python

T = TypeVar("T")

pytestmark = pytest.mark.gpu

MIB = 2**20
ALLOC_MIB = 256

# Allocates on cuda:0, says so, then holds the memory until stdin closes.
_HOLDER = f"""
import sys, torch
x = torch.empty({ALLOC_MIB} * 2**20, dtype=torch.uint8, device="cuda:0")
torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.readline()
"""


def _wait_for(predicate: Callable[[], T | None], what: str, deadline_s: float = 60.0) -> T:
    # A wait, not a timing assertion: NVML lists a context a moment after it is created.
    end = time.monotonic() + deadline_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            pytest.fail(f"gave up waiting for {what}")
        time.sleep(0.05)


def test_devices_memory_and_telemetry_are_reported() -> None:
    handle = nvml.get()
    assert handle.device_count() > 0
    for state in handle.memory():
        assert state.total_bytes > 0
        assert 0 <= state.used_bytes <= state.total_bytes
        assert state.name
        assert state.uuid.startswith(("GPU-", "MIG-"))
    for state in handle.devices():
        assert state.temperature_c is not None
        assert state.sm_clock_mhz is not None
        assert state.sm_clock_max_mhz is not None and state.sm_clock_max_mhz > 0
        assert state.power_w is not None and state.power_w > 0
        assert state.performance_state is not None
        known = {name for _, name in nvml.THROTTLE_REASON_NAMES}
        assert set(state.throttle_reasons) <= known


def test_child_allocation_appears_under_its_own_pid() -> None:
    handle = nvml.get()
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLDER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "ready"

        def entry() -> GpuProcess | None:
            found = [p for p in handle.processes(devices=[0]) if p.pid == child.pid]
            return found[0] if found else None

        seen = _wait_for(entry, f"pid {child.pid} in NVML")
        assert seen.device_index == 0
        assert seen.kind in ("compute", "both")
        assert seen.used_gpu_bytes is not None
        assert seen.used_gpu_bytes >= ALLOC_MIB * MIB

        # NOTE [process lists]: leakcheck reads the lists through its own binding
        # (nvml_lib) and a reused buffer; pynvml, NVIDIA's binding, must say the same.
        import pynvml

        from leakcheck.observe import nvml_lib
        # Only the child's entry is compared: other processes may come and go in between.
        raw = nvml._RawProcessList.open(nvml_lib, "nvmlDeviceGetComputeRunningProcesses")
        assert raw is not None, "this binding and driver should allow the buffer path"
        pynvml.nvmlInit()
        try:
            by_pynvml = [
                (int(p.pid), p.usedGpuMemory)
                for p in pynvml.nvmlDeviceGetComputeRunningProcesses(
                    pynvml.nvmlDeviceGetHandleByIndex(0)
                )
                if int(p.pid) == child.pid
            ]
        finally:
            pynvml.nvmlShutdown()
        device = nvml_lib.nvmlDeviceGetHandleByIndex(0)
        by_buffer = [entry for entry in raw.read(device) if entry[0] == child.pid]
        assert by_pynvml == [(child.pid, seen.used_gpu_bytes)]
        assert by_buffer == by_pynvml

        child.stdin.close()
        assert child.wait(timeout=60) == 0
        _wait_for(lambda: entry() is None, f"pid {child.pid} to leave NVML")
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_the_snapshot_command_shows_a_holder_and_not_itself() -> None:
    """``leakcheck snapshot`` names a process holding GPU memory, with its descriptors; its
    own process, which holds NVML's descriptors and no context, is not flagged nor listed
    (NOTE [overlapped start] in snapshot.py)."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline().strip() == "ready"
        handle = nvml.get()
        _wait_for(
            lambda: any(p.pid == holder.pid for p in handle.processes(devices=[0])),
            f"pid {holder.pid} in NVML",
        )
        command = subprocess.Popen(
            [sys.executable, "-m", "leakcheck", "snapshot", "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.getcwd()},
        )
        out, err = command.communicate(timeout=60)
        assert command.returncode == 0, err
        taken = json.loads(out)
        assert taken["attribution"] == "ok"
        by_pid = {entry["pid"]: entry for entry in taken["processes"]}
        seen = by_pid[holder.pid]
        assert seen["gpu_bytes"]["0"] >= ALLOC_MIB * MIB
        assert seen["nvidia_fds"] and seen["nvidia_fds"] > 0
        assert command.pid not in by_pid, by_pid.get(command.pid)
    finally:
        if holder.stdin is not None:
            holder.stdin.close()
        try:
            holder.wait(timeout=60)
        finally:
            if holder.poll() is None:
                holder.kill()
                holder.wait()


def test_nvml_use_does_not_initialise_cuda_in_the_caller() -> None:
    # In a fresh interpreter, so that no other test's CUDA use can hide or fake the result.
    code = """
import os, torch
from leakcheck.observe import nvml
handle = nvml.get()
pids = {p.pid for p in handle.processes()}
handle.memory()
handle.devices()
handle.accounting(0)
assert not torch.cuda.is_initialized(), "CUDA was initialised"
assert os.getpid() not in pids, "this process holds a context"
assert os.getpid() not in {p.pid for p in handle.processes()}, "this process holds a context"
print("clean")
"""
    done = run_python(code, timeout_s=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "clean"

    import torch  # and in this process: NVML use leaves CUDA's state as it was

    before = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    nvml.get().processes()
    nvml.get().devices()
    assert torch.cuda.is_initialized() is before  # type: ignore[no-untyped-call]


def test_forked_child_can_use_nvml() -> None:
    handle = nvml.get()
    expected = handle.device_count()
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            child = nvml.get()
            child.processes()
            if child.device_count() == expected and child.memory()[0].total_bytes > 0:
                status = 0
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert handle.memory()[0].total_bytes > 0  # the parent's session still works


def test_torch_state_sees_a_context_and_not_a_forked_childs_inherited_one() -> None:
    # The check every teardown, allocator read and cache flush of leakcheck's asks first.
    code = """
import os, torch
from leakcheck.observe.torch_state import initialized_cuda
assert initialized_cuda() is None, "no context yet"
torch.empty(1, device="cuda:0")
assert initialized_cuda() is torch.cuda, "a context now"
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(write, b"none" if initialized_cuda() is None else b"cuda")
    os._exit(0)
os.waitpid(pid, 0)
print(os.read(read, 8).decode())
"""
    done = run_python(code, timeout_s=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "none"
