"""leakcheck.observe.nvml against a fake of its binding (CPU), plus checks of the real binding."""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from leakcheck.core.errors import LeakCheckError, NVMLUnavailable, UsageError
from leakcheck.core.model import AccountedProcess, GpuProcess
from leakcheck.observe import nvml
from tests.fake_pynvml import (
    NOT_AVAILABLE,
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH,
    NVML_ERROR_LIBRARY_NOT_FOUND,
    NVML_ERROR_NO_PERMISSION,
    FakeDevice,
    FakeProcess,
    FakePynvml,
    reset_nvml,
)
from tests.polling import wait_for

MIB = 2**20


@pytest.fixture(autouse=True)
def _fresh_singleton() -> Iterator[None]:
    reset_nvml()
    yield
    reset_nvml()


UseFake = Callable[..., FakePynvml]


@pytest.fixture
def use_fake(monkeypatch: pytest.MonkeyPatch) -> UseFake:
    """Install a FakePynvml built by the test in place of leakcheck's NVML binding."""

    def install(*args: Any, **kwargs: Any) -> FakePynvml:
        fake = FakePynvml(*args, **kwargs)
        monkeypatch.setitem(sys.modules, "leakcheck.observe.nvml_lib", fake)
        reset_nvml()
        return fake

    return install


def two_devices() -> list[FakeDevice]:
    return [
        FakeDevice(
            uuid="GPU-aaaa",
            compute=[FakeProcess(100, 600 * MIB), FakeProcess(200, 300 * MIB)],
            graphics=[FakeProcess(200, 300 * MIB), FakeProcess(300, 50 * MIB)],
        ),
        FakeDevice(
            uuid="GPU-bbbb",
            used_bytes=5 * MIB,
            compute=[FakeProcess(100, 520 * MIB)],
        ),
    ]


# -- processes -------------------------------------------------------------------------------


def test_processes_merges_compute_and_graphics_per_pid_and_device(use_fake: UseFake) -> None:
    use_fake(two_devices())
    procs = nvml.get().processes()
    assert procs == (
        GpuProcess(pid=100, device_index=0, used_gpu_bytes=600 * MIB, kind="compute"),
        GpuProcess(pid=200, device_index=0, used_gpu_bytes=300 * MIB, kind="both"),
        GpuProcess(pid=300, device_index=0, used_gpu_bytes=50 * MIB, kind="graphics"),
        GpuProcess(pid=100, device_index=1, used_gpu_bytes=520 * MIB, kind="compute"),
    )


def test_processes_device_filter_reads_only_those_devices(use_fake: UseFake) -> None:
    fake = use_fake(two_devices())
    handle = nvml.get()
    fake.calls.clear()  # get() reads every device once to open NVML's descriptors
    procs = handle.processes(devices=[1])
    assert [(p.pid, p.device_index) for p in procs] == [(100, 1)]
    assert fake.calls == {
        "nvmlDeviceGetComputeRunningProcesses": 1,
        "nvmlDeviceGetGraphicsRunningProcesses": 1,
    }


def test_unavailable_used_bytes_is_none_never_zero(use_fake: UseFake) -> None:
    use_fake(
        [
            FakeDevice(
                compute=[
                    FakeProcess(10, NOT_AVAILABLE),  # raw NVML sentinel
                    FakeProcess(11, None),  # what the binding turns it into
                    FakeProcess(12, 0),  # a real zero stays zero
                ],
                graphics=[FakeProcess(10, NOT_AVAILABLE)],
            )
        ],
    )
    by_pid = {p.pid: p for p in nvml.get().processes()}
    assert by_pid[10].used_gpu_bytes is None
    assert by_pid[10].kind == "both"
    assert by_pid[11].used_gpu_bytes is None
    assert by_pid[12].used_gpu_bytes == 0


def test_known_bytes_win_over_unknown_when_merging_lists(use_fake: UseFake) -> None:
    use_fake(
        [FakeDevice(compute=[FakeProcess(7, 64 * MIB)], graphics=[FakeProcess(7, None)])],
    )
    (proc,) = nvml.get().processes()
    assert (proc.used_gpu_bytes, proc.kind) == (64 * MIB, "both")


def test_graphics_list_not_supported_gives_compute_only(use_fake: UseFake) -> None:
    fake = use_fake([FakeDevice(compute=[FakeProcess(5, MIB)], graphics=None)])
    handle = nvml.get()  # reads each list once, to open NVML's descriptors
    for _ in range(3):
        assert handle.processes() == (
            GpuProcess(pid=5, device_index=0, used_gpu_bytes=MIB, kind="compute"),
        )
    # An unsupported list is not asked for again.
    assert fake.calls["nvmlDeviceGetGraphicsRunningProcesses"] == 1
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses"] == 4


def test_processes_without_the_graphics_list_reads_compute_only(use_fake: UseFake) -> None:
    fake = use_fake(two_devices())
    handle = nvml.get()
    fake.calls.clear()
    procs = handle.processes(devices=[0], graphics=False)
    assert [(p.pid, p.kind) for p in procs] == [(100, "compute"), (200, "compute")]
    assert fake.calls == {"nvmlDeviceGetComputeRunningProcesses": 1}


def test_buffer_grows_past_its_first_size_and_keeps_the_larger_one(use_fake: UseFake) -> None:
    """NOTE [process lists]: a short buffer costs one more call, once."""
    many = [FakeProcess(1000 + i, (i + 1) * MIB) for i in range(100)]
    fake = use_fake([FakeDevice(compute=many[:1], graphics=[])])
    handle = nvml.get()
    fake.devices[0].compute = many
    fake.calls.clear()
    first = handle.processes()
    assert [(p.pid, p.used_gpu_bytes) for p in first] == [
        (1000 + i, (i + 1) * MIB) for i in range(100)
    ]
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses"] == 2  # short, then grown
    fake.calls.clear()
    assert handle.processes() == first
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses"] == 1
    # Fewer processes later: the larger buffer is reused and only live entries are read.
    fake.devices[0].compute = many[:3]
    assert [p.pid for p in handle.processes()] == [1000, 1001, 1002]


def test_buffer_reader_through_real_ctypes_with_the_bindings_error_class(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NOTE [process lists]: a real C-callable function and pynvml's own NVMLError."""
    import pynvml

    from tests.fake_pynvml import FakeProcessInfo

    prototype = ctypes.CFUNCTYPE(
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_uint),
        ctypes.POINTER(FakeProcessInfo),
    )
    state: dict[str, Any] = {"entries": [(11, 5 * MIB), (12, NOT_AVAILABLE)], "code": 0}

    def c_function(handle: Any, count: Any, buffer: Any) -> int:
        if state["code"]:
            return int(state["code"])
        entries = state["entries"]
        if count[0] < len(entries):
            count[0] = len(entries)
            return 7  # NVML_ERROR_INSUFFICIENT_SIZE
        for index, (pid, used) in enumerate(entries):
            buffer[index].pid = pid
            buffer[index].usedGpuMemory = used
        count[0] = len(entries)
        return 0

    function = prototype(c_function)
    reader = nvml._RawProcessList(function, FakeProcessInfo, pynvml.NVMLError)
    assert reader.read(None) == [(11, 5 * MIB), (12, None)]
    state["entries"] = [(100 + i, i * MIB) for i in range(40)]  # more than the first buffer
    assert reader.read(None) == [(100 + i, i * MIB) for i in range(40)]
    state["code"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    with pytest.raises(pynvml.NVMLError_NotSupported) as info:
        reader.read(None)
    assert info.value.value == pynvml.NVML_ERROR_NOT_SUPPORTED
    # Without a loaded library the binding has no function to give: no reader.
    # (On a GPU machine an earlier test may have loaded it: unload it here.)
    monkeypatch.setattr(pynvml, "nvmlLib", None)
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
    assert nvml._RawProcessList.open(pynvml, "nvmlDeviceGetComputeRunningProcesses") is None


# -- memory and telemetry --------------------------------------------------------------------


def test_memory_reads_used_total_and_caches_name_uuid_and_handles(use_fake: UseFake) -> None:
    fake = use_fake(two_devices())
    handle = nvml.get()
    first = handle.memory()
    second = handle.memory()
    assert first == second
    assert [(d.index, d.uuid, d.used_bytes, d.total_bytes) for d in first] == [
        (0, "GPU-aaaa", 2**30, 140 * 2**30),
        (1, "GPU-bbbb", 5 * MIB, 140 * 2**30),
    ]
    assert first[0].name == "NVIDIA Fake H200"
    assert first[0].temperature_c is None  # memory() reads no telemetry
    assert fake.calls["nvmlDeviceGetMemoryInfo"] == 4
    assert fake.calls["nvmlDeviceGetHandleByIndex"] == 2
    assert fake.calls["nvmlDeviceGetName"] == 2
    assert fake.calls["nvmlDeviceGetUUID"] == 2
    assert fake.calls["nvmlDeviceGetTemperature"] == 0


def test_driver_version(use_fake: UseFake) -> None:
    use_fake(two_devices())
    assert nvml.get().driver_version() == "580.159.04"


def test_devices_reads_and_decodes_telemetry(use_fake: UseFake) -> None:
    use_fake([FakeDevice(clock_event_reasons=0x1 | 0x4 | 0x40, power_mw=123_456)])
    (state,) = nvml.get().devices()
    assert state.temperature_c == 35
    assert (state.sm_clock_mhz, state.sm_clock_max_mhz) == (345, 1980)
    assert state.power_w == pytest.approx(123.456)
    assert state.performance_state == 0
    assert state.throttle_reasons == ("gpu_idle", "sw_power_cap", "hw_thermal")
    assert state.used_bytes == 2**30


_TELEMETRY_CALLS = (
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetClockInfo",
    "nvmlDeviceGetMaxClockInfo",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetPerformanceState",
)


@pytest.mark.parametrize("telemetry", [False, True])
def test_a_snapshot_reads_telemetry_only_when_asked(use_fake: UseFake, telemetry: bool) -> None:
    """Each telemetry value is a driver call of its own (on the H200 together more than NVML's
    reads after its start): ``snapshot`` reads them with ``--telemetry`` only, and its device
    line then shows them."""
    from leakcheck.commands.cli import main

    fake = use_fake([FakeDevice(compute=[FakeProcess(pid=os.getpid(), usedGpuMemory=MIB)])])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["snapshot", *(["--telemetry"] if telemetry else [])]) == 0
    first = out.getvalue().splitlines()[0]
    assert first.startswith("GPU0 NVIDIA Fake H200: 1024 / 143360 MiB used"), first
    assert first.endswith(", 35 C, SM 345/1980 MHz, 76 W") is telemetry, first
    made = [name for name in _TELEMETRY_CALLS if fake.calls[name]]
    assert made == (list(_TELEMETRY_CALLS) if telemetry else []), fake.calls
    assert f"PID {os.getpid()}" in out.getvalue()


@pytest.mark.parametrize("with_gpu", [False, True])
def test_an_empty_snapshot_claims_no_more_than_it_read(use_fake: UseFake, with_gpu: bool) -> None:
    """Without NVML it read only descriptors: it says nobody holds those, not GPU memory."""
    from leakcheck.observe.snapshot import take_snapshot

    if with_gpu:
        use_fake([FakeDevice()])
    else:
        use_fake(init_error=NVML_ERROR_LIBRARY_NOT_FOUND)
    snapshot = take_snapshot(with_fds=False)
    last = snapshot.format().splitlines()[-1]
    expected = "GPU memory or /dev/nvidia*" if with_gpu else "holds /dev/nvidia* descriptors"
    assert last.startswith("  no process holds ") and expected in last, snapshot.format()


def test_unsupported_telemetry_leaves_only_that_field_none(use_fake: UseFake) -> None:
    use_fake(
        [
            FakeDevice(temperature_c=None, power_mw=None, clock_event_reasons=None),
            FakeDevice(sm_clock_mhz=None, sm_clock_max_mhz=None, performance_state=None),
        ]
    )
    first, second = nvml.get().devices()
    assert (first.temperature_c, first.power_w, first.throttle_reasons) == (None, None, ())
    assert (first.sm_clock_mhz, first.sm_clock_max_mhz, first.performance_state) == (345, 1980, 0)
    assert (second.sm_clock_mhz, second.sm_clock_max_mhz, second.performance_state) == (
        None,
        None,
        None,
    )
    assert (second.temperature_c, second.power_w) == (35, 75.5)


def test_unknown_pstate_is_none(use_fake: UseFake) -> None:
    use_fake([FakeDevice(performance_state=32)])  # NVML_PSTATE_UNKNOWN
    assert nvml.get().devices()[0].performance_state is None


def test_throttle_reasons_fall_back_to_the_deprecated_call(use_fake: UseFake) -> None:
    fake = use_fake([FakeDevice(clock_event_reasons=0x8 | 0x100)], has_event_reasons=False)
    (state,) = nvml.get().devices()
    assert state.throttle_reasons == ("hw_slowdown", "display_clocks")
    assert fake.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 1


def test_throttle_reason_names_decodes_every_named_bit() -> None:
    names = nvml.throttle_reason_names(0x1FF | 0x10000)
    assert names == (
        "gpu_idle",
        "applications_clocks",
        "sw_power_cap",
        "hw_slowdown",
        "sync_boost",
        "sw_thermal",
        "hw_thermal",
        "hw_power_brake",
        "display_clocks",
    )
    assert nvml.throttle_reason_names(0) == ()


# -- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "hint"),
    [
        (NVML_ERROR_LIBRARY_NOT_FOUND, "libnvidia-ml.so.1 not found"),
        (NVML_ERROR_DRIVER_NOT_LOADED, "driver is not loaded"),
        (NVML_ERROR_NO_PERMISSION, "no permission"),
        (NVML_ERROR_LIB_RM_VERSION_MISMATCH, "versions differ"),
        (999, "nvmlInit failed"),
    ],
)
def test_init_failure_raises_nvml_unavailable_with_a_hint(
    use_fake: UseFake, code: int, hint: str
) -> None:
    use_fake(init_error=code)
    with pytest.raises(NVMLUnavailable) as info:
        nvml.get()
    message = str(info.value)
    assert message.startswith("NVML unavailable: ")
    assert hint in message
    assert "\n" not in message


def test_availability_reports_reason_without_raising(use_fake: UseFake) -> None:
    use_fake(init_error=NVML_ERROR_LIBRARY_NOT_FOUND)
    ok, reason = nvml.availability()
    assert ok is False
    assert "libnvidia-ml.so.1 not found" in reason
    assert "GPU memory is not checked" in reason
    assert "\n" not in reason


def test_availability_true_when_nvml_works(use_fake: UseFake) -> None:
    use_fake()
    assert nvml.availability() == (True, "")


def test_init_failure_is_remembered_for_the_process(use_fake: UseFake) -> None:
    fake = use_fake(init_error=NVML_ERROR_DRIVER_NOT_LOADED)
    for _ in range(3):
        with pytest.raises(NVMLUnavailable):
            nvml.get()
    assert fake.calls["nvmlInit"] == 1


def test_no_gpu_is_unavailable(use_fake: UseFake) -> None:
    fake = use_fake([])
    ok, reason = nvml.availability()
    assert not ok
    assert "no NVIDIA GPU" in reason
    assert fake.shutdown_calls == 1  # the half-open session was closed again


def test_device_error_names_call_and_device(use_fake: UseFake) -> None:
    devices = two_devices()
    use_fake(devices)
    handle = nvml.get()
    handle.memory()
    devices[1].lost = True
    with pytest.raises(LeakCheckError) as info:
        handle.processes()
    assert not isinstance(info.value, NVMLUnavailable)
    message = str(info.value)
    assert "nvmlDeviceGetComputeRunningProcesses" in message
    assert "device 1" in message
    assert "GPU is lost" in message
    assert handle.memory(devices=[0])[0].index == 0  # the healthy device still reads


def test_bad_device_index_is_a_usage_error(use_fake: UseFake) -> None:
    use_fake(two_devices())
    with pytest.raises(UsageError, match="out of range"):
        nvml.get().memory(devices=[2])


# -- process safety --------------------------------------------------------------------------


def test_using_nvml_does_not_initialise_cuda(use_fake: UseFake) -> None:
    torch = pytest.importorskip("torch")
    use_fake(two_devices())
    handle = nvml.get()
    handle.processes()
    handle.memory()
    handle.devices()
    handle.accounting(0)
    assert torch.cuda.is_initialized() is False


def test_nvml_module_never_imports_torch() -> None:
    code = (
        "import sys; from leakcheck.observe import nvml; nvml.availability()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr


def test_many_threads_calling_get_initialise_once(use_fake: UseFake) -> None:
    fake = use_fake(two_devices(), init_delay_s=0.02)
    start = threading.Barrier(16)
    results: list[nvml.Nvml] = []

    def worker() -> None:
        start.wait()
        results.append(nvml.get())

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 16
    assert len({id(r) for r in results}) == 1
    assert fake.init_calls == 1


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_reinitialises_and_drops_cached_handles(use_fake: UseFake) -> None:
    fake = use_fake(two_devices())
    handle = nvml.get()
    handle.memory()  # caches handles of generation 1
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report, then leave without running pytest's teardown
        status = 1
        try:
            os.close(read_fd)
            child = nvml.get()
            used = child.memory()[1].used_bytes
            line = f"{child is handle} {fake.init_calls} {used}\n"
            os.write(write_fd, line.encode())
            status = 0
        finally:
            os._exit(status)
    os.close(write_fd)
    with os.fdopen(read_fd) as pipe:
        report = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # Same object, re-initialised in the child (2nd init), stale handles not reused.
    assert report.split() == ["True", "2", str(5 * MIB)]
    assert fake.init_calls == 1  # the parent's session is untouched


# -- accounting ------------------------------------------------------------------------------


def test_accounting_off_returns_empty_and_never_switches_it_on(use_fake: UseFake) -> None:
    devices = two_devices()
    devices[0].accounting = {100: (600 * MIB, 1500, False)}
    fake = use_fake(devices, root=True)
    handle = nvml.get()
    assert handle.accounting_enabled(0) is False
    assert handle.accounting(0) == ()
    assert fake.calls["nvmlDeviceSetAccountingMode"] == 0
    assert devices[0].accounting_mode is False


def test_accounting_unsupported_counts_as_off(use_fake: UseFake) -> None:
    use_fake([FakeDevice(accounting_supported=False)])
    assert nvml.get().accounting_enabled(0) is False
    assert nvml.get().accounting(0) == ()


def test_accounting_on_lists_records_including_exited(use_fake: UseFake) -> None:
    devices = [
        FakeDevice(
            accounting_mode=True,
            accounting={100: (600 * MIB, 1500, False), 101: (NOT_AVAILABLE, 20, True)},
            accounting_vanishing_pids=(102,),
        )
    ]
    use_fake(devices)
    assert nvml.get().accounting(0) == (
        AccountedProcess(
            pid=100, device_index=0, max_memory_bytes=600 * MIB, time_ms=1500, is_running=False
        ),
        AccountedProcess(
            pid=101, device_index=0, max_memory_bytes=None, time_ms=20, is_running=True
        ),
    )


# -- the real binding on this machine ---------------------------------------------------------


def _driver_library_present() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(_driver_library_present(), reason="a driver is present: tests/gpu covers it")
def test_real_binding_without_driver_is_unavailable_with_one_line_reason() -> None:
    ok, reason = nvml.availability()
    assert ok is False
    assert reason.startswith("NVML unavailable: ")
    assert "libnvidia-ml.so.1 not found" in reason
    assert "\n" not in reason
    with pytest.raises(NVMLUnavailable):
        nvml.get()


def test_gpu_bytes_by_pid_sums_per_device_and_keeps_unknowns_apart() -> None:
    grouped, unknown = nvml.gpu_bytes_by_pid(
        [
            GpuProcess(pid=7, device_index=0, used_gpu_bytes=100),
            GpuProcess(pid=7, device_index=1, used_gpu_bytes=50),
            GpuProcess(pid=7, device_index=1, used_gpu_bytes=25),
            GpuProcess(pid=9, device_index=0, used_gpu_bytes=None),
        ]
    )
    assert grouped == {7: {0: 100, 1: 75}, 9: {}}
    assert unknown == {9}


# --------------------------------------------------------------------------- the binding


def test_binding_structures_match_pynvml_layouts() -> None:
    """leakcheck's ctypes structures have nvml.h's layouts, as pynvml (the reference) has."""
    pynvml = pytest.importorskip("pynvml")
    from leakcheck.observe import nvml_lib

    for ours, theirs in (
        (nvml_lib.c_nvmlProcessInfo_v3_t, pynvml.c_nvmlProcessInfo_v3_t),
        (nvml_lib.c_nvmlMemory_t, pynvml.c_nvmlMemory_t),
        (nvml_lib.c_nvmlAccountingStats_t, pynvml.c_nvmlAccountingStats_t),
    ):
        assert ctypes.sizeof(ours) == ctypes.sizeof(theirs)
        assert [(name, getattr(ours, name).offset) for name, *_ in ours._fields_] == [
            (name, getattr(theirs, name).offset) for name, *_ in theirs._fields_
        ]
    assert ctypes.sizeof(nvml_lib.c_nvmlProcessInfo_v3_t) == 24


def test_binding_errors_before_the_library_is_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    from leakcheck.observe import nvml_lib

    monkeypatch.setattr(nvml_lib, "_lib", None)
    monkeypatch.setattr(nvml_lib, "_functions", {})
    with pytest.raises(nvml_lib.NVMLError) as info:
        nvml_lib._nvmlGetFunctionPointer("nvmlDeviceGetComputeRunningProcesses_v3")
    assert info.value.value == nvml_lib.NVML_ERROR_UNINITIALIZED
    assert str(info.value) == "Uninitialized"
    assert str(nvml_lib.NVMLError(999)) == "NVML Error with code 999"
    # Without a driver there is nothing to read the lists with: the reader is not offered.
    assert nvml._RawProcessList.open(nvml_lib, "nvmlDeviceGetComputeRunningProcesses") is None


def test_start_in_background_begins_the_one_start_that_get_then_waits_for(
    use_fake: UseFake,
) -> None:
    """The command's early start (NOTE [overlapped start] in snapshot.py): NVML starts on a
    thread while the caller goes on, and the caller's get() returns that same session."""
    fake = use_fake()
    real_init = fake.nvmlInit
    init_may_end = threading.Event()

    def held_init() -> None:
        assert init_may_end.wait(30)
        real_init()

    fake.nvmlInit = held_init  # type: ignore[method-assign]
    nvml.start_in_background()
    assert fake.init_calls == 0  # returned while nvmlInit is held: the caller did not wait
    threading.Timer(0.3, init_may_end.set).start()
    first = nvml.get()
    assert init_may_end.is_set()  # get() waited for the start under way
    assert fake.init_calls == 1
    nvml.start_in_background()  # started already: nothing more
    assert nvml.get() is first
    assert fake.init_calls == 1


def test_start_in_background_remembers_a_failure_without_raising(use_fake: UseFake) -> None:
    use_fake(init_error=NVML_ERROR_DRIVER_NOT_LOADED)
    nvml.start_in_background()
    assert wait_for(lambda: nvml._failure is not None)
    ok, reason = nvml.availability()
    assert not ok and "driver" in reason.lower()
    with pytest.raises(NVMLUnavailable):
        nvml.get()


def test_a_session_is_handed_out_only_once_its_own_descriptors_are_known(
    use_fake: UseFake,
) -> None:
    """get() publishes the session after its first process list and the count of what NVML
    opened: another thread's get() during that list waits (a snapshot read NVML's own
    descriptors as its process's and listed itself)."""
    fake = use_fake()
    real_pointer = fake._nvmlGetFunctionPointer
    listed = threading.Event()

    def slow_first_list(name: str) -> Any:
        real_list = real_pointer(name)

        def call(*args: Any) -> int:
            if not listed.is_set():
                time.sleep(0.3)
                listed.set()
            return int(real_list(*args))

        return call

    fake._nvmlGetFunctionPointer = slow_first_list  # type: ignore[method-assign]
    nvml.start_in_background()
    # nvmlInit done: the start is in its first process list now.
    assert wait_for(lambda: fake.init_calls > 0)
    nvml.get()
    assert listed.is_set()  # get() returned after the start's list, not during it


@pytest.mark.parametrize("first_use", ["get", "method"])
def test_a_forked_childs_new_nvml_descriptors_count_as_nvmls(
    use_fake: UseFake, monkeypatch: pytest.MonkeyPatch, first_use: str
) -> None:
    """NVML starts again in a forked child and opens descriptors of its own there: they are
    NVML's (own_descriptors), whether the child's first NVML call is get() or a method of the
    inherited session. The /proc side is played by a counter: each nvmlInit 'opens' one."""
    fake = use_fake()
    real_init = fake.nvmlInit
    opened: set[int] = set()

    def init() -> None:
        real_init()
        opened.add(100 + fake.init_calls)

    fake.nvmlInit = init  # type: ignore[method-assign]
    monkeypatch.setattr(nvml, "_nvidia_fd_numbers", lambda: set(opened))
    session = nvml.get()
    assert nvml.own_descriptors() == {101}
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what it counts as NVML's, then leave at once
        try:
            if first_use == "method":
                session.memory()
            nvml.get()
            os.write(write_end, repr(sorted(nvml.own_descriptors())).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as reader:
        seen = reader.read()
    os.waitpid(pid, 0)
    assert seen == "[101, 102]"
