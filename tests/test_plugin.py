"""The pytest plugin, end to end: inner pytest sessions in subprocesses (pytester).

Each inner session loads the plugin through a ``pytest11`` entry point, as an installed
leakcheck would: a small ``.dist-info`` on ``PYTHONPATH`` declares ``leakcheck =
leakcheck.adapters.plugin``, so ``-p no:leakcheck`` works even before the package is installed.
Processes an inner test leaves behind on purpose are the outer test's to kill: their PIDs
travel through files, and each is killed only after its command line was checked.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from leakcheck.adapters.plugin import TEST_LABEL, headline, judge_test
from leakcheck.adapters.plugin_observe import Checker, Window
from leakcheck.core.model import Finding
from leakcheck.core.names import process_name
from leakcheck.core.options import CheckOptions
from leakcheck.core.records import record_from_dict, to_jsonable
from leakcheck.core.roles import is_runtime_helper
from leakcheck.judge.report import finding_lines
from leakcheck.observe import procs
from leakcheck.observe.hostmem import shm_creator_pid
from leakcheck.track.tracker import Tracker
from tests.fake_pynvml import FakeDevice, FakeProcess, FakePynvml, reset_nvml
from tests.polling import wait_for

MIB = 1024 * 1024

pytest_plugins = ["pytester"]

NO_CACHE = ("-p", "no:cacheprovider")
FAST = ("--gpu-leak-grace=0.2", *NO_CACHE)


@pytest.fixture
def leftovers(tmp_path: Path) -> Iterator[Path]:
    """A folder where inner tests note what they leak; all of it is killed at the end.

    A file's name (or its second field) is a token found in the leaked process's command
    line: a unique `sleep` argument, or the inner session's unique folder. Every process
    whose command line holds a token is killed, so a reused PID never is.
    """
    folder = tmp_path / "pids"
    folder.mkdir()
    yield folder
    tokens = set()
    for pid_file in folder.iterdir():
        fields = pid_file.read_text().split(maxsplit=1)
        tokens.add(fields[1] if len(fields) > 1 else pid_file.name)
    _kill_matching(tokens)


def _kill_matching(tokens: set[str]) -> None:
    if not tokens:
        return
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if any(token in cmdline for token in tokens):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)


def _sleep_arg() -> str:
    """A unique, long `sleep` argument: names the process for ``leftovers``."""
    return f"{600 + uuid.uuid4().int % 10_000}.{uuid.uuid4().int % 10**6:06d}"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


LEAKY_SUITE = """
import os, subprocess
from multiprocessing import shared_memory, resource_tracker
import pytest

PIDS = {pids!r}
KEEP = []

def test_clean():
    assert 1 + 1 == 2

def test_leaves_child():
    proc = subprocess.Popen(["sleep", "{sleep}"])
    KEEP.append(proc)
    with open(os.path.join(PIDS, "{sleep}"), "w") as handle:
        handle.write(str(proc.pid))

def test_leaves_shm():
    segment = shared_memory.SharedMemory(create=True, size=8192, name="{shm}")
    KEEP.append(segment)  # held open and never unlinked

def test_clean_after():
    subprocess.run(["true"], check=True)
"""


def _write_leaky_suite(inner: pytest.Pytester, leftovers: Path) -> tuple[str, str]:
    sleep = _sleep_arg()
    shm = f"lc_test_{uuid.uuid4().hex[:12]}"
    inner.makepyfile(test_leaky=LEAKY_SUITE.format(pids=str(leftovers), sleep=sleep, shm=shm))
    return sleep, shm


@pytest.fixture
def shm_names() -> Iterator[list[str]]:
    """Names of /dev/shm segments inner tests leak; removed at the end."""
    names: list[str] = []
    yield names
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{name}")


def _leaked_pid(leftovers: Path, name: str) -> int:
    return int((leftovers / name).read_text().split()[0])


# --- options, help, registration ----------------------------------------------------------


def test_help_lists_the_options_and_ini_keys(inner: pytest.Pytester) -> None:
    result = inner.runpytest_subprocess("--help")
    assert result.ret == 0
    out = result.stdout.str()
    assert "leakcheck:" in out
    for flag in (
        "--gpu-leak-check",
        "--no-gpu-leak-check",
        "--gpu-leak-tolerance=SIZE",
        "--gpu-leak-warn",
        "--gpu-leak-mode=fail|warn",
        "--gpu-leak-grace=SECONDS",
    ):
        assert flag in out
    for key in ("gpu_leak_check", "gpu_leak_tolerance", "gpu_leak_mode", "gpu_leak_grace"):
        assert key in out


def test_marker_is_registered_with_a_help_line(inner: pytest.Pytester) -> None:
    result = inner.runpytest_subprocess("--markers")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["@pytest.mark.gpu_leak_check(enabled=True, tolerance=*"])


def test_p_no_leakcheck_disables_the_plugin(inner: pytest.Pytester, leftovers: Path) -> None:
    sleep, _ = _write_leaky_suite(inner, leftovers)
    inner.makeini("[pytest]\ngpu_leak_check = 1\n")
    result = inner.runpytest_subprocess("-p", "no:leakcheck", "-k", "child", *NO_CACHE)
    result.assert_outcomes(passed=1, deselected=3)
    assert "LEAK REPORT" not in result.stdout.str()
    bad = inner.runpytest_subprocess("-p", "no:leakcheck", "--gpu-leak-check")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    assert _alive(_leaked_pid(leftovers, sleep))  # nobody checked, nobody killed it


@pytest.mark.parametrize(
    ("args", "ini", "env", "expected"),
    [
        (["--gpu-leak-tolerance=lots"], "", {}, "--gpu-leak-tolerance (command line)"),
        (["--gpu-leak-grace=-1"], "", {}, "--gpu-leak-grace (command line)"),
        (["--gpu-leak-mode=explode"], "", {}, "--gpu-leak-mode (command line)"),
        (["--gpu-leak-tolerance="], "", {}, "--gpu-leak-tolerance (command line)"),
        (["--gpu-leak-grace="], "", {}, "--gpu-leak-grace (command line)"),
        (["--gpu-leak-mode="], "", {}, "--gpu-leak-mode (command line)"),
        (
            ["--gpu-leak-check"],
            "gpu_leak_tolerance = 12 parsecs\n",
            {},
            "gpu_leak_tolerance (ini file ",
        ),
        ([], "gpu_leak_check = maybe\n", {}, "gpu_leak_check (ini file "),
        (
            ["--gpu-leak-check"],
            "",
            {"LEAKCHECK_TOLERANCE": "-5"},
            "LEAKCHECK_TOLERANCE (environment)",
        ),
        (
            [],
            "",
            {"LEAKCHECK_GPU_LEAK_CHECK": "1", "LEAKCHECK_GRACE": "x"},
            "LEAKCHECK_GRACE (environment)",
        ),
        ([], "", {"LEAKCHECK_GPU_LEAK_CHECK": "sure"}, "LEAKCHECK_GPU_LEAK_CHECK (environment)"),
    ],
)
def test_bad_values_are_usage_errors_naming_their_source(
    inner: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
    ini: str,
    env: dict[str, str],
    expected: str,
) -> None:
    inner.makepyfile(test_ok="def test_ok():\n    pass\n")
    if ini:
        inner.makeini("[pytest]\n" + ini)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = inner.runpytest_subprocess(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert expected in result.stderr.str()
    assert "got " in result.stderr.str()


def test_bad_marker_argument_is_a_usage_error(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        test_marked="""
        import pytest

        @pytest.mark.gpu_leak_check(tolerance="a lot")
        def test_one():
            pass
        """
    )
    result = inner.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "tolerance= of gpu_leak_check marker on test_marked.py::test_one" in (
        result.stderr.str()
    )


BAD_SOURCES = {"LEAKCHECK_TOLERANCE": "lots", "LEAKCHECK_GRACE": "-1", "LEAKCHECK_MODE": "boom"}


def test_bad_environment_and_ini_values_stay_silent_while_the_check_is_off(
    inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A machine's environment and a project's ini file reach every run: with the check off
    # they must not break one (NOTE [off means off]).
    inner.makepyfile(test_ok="def test_ok():\n    pass\n")
    inner.makeini("[pytest]\ngpu_leak_grace = soon\n")
    for name, value in BAD_SOURCES.items():
        monkeypatch.setenv(name, value)
    off = inner.runpytest_subprocess(*NO_CACHE)
    assert off.ret == pytest.ExitCode.OK
    off.assert_outcomes(passed=1)
    assert "LEAK REPORT" not in off.stdout.str()
    # With the check on, the same values are usage errors naming where they came from.
    on = inner.runpytest_subprocess("--gpu-leak-check", *NO_CACHE)
    assert on.ret == pytest.ExitCode.USAGE_ERROR
    assert "LEAKCHECK_TOLERANCE (environment)" in on.stderr.str()
    for name in BAD_SOURCES:
        monkeypatch.delenv(name)
    ini = inner.runpytest_subprocess("--gpu-leak-check", *NO_CACHE)
    assert ini.ret == pytest.ExitCode.USAGE_ERROR
    assert "gpu_leak_grace (ini file " in ini.stderr.str()


@pytest.mark.parametrize(
    "test_code",
    [
        "import pytest\n\n@pytest.mark.gpu_leak_check(True)\ndef test_marked():\n    pass\n",
        "def test_tracked(gpu_leak_tracker):\n    pass\n",
    ],
    ids=["marker", "fixture"],
)
def test_a_marker_or_the_tracker_fixture_turns_validation_on(
    inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, test_code: str
) -> None:
    inner.makepyfile(test_one=test_code)
    monkeypatch.setenv("LEAKCHECK_TOLERANCE", "lots")
    result = inner.runpytest_subprocess(*NO_CACHE)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "LEAKCHECK_TOLERANCE (environment): expected a size" in result.stderr.str()


@pytest.mark.parametrize(
    "args",
    [
        ["--gpu-leak-warn", "--gpu-leak-mode=fail"],
        ["--gpu-leak-mode=fail", "--gpu-leak-warn"],
    ],
)
def test_warn_flag_with_mode_fail_is_a_usage_error(inner: pytest.Pytester, args: list[str]) -> None:
    inner.makepyfile(test_ok="def test_ok():\n    pass\n")
    result = inner.runpytest_subprocess("--gpu-leak-check", *args, *NO_CACHE)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "--gpu-leak-warn (command line): contradicts --gpu-leak-mode" in result.stderr.str()
    agree = inner.runpytest_subprocess(
        "--gpu-leak-check", "--gpu-leak-warn", "--gpu-leak-mode=warn", *NO_CACHE
    )
    agree.assert_outcomes(passed=1)


# --- verdicts -----------------------------------------------------------------------------


def test_child_left_alive_fails_its_test_and_is_named(
    inner: pytest.Pytester, leftovers: Path, shm_names: list[str]
) -> None:
    sleep, shm = _write_leaky_suite(inner, leftovers)
    shm_names.append(shm)
    result = inner.runpytest_subprocess("--gpu-leak-check", "-rA", *FAST)
    pid = _leaked_pid(leftovers, sleep)
    out = result.stdout.str()
    # Each test is counted once: two pass, two fail as LEAKED.
    result.assert_outcomes(passed=2, failed=2)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "LEAKED test_leaky.py::test_leaves_child - Failed: leakcheck*",
            "LEAKED test_leaky.py::test_leaves_shm - Failed: leakcheck*",
        ]
    )
    assert (
        f"LEAK survivor  descendant sleep {sleep} (PID {pid}) started in the test, alive"
        in out
    )
    assert f"LEAK shm  /dev/shm/{shm} (8 KiB) left behind, still held by the parent" in out
    # The report section, with a fix per finding.
    assert "- gpu-leak-check -" in out
    assert "  fix: join or terminate the processes and pools the work starts" in out
    assert "  fix: unlink the shared memory the work creates" in out
    # The session summary names both tests (a leak of processes and files: no GPU in it).
    summary = out[out.index("= LEAK REPORT =") : out.index("short test summary info")]
    assert "2 of 4 checked tests left something behind" in summary
    assert "LEAKED test_leaky.py::test_leaves_child: 1 process" in summary
    assert "LEAKED test_leaky.py::test_leaves_shm: 1 /dev/shm file" in summary
    assert "test_clean" not in summary


def test_clean_suite_passes_with_one_summary_line(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        test_clean="""
        import multiprocessing, subprocess
        from multiprocessing import shared_memory

        def square(x):
            return x * x

        def test_waits_for_its_child():
            subprocess.run(["true"], check=True)

        def test_unlinks_its_segment():
            segment = shared_memory.SharedMemory(create=True, size=4096)
            segment.close()
            segment.unlink()

        def test_pool_in_a_with_block():
            with multiprocessing.get_context("fork").Pool(2) as pool:
                assert pool.map(square, [1, 2, 3]) == [1, 4, 9]
                pool.close()
                pool.join()

        def test_spawned_process_joined():
            ctx = multiprocessing.get_context("spawn")
            proc = ctx.Process(target=print, args=("hello",))
            proc.start()
            proc.join()
        """
    )
    result = inner.runpytest_subprocess("--gpu-leak-check", *FAST)
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["*= LEAK REPORT: no leaks in 4 checked tests; GPU: * =*"])


def test_orphaned_grandchild_fails_as_orphan(inner: pytest.Pytester, leftovers: Path) -> None:
    sleep = _sleep_arg()
    inner.makepyfile(
        test_orphan=f"""
        import os, subprocess

        def test_shell_leaves_background_job():
            out = subprocess.run(
                ["sh", "-c", "sleep {sleep} >/dev/null 2>&1 & echo $!"],
                check=True, capture_output=True, text=True,
            ).stdout
            with open(os.path.join({str(leftovers)!r}, "{sleep}"), "w") as handle:
                handle.write(out.strip())
        """
    )
    result = inner.runpytest_subprocess("--gpu-leak-check", *FAST)
    pid = _leaked_pid(leftovers, sleep)
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert f"LEAK orphan  sleep {sleep} (PID {pid}) outlived its parent since the test" in out
    assert f"  fix: leakcheck.worker_init_fn(terminate_children=True), or kill {pid}" in out


def test_forked_grandchild_of_an_exited_worker_is_found(
    inner: pytest.Pytester, leftovers: Path
) -> None:
    # A fork-only grandchild never exec'd: it carries no tag, and its parent is gone.
    token = f"lc_fork_{uuid.uuid4().hex[:10]}"
    inner.makepyfile(
        **{
            f"test_{token}": f"""
            import multiprocessing, os, time

            def grandchild():
                time.sleep(600)

            def worker(path):
                ctx = multiprocessing.get_context("fork")
                proc = ctx.Process(target=grandchild, daemon=False)
                proc.start()
                with open(path, "w") as handle:
                    handle.write(f"{{proc.pid}} {{os.getcwd()}}")
                os._exit(0)  # the worker dies; its child is reparented

            def test_worker_leaves_forked_grandchild():
                ctx = multiprocessing.get_context("fork")
                proc = ctx.Process(target=worker, args=(os.path.join({str(leftovers)!r},
                                   "{token}"),))
                proc.start()
                proc.join()
            """
        }
    )
    result = inner.runpytest_subprocess("--gpu-leak-check", *FAST)
    pid = _leaked_pid(leftovers, token)
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert re.search(rf"LEAK orphan  .* \(PID {pid}\) outlived its parent", out), out


def test_segment_closed_but_not_unlinked_fails(
    inner: pytest.Pytester, shm_names: list[str]
) -> None:
    name = f"lc_test_{uuid.uuid4().hex[:12]}"
    shm_names.append(name)
    inner.makepyfile(
        test_shm=f"""
        from multiprocessing import resource_tracker, shared_memory

        def test_forgets_unlink():
            segment = shared_memory.SharedMemory(create=True, size=1 << 20, name="{name}")
            segment.close()
            # Keep the interpreter's tracker from removing it at exit: a real leak.
            resource_tracker.unregister(segment._name, "shared_memory")
        """
    )
    result = inner.runpytest_subprocess("--gpu-leak-check", *FAST)
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert f"LEAK shm  /dev/shm/{name} (1.0 MiB) left behind, held by nobody" in out


def test_run_serially_a_file_another_job_makes_during_a_test_is_not_the_tests_leak(
    inner: pytest.Pytester, shm_names: list[str], tmp_path: Path
) -> None:
    """Another job on the machine (no process of the session) makes a /dev/shm file while a
    test runs and closes it: nothing ties it to the test, so it is said, never blamed."""
    name = f"lc_test_{uuid.uuid4().hex[:12]}"
    shm_names.append(name)
    trigger = tmp_path / "test-started"
    # Written beside, then renamed: held by nobody once it shows under its name.
    stranger = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys, time\n"
            f"while not os.path.exists({str(trigger)!r}): time.sleep(0.01)\n"
            f"open('/dev/shm/.{name}', 'wb').write(b'x' * 4096)\n"
            f"os.rename('/dev/shm/.{name}', '/dev/shm/{name}')\n",
        ],
        env={k: v for k, v in os.environ.items() if k != "LEAKCHECK_SESSION"},
    )
    try:
        inner.makepyfile(
            test_alone=f"""
            import os, time

            def test_while_another_job_runs():
                open({str(trigger)!r}, "w").close()
                deadline = time.monotonic() + 60
                while not os.path.exists("/dev/shm/{name}") and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert os.path.exists("/dev/shm/{name}")
            """
        )
        result = inner.runpytest_subprocess("--gpu-leak-check", *FAST)
    finally:
        stranger.wait()
    result.assert_outcomes(passed=1)
    out = result.stdout.str()
    assert "LEAK shm" not in out, out
    assert "1 /dev/shm file appeared while tests ran, and nothing tied them to a test" in out


def test_persistent_workers_kept_alive_by_a_reference_cycle_fail_with_that_cause(
    inner: pytest.Pytester,
) -> None:
    inner.makepyfile(
        test_cycle="""
        import gc
        import torch
        from torch.utils.data import DataLoader

        def test_loader_in_a_cycle():
            gc.disable()  # no collection of its own before leakcheck's: a cycle stays put
            loader = DataLoader(
                torch.arange(8.0), batch_size=2, num_workers=1, persistent_workers=True,
                multiprocessing_context="fork",
            )
            for _ in loader:
                pass
            loader.myself = loader  # the loader keeps its iterator, the cycle keeps both
        """
    )
    result = inner.runpytest_subprocess("--gpu-leak-check", *FAST)
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "LEAK survivor  worker of " in out
    assert "; kept by a reference cycle" in out
    assert "fix: break the reference cycle that keeps the loader's iterator alive" in out


def test_a_torch_segment_left_behind_fails_with_its_cause(
    inner: pytest.Pytester, shm_names: list[str]
) -> None:
    inner.makepyfile(
        test_torch_shm="""
        import torch

        KEEP = []

        def test_shares_a_tensor_through_dev_shm():
            torch.multiprocessing.set_sharing_strategy("file_system")
            KEEP.append(torch.zeros(1 << 16).share_memory_())  # a torch_* file, kept
        """
    )
    before = set(os.listdir("/dev/shm"))
    try:
        result = inner.runpytest_subprocess("--gpu-leak-check", *FAST)
    finally:
        # The torch_* file the inner session made stays after it (it is a leak): removed.
        # Only files whose creator is gone: another test's live loader may be sharing one.
        for name in set(os.listdir("/dev/shm")) - before:
            creator = shm_creator_pid(name)
            if name.startswith("torch_") and creator is not None and not _alive(creator):
                shm_names.append(name)
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert re.search(r"LEAK shm  /dev/shm/torch_\S+ \(256 KiB\) left behind, ", out), out
    assert ": a torch shared tensor (file_system sharing)" in out
    assert "fix: let the loader's iterators finish" in out


def test_a_segment_named_after_a_process_of_the_test_is_blamed(shm_names: list[str]) -> None:
    checker = Checker()
    window = checker.begin()
    # Files named after the test process and after a process it started, as torch's
    # file_system strategy and CUDA IPC name theirs: the test's, even with other jobs around.
    # (A file of a gone process named after none cannot be told from another job's.)
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        token = uuid.uuid4().int % 10**9
        names = [f"torch_{os.getpid()}_{token}", f"cuda.shm.{token:x}.{child.pid:x}.1"]
        stranger = f"lc_test_{uuid.uuid4().hex[:12]}"
        _made_elsewhere(shm_names, *names, stranger)
        found = _shm_findings(checker, window)
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait()
    for name in names:
        assert found[name].severity == "leak", found[name].message
        assert "left behind, held by nobody" in found[name].message
    assert "torch shared tensor" in found[names[0]].message
    assert "CUDA IPC: workers returned CUDA tensors" in found[names[1]].message
    assert "return CPU tensors" in found[names[1]].remedy
    # Nothing ties the third to this test: said plainly, not blamed.
    assert found[stranger].severity == "info"
    assert "nothing ties it to the work" in found[stranger].message


def test_a_segment_named_after_an_older_strangers_process_is_not_blamed(
    shm_names: list[str],
) -> None:
    """A file whose name says who made it, a process neither the test's nor younger than the
    test, is another job's: said as such (on a host whose /dev/shm every job shares). One named
    after a child the test forked, gone by its end (a DataLoader worker), is the test's."""
    checker = Checker()
    older = subprocess.Popen([sys.executable, "-c", "pass"])
    older.wait()  # started before the test; gone by its end
    window = checker.begin()
    child = multiprocessing.get_context("fork").Process(target=int)
    child.start()
    child.join()  # the test's own, also gone (NOTE [fork ledger])
    token = uuid.uuid4().int % 10**9
    stranger, own = f"torch_{older.pid}_{token}_0", f"torch_{child.pid}_{token}_0"
    _made_elsewhere(shm_names, stranger, own)
    found = _shm_findings(checker, window)
    assert found[stranger].severity == "info", found[stranger].message
    assert f"made by PID {older.pid}, older than the work" in found[stranger].message
    assert found[own].severity == "leak", found[own].message


def test_a_file_named_after_an_older_process_and_held_by_a_stranger_is_not_reported(
    shm_names: list[str],
) -> None:
    """Held by a process that is not the test's, a file is the holder's business: no finding,
    whatever its name says (not an info that says nobody holds it)."""
    checker = Checker()
    older = subprocess.Popen([sys.executable, "-c", "pass"])
    older.wait()
    name = f"torch_{older.pid}_{uuid.uuid4().int % 10**9}_0"
    shm_names.append(name)
    path = f"/dev/shm/{name}"
    holder = subprocess.Popen(  # older than the test's window: a stranger to it
        [
            sys.executable,
            "-c",
            "import os, sys, time\n"
            f"while not os.path.exists({path!r}): time.sleep(0.01)\n"
            f"f = open({path!r}, 'rb'); print('held', flush=True); sys.stdin.readline()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        window = checker.begin()
        _made_elsewhere(shm_names, name)
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        found = _shm_findings(checker, window)
        assert name not in found, found[name].message
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("stem", ["mydata_42", "cache_2024_part_1", "psm_12345678"])
def test_a_number_in_a_name_that_no_scheme_gives_is_no_maker(
    stem: str, shm_names: list[str]
) -> None:
    """Only torch's and CUDA IPC's schemes say who made a file: a small number elsewhere in a
    name (a date, a count, a hex name of digits) says nothing; the test process made it (NOTE
    [made here]), so the test's leak is blamed."""
    checker = Checker()
    window = checker.begin()
    name = f"{stem}_{uuid.uuid4().hex[:6]}x"
    _leave_shm(shm_names, name)
    found = _shm_findings(checker, window)
    assert found[name].severity == "leak", found[name].message


def test_an_unknown_pid_mark_is_no_proof_that_a_maker_is_older(
    shm_names: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the PID counter cannot be read (no /proc/loadavg), a torch file of a gone
    process is not said to be an older process's: only that nothing ties it to the test."""
    monkeypatch.setattr(procs, "last_pid", lambda: None)
    checker = Checker()
    older = subprocess.Popen([sys.executable, "-c", "pass"])
    older.wait()
    window = checker.begin()
    name = f"torch_{older.pid}_{uuid.uuid4().int % 10**9}_0"
    _made_elsewhere(shm_names, name)
    found = _shm_findings(checker, window)
    assert found[name].severity == "info", found[name].message
    assert "nothing ties it to the work" in found[name].message


def test_handed_out_since_follows_the_pid_counter_and_its_wrap() -> None:
    from leakcheck.observe.procs import PidMark, handed_out_since

    mark = PidMark(last_pid=1000, names=frozenset(), unix_s=0.0, boot_s=0.0)
    assert handed_out_since(mark, 1001, 1200) is True
    assert handed_out_since(mark, 1000, 1200) is False
    assert handed_out_since(mark, 999, 1200) is False
    assert handed_out_since(mark, 1201, 1200) is False
    assert handed_out_since(mark, 1001, 1000) is False  # nothing handed out since
    assert handed_out_since(mark, 5, 20) is True  # wrapped: past pid_max, from the start
    assert handed_out_since(mark, 4000, 20) is True
    assert handed_out_since(mark, 500, 20) is False
    unknown = PidMark(last_pid=None, names=frozenset(), unix_s=0.0, boot_s=0.0)
    assert handed_out_since(unknown, 5, 20) is None


# --- markers, modes, sources --------------------------------------------------------------


def test_marker_disables_a_test_and_enables_another(
    inner: pytest.Pytester, leftovers: Path
) -> None:
    first, second = _sleep_arg(), _sleep_arg()
    inner.makepyfile(
        test_marked=f"""
        import os, subprocess
        import pytest

        KEEP = []

        def leak(arg):
            proc = subprocess.Popen(["sleep", arg])
            KEEP.append(proc)
            with open(os.path.join({str(leftovers)!r}, arg), "w") as handle:
                handle.write(str(proc.pid))

        @pytest.mark.gpu_leak_check(enabled=False)
        def test_opted_out():
            leak("{first}")

        @pytest.mark.gpu_leak_check(enabled=True)
        def test_opted_in():
            leak("{second}")
        """
    )
    on = inner.runpytest_subprocess("--gpu-leak-check", *FAST)
    on.assert_outcomes(passed=1, failed=1)
    on.stdout.fnmatch_lines(["LEAKED test_marked.py::test_opted_in*"])
    assert "test_opted_out" not in on.stdout.str().split("= LEAK REPORT =")[1]
    _kill_matching({first, second})
    # Without the flag, the marker alone checks its test.
    off = inner.runpytest_subprocess(*FAST)
    off.assert_outcomes(passed=1, failed=1)
    assert "1 of 1 checked test left something behind" in off.stdout.str()


def test_tolerance_and_grace_resolve_marker_cli_env_ini(
    inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The gpu_leak_tracker fixture is built from the test's resolved options.
    inner.makeini("[pytest]\ngpu_leak_tolerance = 2GB\ngpu_leak_grace = 3\n")
    inner.makepyfile(
        test_sources="""
        import pytest

        def test_session_options(gpu_leak_tracker):
            assert gpu_leak_tracker.config.tolerance_bytes == 1_000_000_000
            assert gpu_leak_tracker.config.grace_s == 3.0

        @pytest.mark.gpu_leak_check(tolerance="64MiB", grace="250ms")
        def test_marker_wins(gpu_leak_tracker):
            assert gpu_leak_tracker.config.tolerance_bytes == 64 * 1024 * 1024
            assert gpu_leak_tracker.config.grace_s == 0.25
            with gpu_leak_tracker.epoch("one"):
                pass
        """
    )
    monkeypatch.setenv("LEAKCHECK_TOLERANCE", "5GB")  # command line beats environment
    result = inner.runpytest_subprocess("--gpu-leak-check", "--gpu-leak-tolerance=1GB")
    result.assert_outcomes(passed=2)
    monkeypatch.setenv("LEAKCHECK_TOLERANCE", "1000000000")  # environment beats ini
    result = inner.runpytest_subprocess("--gpu-leak-check")
    result.assert_outcomes(passed=2)


def test_ini_and_environment_enable_the_check(
    inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, leftovers: Path
) -> None:
    sleep = _sleep_arg()
    inner.makepyfile(
        test_one=f"""
        import os, subprocess
        KEEP = []

        def test_leaks():
            proc = subprocess.Popen(["sleep", "{sleep}"])
            KEEP.append(proc)
            with open(os.path.join({str(leftovers)!r}, "{sleep}"), "w") as handle:
                handle.write(str(proc.pid))
        """
    )
    inner.makeini("[pytest]\ngpu_leak_check = true\ngpu_leak_grace = 0.2\n")
    inner.runpytest_subprocess().assert_outcomes(failed=1)
    # The command line turns off what the ini turned on.
    inner.runpytest_subprocess("--no-gpu-leak-check").assert_outcomes(passed=1)
    inner.makeini("[pytest]\ngpu_leak_grace = 0.2\n")
    monkeypatch.setenv("LEAKCHECK_GPU_LEAK_CHECK", "1")
    inner.runpytest_subprocess().assert_outcomes(failed=1)
    monkeypatch.setenv("LEAKCHECK_GPU_LEAK_CHECK", "0")
    inner.runpytest_subprocess().assert_outcomes(passed=1)


def test_warn_mode_warns_and_passes(
    inner: pytest.Pytester, leftovers: Path, shm_names: list[str]
) -> None:
    _sleep, shm = _write_leaky_suite(inner, leftovers)
    shm_names.append(shm)
    result = inner.runpytest_subprocess("--gpu-leak-check", "--gpu-leak-warn", *FAST)
    result.assert_outcomes(passed=4, warnings=2)
    out = result.stdout.str()
    assert "LeakWarning: leakcheck: the test left 1 process" in out
    assert "WARNED test_leaky.py::test_leaves_child: 1 process" in out
    # -W error turns the warning back into a failure.
    again = inner.runpytest_subprocess(
        "--gpu-leak-check",
        "--gpu-leak-mode=warn",
        "-W",
        "error::leakcheck.GPULeakWarning",
        "-k",
        "shm",
        *FAST,
    )
    again.assert_outcomes(failed=1, deselected=3)


# --- scopes -------------------------------------------------------------------------------

SCOPED = """
import os, subprocess
import pytest

PIDS = {pids!r}

def start(arg):
    proc = subprocess.Popen(["sleep", arg])
    with open(os.path.join(PIDS, arg), "w") as handle:
        handle.write(str(proc.pid))
    return proc

@pytest.fixture(scope="module")
def pool():
    proc = start("{good}")
    yield proc
    proc.kill()
    proc.wait()

@pytest.fixture(scope="module")
def forgetful_pool():
    proc = start("{bad}")
    yield proc  # never stopped

def test_first(pool):
    assert pool.poll() is None

def test_second(pool):
    assert pool.poll() is None

def test_forgetful_first(forgetful_pool):
    assert forgetful_pool.poll() is None

def test_forgetful_last(forgetful_pool):
    assert forgetful_pool.poll() is None
"""


def test_module_fixture_process_is_judged_when_its_scope_ends(
    inner: pytest.Pytester, leftovers: Path
) -> None:
    good, bad = _sleep_arg(), _sleep_arg()
    inner.makepyfile(test_scoped=SCOPED.format(pids=str(leftovers), good=good, bad=bad))
    inner.makepyfile(test_zlater="def test_after_the_module():\n    pass\n")
    result = inner.runpytest_subprocess("--gpu-leak-check", "-v", *FAST)
    bad_pid = _leaked_pid(leftovers, bad)
    # The pool that is stopped by its finalizer is no leak; the one that outlives its module
    # fails the test whose teardown ended the module, not a test of another module.
    result.assert_outcomes(passed=4, failed=1)
    result.stdout.fnmatch_lines(
        [
            "test_scoped.py::test_first PASSED*",
            "test_scoped.py::test_second PASSED*",
            "test_scoped.py::test_forgetful_first PASSED*",
            "test_scoped.py::test_forgetful_last LEAKED*",
            "test_zlater.py::test_after_the_module PASSED*",
        ]
    )
    out = result.stdout.str()
    assert "test_forgetful_last PASSED" not in out  # one outcome per test
    assert (
        f"LEAK survivor  descendant sleep {bad} (PID {bad_pid}) started by module-scoped "
        "fixture 'forgetful_pool', alive" in out
    )
    assert "  fix: stop it in the fixture's finalizer" in out
    assert "1 of 5 checked tests left something behind" in out
    # The test whose teardown ended the module left nothing itself: its failure names the
    # fixture, as does its line of the summary.
    failure = f"leakcheck: module-scoped fixture 'forgetful_pool' left 1 process (PID {bad_pid})"
    assert failure in out
    assert "the test left" not in out
    assert (
        "LEAKED test_scoped.py::test_forgetful_last: 1 process, "
        "left by module-scoped fixture 'forgetful_pool'" in out
    )


def test_a_process_that_setupclass_starts_is_named_after_it(
    inner: pytest.Pytester, leftovers: Path
) -> None:
    """unittest's setUpClass is a class-scoped fixture to pytest, under a name of its own
    making: the report says setUpClass and the class, and where to stop the process."""
    arg = _sleep_arg()
    inner.makepyfile(
        test_case=f"""
        import os, subprocess, unittest

        class Loaders(unittest.TestCase):
            @classmethod
            def setUpClass(cls):
                cls.proc = subprocess.Popen(["sleep", "{arg}"])
                with open(os.path.join({str(leftovers)!r}, "{arg}"), "w") as handle:
                    handle.write(str(cls.proc.pid))

            def test_one(self):
                self.assertIsNone(self.proc.poll())

            def test_two(self):
                self.assertIsNone(self.proc.poll())
        """
    )
    result = inner.runpytest_subprocess("--gpu-leak-check", *FAST)
    pid = _leaked_pid(leftovers, arg)
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    assert f"leakcheck: setUpClass of Loaders left 1 process (PID {pid})" in out, out
    assert f"(PID {pid}) started by setUpClass of Loaders, alive" in out, out
    assert "fix: stop it in the fixture's finalizer (after its yield; tearDownClass" in out, out
    assert "_unittest_setUpClass_fixture_" not in out, out


def test_a_module_fixture_that_begins_and_ends_in_one_test_is_still_named(
    inner: pytest.Pytester, leftovers: Path
) -> None:
    """The only test of a module (or the one that -k or --lf picked) sets up and ends its
    module-scoped fixture: what the fixture left is the fixture's, with the fixture's fix."""
    bad = _sleep_arg()
    inner.makepyfile(test_scoped=SCOPED.format(pids=str(leftovers), good=_sleep_arg(), bad=bad))
    result = inner.runpytest_subprocess("--gpu-leak-check", "-k", "forgetful_last", *FAST)
    bad_pid = _leaked_pid(leftovers, bad)
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert f"(PID {bad_pid}) started by module-scoped fixture 'forgetful_pool', alive" in out
    assert "  fix: stop it in the fixture's finalizer" in out
    assert "started in the test" not in out


def test_session_fixture_process_is_not_a_leak_of_the_first_test(
    inner: pytest.Pytester, leftovers: Path
) -> None:
    arg = _sleep_arg()
    inner.makeconftest(
        f"""
        import os, subprocess
        import pytest

        @pytest.fixture(scope="session", autouse=True)
        def server():
            proc = subprocess.Popen(["sleep", "{arg}"])
            with open(os.path.join({str(leftovers)!r}, "{arg}"), "w") as handle:
                handle.write(str(proc.pid))
            yield proc
            proc.terminate()
            proc.wait()
        """
    )
    inner.makepyfile(test_a="def test_a():\n    pass\n", test_b="def test_b():\n    pass\n")
    result = inner.runpytest_subprocess("--gpu-leak-check", *FAST)
    result.assert_outcomes(passed=2)
    assert "no leaks in 2 checked tests" in result.stdout.str()


# --- integration: xdist, JUnit, flag off --------------------------------------------------


def test_xdist_gives_the_same_verdicts(
    inner: pytest.Pytester, leftovers: Path, shm_names: list[str]
) -> None:
    sleep, shm = _write_leaky_suite(inner, leftovers)
    shm_names.append(shm)
    result = inner.runpytest_subprocess("--gpu-leak-check", "-n", "2", "-rA", *FAST)
    pid = _leaked_pid(leftovers, sleep)
    result.assert_outcomes(passed=2, failed=2)
    out = result.stdout.str()
    summary = out[out.index("= LEAK REPORT =") :]
    assert "2 of 4 checked tests left something behind" in summary
    assert "LEAKED test_leaky.py::test_leaves_shm: 1 /dev/shm file" in summary
    assert f"LEAK survivor  descendant sleep {sleep} (PID {pid}) started in" in out
    assert f"/dev/shm/{shm}" in out
    result.stdout.fnmatch_lines(["LEAKED test_leaky.py::test_leaves_child*"])


def test_junitxml_records_the_leak_on_its_testcase(
    inner: pytest.Pytester, leftovers: Path, shm_names: list[str]
) -> None:
    sleep, shm = _write_leaky_suite(inner, leftovers)
    shm_names.append(shm)
    xml_path = inner.path / "junit.xml"
    result = inner.runpytest_subprocess("--gpu-leak-check", f"--junitxml={xml_path}", *FAST)
    result.assert_outcomes(passed=2, failed=2)
    root = ET.parse(xml_path).getroot()
    # One testcase per test, and one failure or error per leaked test.
    names = [case.attrib["name"] for case in root.iter("testcase")]
    assert sorted(names) == sorted(
        ["test_clean", "test_leaves_child", "test_leaves_shm", "test_clean_after"]
    )
    cases = {case.get("name"): case for case in root.iter("testcase")}
    child = cases["test_leaves_child"]
    problem = child.find("error")
    assert problem is not None
    assert len(child.findall("error")) + len(child.findall("failure")) == 1
    assert "leakcheck: the test left 1 process" in (problem.get("message") or "")
    props = {p.get("name"): p.get("value") for p in child.iter("property")}
    assert f"sleep {sleep}" in (props.get("gpu_leak_check") or "")
    assert cases["test_clean"].find("error") is None
    suite = next(root.iter("testsuite"))
    assert (suite.get("tests"), suite.get("errors"), suite.get("failures")) == ("4", "2", "0")


FLAG_PROBE = """
import os, subprocess, sys, threading

def test_probe():
    subprocess.Popen(["sleep", "{sleep}"])  # a leak nobody looks for when the flag is off
    with open(os.path.join({pids!r}, "{sleep}"), "w") as handle:
        handle.write("0")
    loaded = sorted(name for name in sys.modules if name.startswith(("leakcheck", "pynvml")))
    print()
    print("LOADED", loaded)
    print("THREADS", threading.active_count())
    print("TAG", os.environ.get("LEAKCHECK_SESSION"))
    print("TORCH", "torch" in sys.modules)
"""


def _probe_lines(result: pytest.RunResult) -> dict[str, str]:
    lines = {}
    for line in result.stdout.lines:
        match = re.match(r"^(LOADED|THREADS|TAG|TORCH) (.*)$", line)
        if match:
            lines[match.group(1)] = match.group(2)
    return lines


def test_flag_off_loads_nothing_and_starts_nothing(inner: pytest.Pytester, leftovers: Path) -> None:
    inner.makepyfile(test_probe=FLAG_PROBE.format(sleep=_sleep_arg(), pids=str(leftovers)))
    result = inner.runpytest_subprocess("-s", *NO_CACHE)
    result.assert_outcomes(passed=1)
    probe = _probe_lines(result)
    # The plugin is loaded, but neither NVML, /proc code nor the checker are.
    assert "'leakcheck.adapters.plugin'" in probe["LOADED"]
    for module in (
        "pynvml",
        "leakcheck.observe.nvml",
        "leakcheck.observe.nvml_lib",
        "leakcheck.observe.procs",
        "leakcheck.adapters.plugin_observe",
        "leakcheck.judge.verdict",
        "leakcheck.judge.report",
        "leakcheck.track.tracker",
    ):
        assert f"'{module}'" not in probe["LOADED"]
    assert probe["THREADS"] == "1"
    assert probe["TAG"] == "None"
    assert probe["TORCH"] == "False"
    assert "LEAK REPORT" not in result.stdout.str()


def test_flag_on_imports_no_torch_and_starts_no_thread(
    inner: pytest.Pytester, leftovers: Path
) -> None:
    inner.makepyfile(test_probe=FLAG_PROBE.format(sleep=_sleep_arg(), pids=str(leftovers)))
    result = inner.runpytest_subprocess("-s", "--gpu-leak-check", *FAST)
    result.assert_outcomes(failed=1)  # the probe's own sleeper
    probe = _probe_lines(result)
    assert probe["THREADS"] == "1"
    assert probe["TORCH"] == "False"
    assert probe["TAG"].startswith("pytest-")


def test_failing_test_that_also_leaks_is_one_failure_with_our_section(
    inner: pytest.Pytester, leftovers: Path
) -> None:
    sleep = _sleep_arg()
    inner.makepyfile(
        test_both=textwrap.dedent(
            f"""
            import os, subprocess
            KEEP = []

            def test_fails_and_leaks():
                proc = subprocess.Popen(["sleep", "{sleep}"])
                KEEP.append(proc)
                with open(os.path.join({str(leftovers)!r}, "{sleep}"), "w") as handle:
                    handle.write(str(proc.pid))
                assert False, "the test's own failure"
            """
        )
    )
    xml_path = inner.path / "junit.xml"
    result = inner.runpytest_subprocess("--gpu-leak-check", f"--junitxml={xml_path}", *FAST)
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "the test's own failure" in out
    # The failure shows our section; the summary names the leak.
    failure = out[out.index("_ test_fails_and_leaks _") : out.index("= LEAK REPORT =")]
    assert "- gpu-leak-check -" in failure
    assert f"LEAK survivor  descendant sleep {sleep} (PID " in failure
    assert "LEAKED test_both.py::test_fails_and_leaks: 1 process" in out
    (case,) = ET.parse(xml_path).getroot().iter("testcase")
    assert [child.tag for child in case if child.tag in ("failure", "error")] == ["failure"]


COUNTED = """
import os, subprocess
import pytest

KEEP = []

@pytest.mark.parametrize("n", range({clean}))
def test_clean(n):
    pass

def test_leaks():
    proc = subprocess.Popen(["sleep", "{sleep}"])
    KEEP.append(proc)
    with open(os.path.join({pids!r}, "{sleep}"), "w") as handle:
        handle.write(str(proc.pid))
"""


@pytest.mark.parametrize("xdist", [(), ("-n", "2")], ids=["serial", "xdist"])
def test_a_leaked_test_is_counted_once(
    inner: pytest.Pytester, leftovers: Path, xdist: tuple[str, ...]
) -> None:
    suite = COUNTED.format(clean=19, sleep=_sleep_arg(), pids=str(leftovers))
    inner.makepyfile(test_counted=suite)
    result = inner.runpytest_subprocess("--gpu-leak-check", "-rA", *xdist, *FAST)
    # 20 tests, one leak: "1 failed, 19 passed", as the user reads it.
    result.assert_outcomes(passed=19, failed=1)
    result.stdout.fnmatch_lines(["*= 1 failed, 19 passed in *"])
    out = result.stdout.str()
    assert "PASSED test_counted.py::test_leaks" not in out
    assert out.count("LEAKED test_counted.py::test_leaks - Failed: leakcheck") == 1
    assert out.count("PASSED test_counted.py::test_clean[") == 19


# --- the checker in-process, with the pynvml fake -----------------------------------------


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakePynvml]:
    """One fake GPU in place of the NVML binding; the NVML singleton is reset around it."""
    fake = FakePynvml([FakeDevice()])
    monkeypatch.setitem(sys.modules, "leakcheck.observe.nvml_lib", fake)
    reset_nvml()
    yield fake
    reset_nvml()


@pytest.fixture
def child() -> Iterator[Any]:
    """A child of this process that names itself a runtime helper when asked.

    ``helper=True`` names it multiprocessing's resource tracker; ``helper="..."`` puts that
    module name on its command line.
    """
    procs: list[subprocess.Popen[bytes]] = []

    def start(*, helper: bool | str = False) -> subprocess.Popen[bytes]:
        name = helper if isinstance(helper, str) else "multiprocessing.resource_tracker"
        code = "import time; time.sleep(60)"
        proc = subprocess.Popen([sys.executable, "-c", code, name if helper else "plain"])
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


LABEL = "test_x.py::test_y"


def _judge(checker: Checker, window: Window, tolerance_bytes: int = 16 * MIB) -> list[Finding]:
    """The plugin's own path: observe the test as a timeline, judge it with the core."""
    options = CheckOptions(enabled=True, tolerance_bytes=tolerance_bytes, grace_s=0.05)
    try:
        return judge_test(checker, window, LABEL, options, time.monotonic())
    finally:
        checker.end_environment(window)


def _leave_shm(shm_names: list[str], *names: str) -> None:
    """Leave small files under these names in /dev/shm, as a test's work would (removed by
    the ``shm_names`` fixture at the end)."""
    shm_names.extend(names)
    for name in names:
        Path(f"/dev/shm/{name}").write_bytes(b"x" * 64)


def _made_elsewhere(shm_names: list[str], *names: str) -> None:
    """Leave small files in /dev/shm made by a process that is gone and named in none: no
    evidence ties them to anyone (removed by the ``shm_names`` fixture at the end)."""
    shm_names.extend(names)
    code = "import sys\nfor name in sys.argv[1:]: open('/dev/shm/' + name, 'wb').write(b'x')"
    subprocess.run([sys.executable, "-c", code, *names], check=True)


def _shm_findings(checker: Checker, window: Window) -> dict[str, Finding]:
    """The test judged as the plugin judges it: its /dev/shm findings by file name."""
    return {f.shm_name: f for f in _judge(checker, window) if f.rule == "shm" and f.shm_name}


def test_first_context_is_a_baseline_and_driver_growth_is_a_leak(fake_nvml: FakePynvml) -> None:
    device = fake_nvml.devices[0]
    checker = Checker()
    window = checker.begin()
    device.compute.append(FakeProcess(os.getpid(), 600 * MIB))  # the test creates a context
    assert _judge(checker, window) == []

    window = checker.begin()
    device.compute[0].usedGpuMemory = 856 * MIB
    (finding,) = _judge(checker, window)
    assert (finding.rule, finding.severity, finding.role) == ("residual", "leak", "parent")
    assert (finding.gpu_bytes, finding.device_index) == (256 * MIB, 0)
    assert finding.pid == os.getpid()
    assert f"(PID {os.getpid()}) holds GPU0 256 MiB more than at the start" in finding.message

    window = checker.begin()
    device.compute[0].usedGpuMemory = 860 * MIB
    assert _judge(checker, window) == []
    assert checker.gpu_note == "NVML"


def test_in_a_nested_pid_namespace_gpu_memory_is_never_attributed_per_process(
    fake_nvml: FakePynvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NVML reports host PIDs there: blind from the first read, also while it lists none."""
    monkeypatch.setattr(procs, "pid_namespace_nested", lambda: True)
    checker = Checker()
    window = checker.begin()
    assert checker.attribution[0] == "blind-namespace"  # while NVML lists no process yet
    assert "--pid=host" in checker.gpu_note
    fake_nvml.devices[0].compute.append(FakeProcess(os.getpid(), 600 * MIB))
    try:
        timeline = checker.observe(
            window, label=LABEL, end_s=time.monotonic(), grace_s=0.0, tolerance_bytes=MIB
        )
    finally:
        checker.end_environment(window)
    assert timeline.attribution == "blind-namespace"
    assert timeline.epochs[0].processes[0].gpu_bytes_end == {}  # no per-process bytes to judge


def test_a_strangers_process_costs_one_read_of_its_parent_not_a_walk_to_pid_1(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The walk up a new process's parents stops at one older than the lineage's root."""
    # Two children of this test process: one the lineage's root, the other a stranger to it
    # whose parent (this process) is older than that root. Both are made here, so the test
    # does not depend on which processes started the suite.
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    root = subprocess.Popen(sleeper)
    other = subprocess.Popen(sleeper)
    try:
        lineage = procs.Lineage(root.pid)
        stranger = procs.read_proc(other.pid)
        assert stranger is not None and stranger.ppid == os.getpid()
        reads: list[int] = []
        real_stat = procs._stat

        def counted(pid: int) -> Any:
            reads.append(pid)
            return real_stat(pid)

        monkeypatch.setattr(procs, "_stat", counted)
        assert lineage.descends(stranger) is False
        assert reads == [os.getpid()]
    finally:
        for proc in (root, other):
            proc.kill()
            proc.wait()


def test_leftover_child_is_reported_with_its_gpu_memory(fake_nvml: FakePynvml, child: Any) -> None:
    checker = Checker()
    window = checker.begin()
    proc = child()
    fake_nvml.devices[0].compute.append(FakeProcess(proc.pid, 512 * MIB))
    (finding,) = _judge(checker, window)
    assert (finding.rule, finding.role, finding.pid) == ("survivor", "descendant", proc.pid)
    assert finding.gpu_bytes == 512 * MIB
    assert finding.message.startswith("descendant python -c ")
    assert f"(PID {proc.pid}) started in {LABEL}, alive" in finding.message
    assert "holds GPU0 512 MiB" in finding.message
    assert finding_lines([finding])[0] == f"LEAK survivor  {finding.message}"


def test_session_helper_is_a_baseline_unless_it_holds_gpu_memory(
    fake_nvml: FakePynvml, child: Any
) -> None:
    checker = Checker()
    window = checker.begin()
    child(helper=True)
    assert _judge(checker, window) == []

    window = checker.begin()
    proc = child(helper=True)
    fake_nvml.devices[0].compute.append(FakeProcess(proc.pid, 300 * MIB))
    (finding,) = _judge(checker, window)
    assert (finding.rule, finding.pid) == ("survivor", proc.pid)
    assert "multiprocessing.resource_tracker" in (finding.cmdline or "")


def test_findings_survive_the_trip_to_the_xdist_controller() -> None:
    finding = Finding(
        rule="orphan",
        severity="leak",
        message="m",
        remedy="r",
        pid=12,
        start_ticks=150,
        create_time=1_700_000_001.5,
        role="orphan",
        cmdline="sleep 1",
        gpu_bytes=12,
        device_index=3,
        nvidia_fds=31,
        scope="module-scoped fixture 'x'",
        shm_name=None,
        size_bytes=None,
    )
    data = json.loads(json.dumps(to_jsonable(finding)))
    assert record_from_dict(Finding, data) == finding
    assert headline([finding]) == "1 process (0.0 MiB GPU)"
    shm = Finding(rule="shm", severity="info", message="m", remedy="r", shm_name="x", size_bytes=9)
    assert record_from_dict(Finding, json.loads(json.dumps(to_jsonable(shm)))) == shm
    assert headline([finding, shm, shm]) == "1 process (0.0 MiB GPU), 2 /dev/shm files"


def test_tracker_fixture_findings_are_judged_with_the_test(
    inner: pytest.Pytester, leftovers: Path
) -> None:
    sleep = _sleep_arg()
    inner.makepyfile(
        test_tracked=f"""
        import os, subprocess
        KEEP = []

        def test_epoch_leaves_a_process(gpu_leak_tracker):
            with gpu_leak_tracker.epoch("one"):
                proc = subprocess.Popen(["sleep", "{sleep}"])
                KEEP.append(proc)
                with open(os.path.join({str(leftovers)!r}, "{sleep}"), "w") as handle:
                    handle.write(str(proc.pid))
        """
    )
    # Flag on: the tracker's findings join the test's own.
    on = inner.runpytest_subprocess("--gpu-leak-check", "--gpu-leak-grace=0.3", *NO_CACHE)
    on.assert_outcomes(failed=1)
    out = on.stdout.str()
    assert out.count("LEAK survivor  ") == 1  # its section only (NOTE [said once])
    # The tracker saw the same process: one finding, not two.
    assert "LEAKED test_tracked.py::test_epoch_leaves_a_process: 1 process" in out
    # Flag off: the fixture's own teardown fails on the leak.
    off = inner.runpytest_subprocess("--gpu-leak-grace=0.3", *NO_CACHE)
    off.assert_outcomes(passed=1, errors=1)
    assert "LeakError" in off.stdout.str()


def test_a_tracked_loader_whose_forked_workers_copy_its_dataset_fails_its_test(
    inner: pytest.Pytester,
) -> None:
    inner.makepyfile(
        test_loader="""
        import pytest, torch
        from torch.utils.data import DataLoader
        import leakcheck

        ROWS = [{"id": i, "weight": float(i)} for i in range(200_000)]

        def read(index):
            return torch.tensor([ROWS[index]["id"], ROWS[index]["weight"]])

        def run(tracker):
            loader = DataLoader(
                range(len(ROWS)), batch_size=1024, shuffle=True, num_workers=2,
                collate_fn=lambda indices: torch.stack([read(i) for i in indices]),
                multiprocessing_context="fork", worker_init_fn=leakcheck.worker_init_fn(),
            )
            with tracker.epoch("one"):
                for _batch in loader:
                    pass

        def test_copies(gpu_leak_tracker):
            run(gpu_leak_tracker)

        @pytest.mark.gpu_leak_check(copy_tolerance="1GiB")
        def test_copies_within_its_tolerance(gpu_leak_tracker):
            assert gpu_leak_tracker.config.copy_tolerance_bytes == 1 << 30
            run(gpu_leak_tracker)
        """
    )
    result = inner.runpytest_subprocess(
        "--gpu-leak-check", "--gpu-leak-copy-tolerance=8MiB", "--gpu-leak-grace=0.5", *NO_CACHE
    )
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    assert "LEAK copy-on-read  2 forked workers of PID " in out
    assert "LEAKED test_loader.py::test_copies: 1 copy-on-read finding" in out


STRANGER = """
import os, sys, time
fd = os.open("/dev/shm/" + sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 4096)
open(sys.argv[2], "w").write(str(os.getpid()))
time.sleep(60)
"""


def test_segment_held_by_a_stranger_is_not_blamed(tmp_path: Path, shm_names: list[str]) -> None:
    name = f"lc_test_{uuid.uuid4().hex[:12]}"
    shm_names.append(name)
    pid_file = tmp_path / "stranger.pid"
    checker = Checker()
    window = checker.begin()
    # Detached, untagged and exec'd: by every rule a process of someone else.
    env = {k: v for k, v in os.environ.items() if k != "LEAKCHECK_SESSION"}
    subprocess.run(
        ["setsid", "sh", "-c", f"\"{sys.executable}\" -c '{STRANGER}' {name} {pid_file} &"],
        env=env,
        check=True,
    )
    try:
        deadline = time.monotonic() + 20
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert Path(f"/dev/shm/{name}").exists()
        assert _judge(checker, window) == []
    finally:
        _kill_matching({pid_file.name})


def test_a_segment_nothing_ties_to_the_test_is_only_information(shm_names: list[str]) -> None:
    """Held by none of the test's processes, named after none, not made by the test process:
    another job's or a gone child's, which cannot be told apart; said, not blamed."""
    name = f"lc_test_{uuid.uuid4().hex[:12]}"
    checker = Checker()
    window = checker.begin()
    _made_elsewhere(shm_names, name)
    (finding,) = _judge(checker, window)
    assert (finding.rule, finding.severity, finding.shm_name) == ("shm", "info", name)
    assert "nothing ties it to the work and other jobs ran" in finding.message


def test_unheld_named_semaphore_is_never_blamed(shm_names: list[str]) -> None:
    # Any process using multiprocessing makes these; while they exist nobody of ours holds
    # them by that name, so the absence of a holder says nothing about who made one.
    name = f"sem.lc_test_{uuid.uuid4().hex[:12]}"
    shm_names.append(name)
    checker = Checker()
    window = checker.begin()
    Path(f"/dev/shm/{name}").write_bytes(b"x" * 32)
    assert _judge(checker, window) == []
    os.unlink(f"/dev/shm/{name}")
    # The same file under another name, made by the test process, is blamed.
    plain = name.removeprefix("sem.")
    shm_names.append(plain)
    checker = Checker()
    window = checker.begin()
    Path(f"/dev/shm/{plain}").write_bytes(b"x" * 32)
    (finding,) = _judge(checker, window)
    assert (finding.rule, finding.severity, finding.shm_name) == ("shm", "leak", plain)


# --- one core: the plugin and the tracker give the same words -----------------------------


def _normalised(lines: list[str], cmdline: str | None) -> list[str]:
    """Finding lines with the culprit's name as CMD and every number as N."""
    if cmdline is not None:
        lines = [line.replace(f"{process_name(cmdline)} (PID", "CMD (PID") for line in lines]
    return [re.sub(r"[0-9]+(?:\.[0-9]+)?", "N", line) for line in lines]


def _section_findings(out: str, rule: str) -> list[str]:
    """The first finding of ``rule`` in a gpu-leak-check section: its line and its fix."""
    lines = out.splitlines()
    for index, line in enumerate(lines[:-1]):
        if line.startswith(f"LEAK {rule}  ") and lines[index + 1].startswith("  fix: "):
            return lines[index : index + 2]
    raise AssertionError(f"no {rule} finding in:\n{out}")


def _orphan_maker(pid_file: str, code: str, leave: Any) -> None:
    """A worker that starts a grandchild, waits to be told, and exits without waiting."""
    proc = subprocess.Popen([sys.executable, "-c", code])
    with open(pid_file, "w") as handle:
        handle.write(f"{proc.pid} {code.rsplit('# ', 1)[1]}")
    leave.wait(10)


ORPHAN_TEST = """
import multiprocessing, os, subprocess, sys

def worker(pid_file, code):
    proc = subprocess.Popen([sys.executable, "-c", code])
    with open(pid_file, "w") as handle:
        handle.write(f"{{proc.pid}} {{code.rsplit('# ', 1)[1]}}")

def test_worker_leaves_grandchild():
    ctx = multiprocessing.get_context("fork")
    proc = ctx.Process(target=worker, args=({pid_file!r}, {code!r}))
    proc.start()
    proc.join()
"""


def test_plugin_and_tracker_word_an_orphaned_grandchild_identically(
    inner: pytest.Pytester, leftovers: Path
) -> None:
    label = TEST_LABEL  # the words of the test's own epoch
    code = f"import time; time.sleep(60)  # lc-orphan-{uuid.uuid4().int % 10**9}"
    inner.makepyfile(test_same=ORPHAN_TEST.format(pid_file=str(leftovers / "plugin"), code=code))
    result = inner.runpytest_subprocess("--gpu-leak-check", *FAST)
    result.assert_outcomes(failed=1)
    from_plugin = _section_findings(result.stdout.str(), "orphan")
    assert from_plugin[0].startswith('LEAK orphan  python -c "import time; time.sleep(60)')

    # The same process through the tracker: the test's epoch is the tracker's. The tracker
    # takes one sample while the grandchild's parent lives, as its sampler would have: the
    # plugin saw it start within the test's window too.
    pid_file = leftovers / "tracker"
    other = f"import time; time.sleep(60)  # lc-orphan-{uuid.uuid4().int % 10**9}"
    ctx = multiprocessing.get_context("fork")
    leave = ctx.Event()
    with Tracker(grace=0.2, interval=0.02) as tracker, tracker.epoch(label):
        worker = ctx.Process(target=_orphan_maker, args=(str(pid_file), other, leave))
        worker.start()
        assert wait_for(lambda: pid_file.exists() and pid_file.read_text().endswith(other[-8:]))
        tracker.sample()
        leave.set()
        worker.join()
    (finding,) = [f for f in tracker.report().findings if f.rule == "orphan"]
    assert (finding.role, finding.pid) == ("orphan", _leaked_pid(leftovers, "tracker"))
    # Command lines are compared apart: a sample that catches a child in the middle of its
    # exec reads an empty one, and the tracker keeps the process name it read then.
    plugin_cmdline = f"{sys.executable} -c {code}"
    assert _normalised(from_plugin, plugin_cmdline) == _normalised(
        finding_lines([finding]), finding.cmdline
    )


LAUNCHER = """# torch._inductor.compile_worker
import os, sys, time
for line in sys.stdin:
    pid = os.fork()
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    print(pid, flush=True)
"""


@pytest.fixture
def helper_launcher() -> Iterator[Any]:
    """Start launchers of runtime helpers whose command line is a helper's from birth.

    ``helper_launcher()`` starts a launcher whose command line names
    ``torch._inductor.compile_worker`` (early: the tracker keeps the first 160 characters)
    and returns ``spawn``: each call forks a sleeping child of it and returns its PID. A
    fork that never execs shows its parent's command line from its first instant, where a
    child that execs shows an empty one for a moment, which is all a sample may see. A
    tracker owns for good the processes it placed first, and their children born before it
    closed (NOTE [claims] in track/claims.py), so each tracker gets a launcher of its own.
    """
    launchers: list[subprocess.Popen[str]] = []
    started: list[int] = []

    def new_launcher() -> Callable[[], int]:
        launcher = subprocess.Popen(
            [sys.executable, "-c", LAUNCHER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        launchers.append(launcher)

        def spawn() -> int:
            assert launcher.stdin is not None and launcher.stdout is not None
            launcher.stdin.write("\n")
            launcher.stdin.flush()
            started.append(int(launcher.stdout.readline()))
            return started[-1]

        return spawn

    yield new_launcher
    for pid in started:
        with contextlib.suppress(OSError):
            if "compile_worker" in Path(f"/proc/{pid}/cmdline").read_text():
                os.kill(pid, signal.SIGKILL)
    for launcher in launchers:
        launcher.kill()
        launcher.wait()
        for stream in (launcher.stdin, launcher.stdout):
            if stream is not None:
                stream.close()


def test_runtime_helper_is_a_baseline_in_the_plugin_as_in_the_tracker(
    fake_nvml: FakePynvml, helper_launcher: Any
) -> None:
    assert is_runtime_helper(f"python -c {LAUNCHER}")
    # Holding nothing on the GPU, it is a baseline for both.
    spawn = helper_launcher()
    checker = Checker()
    window = checker.begin()
    spawn()
    assert _judge(checker, window) == []
    spawn_for_tracker = helper_launcher()
    with Tracker(grace=0.05, interval=0.02) as tracker, tracker.epoch(LABEL):
        pid = spawn_for_tracker()
    record = tracker.report().epochs[0]
    assert [p.persistent for p in record.processes if p.key.pid == pid] == [True]
    assert [f for f in tracker.report().findings if f.pid == pid] == []

    # Holding GPU memory, it is a survivor for both, in the same words.
    window = checker.begin()
    pid = spawn()
    fake_nvml.devices[0].compute.append(FakeProcess(pid, 300 * MIB))
    (from_plugin,) = _judge(checker, window)
    spawn_for_tracker = helper_launcher()
    with Tracker(grace=0.05, interval=0.02) as tracker, tracker.epoch(LABEL):
        other = spawn_for_tracker()
        fake_nvml.devices[0].compute.append(FakeProcess(other, 300 * MIB))
    (from_tracker,) = [f for f in tracker.report().leaks if f.pid == other]
    assert (from_plugin.rule, from_plugin.role) == ("survivor", "descendant")
    assert (from_tracker.rule, from_tracker.role) == ("survivor", "descendant")
    assert process_name(from_plugin.cmdline) == process_name(from_tracker.cmdline)
    assert _normalised(finding_lines([from_plugin]), None) == _normalised(
        finding_lines([from_tracker]), None
    )


def test_a_clean_loader_under_the_file_system_strategy_passes(inner: pytest.Pytester) -> None:
    """Under the file_system sharing strategy each worker starts torch's shared-memory
    manager, which daemonizes to PID 1 and holds nothing on the GPU: a runtime helper, not
    the test's orphan."""
    inner.makepyfile(
        test_file_system="""
        import torch
        import torch.multiprocessing
        from torch.utils.data import DataLoader, Dataset

        torch.multiprocessing.set_sharing_strategy("file_system")

        class Rows(Dataset):
            def __len__(self):
                return 16

            def __getitem__(self, index):
                return torch.full((1024,), float(index))

        def test_clean_loader():
            total = 0.0
            for batch in DataLoader(Rows(), batch_size=4, num_workers=2):
                total += float(batch.sum())
            assert total > 0
        """
    )
    result = inner.runpytest_subprocess("--gpu-leak-check", *FAST)
    result.assert_outcomes(passed=1)
    assert "orphan" not in result.stdout.str()


def test_a_loader_that_only_a_function_fixture_keeps_is_no_leak(inner: pytest.Pytester) -> None:
    """pytest lets go of a test's fixture values only after its teardown report: a loader
    with persistent workers (or an iterator) that a function-scoped fixture returns stops
    its workers then, before the next test. One the test keeps elsewhere is still a leak."""
    inner.makepyfile(
        test_fixture_loader="""
        import pytest
        from torch.utils.data import DataLoader

        KEPT = []

        @pytest.fixture
        def loader():
            return DataLoader(list(range(32)), batch_size=4, num_workers=2, persistent_workers=True)

        @pytest.fixture
        def batches():
            return iter(DataLoader(list(range(32)), batch_size=4, num_workers=2))

        def test_two_epochs(loader):
            for _ in range(2):
                assert len(list(loader)) == 8

        def test_first_batch(batches):
            assert next(batches).tolist() == [0, 1, 2, 3]

        def test_kept(loader):
            assert len(list(loader)) == 8
            KEPT.append(loader)
        """
    )
    result = inner.runpytest_subprocess("--gpu-leak-check", "-v", *FAST)
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(
        [
            "test_fixture_loader.py::test_two_epochs PASSED*",
            "test_fixture_loader.py::test_first_batch PASSED*",
            "test_fixture_loader.py::test_kept LEAKED*",
        ]
    )


def test_a_failing_tests_loader_that_only_its_traceback_keeps_is_no_leak(
    inner: pytest.Pytester,
) -> None:
    """pytest keeps a failure's traceback (``sys.last_traceback``) until the next test's call:
    an iterator local to a failing or xfailing test keeps its workers alive through the
    teardown. The failure is the test's only finding; a loader kept elsewhere still leaks."""
    inner.makepyfile(
        test_failing_loader="""
        import pytest
        from torch.utils.data import DataLoader

        KEPT = []

        def test_fails():
            batches = iter(DataLoader(list(range(32)), batch_size=4, num_workers=2))
            assert next(batches).tolist() == [9]

        @pytest.mark.xfail(reason="known")
        def test_xfails():
            batches = iter(DataLoader(list(range(32)), batch_size=4, num_workers=2))
            assert next(batches).tolist() == [9]

        def test_fails_and_keeps():
            batches = iter(DataLoader(list(range(32)), batch_size=4, num_workers=2))
            KEPT.append(batches)
            assert next(batches).tolist() == [9]
        """
    )
    result = inner.runpytest_subprocess("--gpu-leak-check", *FAST)
    result.assert_outcomes(failed=2, xfailed=1)
    out = result.stdout.str()
    assert "1 of 3 checked tests left something behind" in out
    assert "LEAKED test_failing_loader.py::test_fails_and_keeps: 2 processes" in out
    # Torch's name for a loader worker tells it from other children: the iterator's fix.
    assert "LEAK survivor  2 \u00d7 worker of " in out, out
    assert "fix: end each epoch's iterator (exhaust or `del` it)" in out
    assert "LEAKED test_failing_loader.py::test_fails:" not in out
    assert "LEAKED test_failing_loader.py::test_xfails:" not in out


def test_persistent_workers_of_a_wide_scope_fixtures_loader_are_the_fixtures(
    inner: pytest.Pytester,
) -> None:
    """A class- or module-scoped fixture's loader with persistent workers starts them in the
    first test that iterates it and keeps them for the next: the fixture's, judged when it
    ends (clean where its loader went with it, a leak of the fixture where it did not)."""
    inner.makepyfile(
        test_shared_loader="""
        import pytest
        from torch.utils.data import DataLoader

        KEPT = []

        def loader():
            return DataLoader(list(range(32)), batch_size=4, num_workers=2, persistent_workers=True)

        @pytest.fixture(scope="class")
        def class_loader():
            return loader()

        @pytest.fixture(scope="module")
        def module_loader():
            yield loader()

        @pytest.fixture(scope="module")
        def kept_loader():
            KEPT.append(loader())
            return KEPT[-1]

        class TestShared:
            def test_a(self, class_loader):
                assert len(list(class_loader)) == 8

            def test_b(self, class_loader):
                assert len(list(class_loader)) == 8

        @pytest.mark.parametrize("epoch", range(2))
        def test_module(module_loader, kept_loader, epoch):
            assert len(list(module_loader)) == len(list(kept_loader)) == 8

        def test_last():
            pass
        """
    )
    result = inner.runpytest_subprocess("--gpu-leak-check", "-v", *FAST)
    result.assert_outcomes(passed=4, failed=1)
    result.stdout.fnmatch_lines(["test_shared_loader.py::test_last LEAKED*"])
    out = result.stdout.str()
    assert "leakcheck: module-scoped fixture 'kept_loader' left 2 processes" in out, out


def test_a_session_fixtures_executor_whose_workers_start_in_a_test_is_no_leak(
    inner: pytest.Pytester,
) -> None:
    """A ProcessPoolExecutor starts its workers at the first submit, in the first test that
    uses it: they are its fixture's, which shuts them down at the session's end."""
    inner.makepyfile(
        test_executor="""
        import concurrent.futures
        import pytest

        def square(x):
            return x * x

        @pytest.fixture(scope="session")
        def executor():
            with concurrent.futures.ProcessPoolExecutor(2) as pool:
                yield pool

        @pytest.mark.parametrize("x", [2, 3])
        def test_square(executor, x):
            assert executor.submit(square, x).result() == x * x
        """
    )
    result = inner.runpytest_subprocess("--gpu-leak-check", *FAST)
    result.assert_outcomes(passed=2)
    assert "no leaks in 2 checked tests" in result.stdout.str()


# With a grace of 0.2 s and a settling time of 2 s, a child of the test's that sleeps 1.2 s
# exits in the wait before the collection, and one that sleeps 3.2 s in the wait after it,
# each with a second of slack either side for a loaded host (the default 0.25 s settling
# left 0.1 s: the test's own teardown outlasted it once in a while).
@pytest.mark.parametrize("sleep_s", ["1.2", "3.2"])
def test_a_child_that_exits_just_after_the_grace_is_late_not_kept_by_a_cycle(
    inner: pytest.Pytester, sleep_s: str
) -> None:
    """It outlived the grace (a survivor), but no garbage collection let it go: its finding
    must not blame a reference cycle."""
    inner.makeconftest(
        """
        import leakcheck.adapters.plugin_observe as observe

        observe._SHUTDOWN_SETTLE_S = 2.0
        """
    )
    inner.makepyfile(
        test_late=f"""
        import subprocess

        def test_late_child():
            subprocess.Popen(["sleep", "{sleep_s}"])
        """
    )
    result = inner.runpytest_subprocess("--gpu-leak-check", *FAST)
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "LEAK survivor  descendant sleep " in out
    assert "reference cycle" not in out


OUTCOME_SUITE = """
import os, subprocess
import pytest

def _leak(name):
    proc = subprocess.Popen(["sleep", "{sleep}"])
    with open(os.path.join({pids!r}, "{sleep}-" + name), "w") as handle:
        handle.write(str(proc.pid) + " {sleep}")

def test_skipped_after_leaking():
    _leak("skip")
    pytest.skip("skipped after leaking")

@pytest.mark.xfail(reason="expected")
def test_xfail_leaking():
    _leak("xfail")
    assert False

@pytest.mark.xfail(reason="expected")
def test_xpass_leaking():
    _leak("xpass")
"""


def test_a_skipped_xfailed_or_xpassed_test_that_leaks_is_counted_once(
    inner: pytest.Pytester, leftovers: Path
) -> None:
    """Each keeps its outcome and is counted once; its leak is still named."""
    inner.makepyfile(test_outcomes=OUTCOME_SUITE.format(sleep=_sleep_arg(), pids=str(leftovers)))
    junit = inner.path / "junit.xml"
    result = inner.runpytest_subprocess("--gpu-leak-check", f"--junitxml={junit}", *FAST)
    result.assert_outcomes(skipped=1, xfailed=1, xpassed=1)
    out = result.stdout.str()
    # No failure shows their sections: the summary names each leak, once.
    assert out.count("    LEAK survivor  descendant sleep ") == 3, out
    suite = junit.read_text()
    assert 'tests="3"' in suite and 'errors="0"' in suite and 'failures="0"' in suite, suite


SKIPPED_SUITE = """
import os, subprocess
import pytest

@pytest.fixture
def leaks_then_skips():
    proc = subprocess.Popen(["sleep", "{sleep}"])
    with open(os.path.join({pids!r}, "{sleep}"), "w") as handle:
        handle.write(str(proc.pid))
    pytest.skip("skipped in its fixture, after it started a process")

def test_runs():
    pass

@pytest.mark.skip(reason="not today")
def test_marked_skip():
    pass

@pytest.mark.skipif(True, reason="never")
def test_marked_skipif():
    pass

def test_{name}({fixture}):
    pass
"""


@pytest.mark.parametrize("leaky", [False, True])
def test_tests_skipped_before_their_call_count_only_when_they_leave_something(
    inner: pytest.Pytester, leftovers: Path, leaky: bool
) -> None:
    """Nothing of a test skipped by its marker ran: it is not one of the checked tests; one
    whose fixture started a process before it skipped is, with its finding."""
    inner.makepyfile(
        test_skips=SKIPPED_SUITE.format(
            sleep=_sleep_arg(),
            pids=str(leftovers),
            name="fixture_skip" if leaky else "plain",
            fixture="leaks_then_skips" if leaky else "",
        )
    )
    result = inner.runpytest_subprocess("--gpu-leak-check", *FAST)
    out = result.stdout.str()
    if leaky:
        result.assert_outcomes(passed=1, skipped=3)
        assert "1 of 2 checked tests left something behind" in out, out
    else:
        result.assert_outcomes(passed=2, skipped=2)
        assert "no leaks in 2 checked tests" in out, out


def test_a_marker_with_only_a_tolerance_checks_its_test(
    inner: pytest.Pytester, leftovers: Path
) -> None:
    sleep = _sleep_arg()
    inner.makepyfile(
        test_marked=f"""
        import os, subprocess
        import pytest

        @pytest.mark.gpu_leak_check(tolerance="64MiB", grace=0.2)
        def test_leaves_child():
            proc = subprocess.Popen(["sleep", "{sleep}"])
            with open(os.path.join({str(leftovers)!r}, "{sleep}"), "w") as handle:
                handle.write(str(proc.pid))
        """
    )
    result = inner.runpytest_subprocess(*NO_CACHE)  # no --gpu-leak-check: the marker asks
    result.assert_outcomes(failed=1)
    assert "LEAK survivor  descendant sleep " in result.stdout.str()


def test_a_file_left_inside_the_fixtures_epoch_gets_one_verdict(
    inner: pytest.Pytester, shm_names: list[str]
) -> None:
    name = f"lc_test_{uuid.uuid4().hex[:12]}"
    shm_names.append(name)
    inner.makepyfile(
        test_fixture_shm=f"""
        def test_leaves_a_file(gpu_leak_tracker):
            with gpu_leak_tracker.epoch("work"):
                with open("/dev/shm/{name}", "wb") as handle:
                    handle.write(b"x" * 8192)
        """
    )
    result = inner.runpytest_subprocess("--gpu-leak-check", *FAST)
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert f"LEAK shm  /dev/shm/{name} (8 KiB) left behind" in out
    assert f"info shm  /dev/shm/{name}" not in out
    assert "appeared while tests ran" not in out


def test_an_orphan_of_a_tracker_the_test_runs_fails_the_test(
    inner: pytest.Pytester, leftovers: Path
) -> None:
    """The tracker tags its children with its own session: the test still owns them."""
    sleep = _sleep_arg()
    inner.makepyfile(
        test_tracked=f"""
        import os, subprocess, sys
        import leakcheck

        CODE = (
            "import subprocess, time; subprocess.Popen(['sleep', '{sleep}']); time.sleep(0.3)"
        )

        def test_orphan_inside_a_tracker():
            with open(os.path.join({str(leftovers)!r}, "{sleep}"), "w") as handle:
                handle.write("0 {sleep}")
            with leakcheck.Tracker(grace=0.2) as tracker:
                with tracker.epoch("work"):
                    subprocess.run([sys.executable, "-c", CODE], check=True)
        """
    )
    result = inner.runpytest_subprocess("--gpu-leak-check", *FAST)
    result.assert_outcomes(failed=1)
    assert "LEAK orphan  sleep " in result.stdout.str()


# Two xdist workers' test programs wait for each other's marker files, however late the other
# worker starts: put before a program (makepyfile dedents the whole text).
WAIT_FOR = """
        import os, time

        def wait_for(path):
            deadline = time.monotonic() + 60
            while not os.path.exists(path) and time.monotonic() < deadline:
                time.sleep(0.01)
        """


def test_files_nobody_can_be_tied_to_under_xdist_are_counted_once_each(
    inner: pytest.Pytester, shm_names: list[str]
) -> None:
    """A file another worker's test made shows in every test that ran beside it: the
    summary counts files, not the tests that saw them."""
    name = f"lc_test_{uuid.uuid4().hex[:12]}"
    shm_names.append(name)
    inner.makepyfile(
        test_side_by_side=WAIT_FOR
        + f"""
        import os, subprocess, sys, time

        def test_makes_a_file():  # through a child that is gone: no evidence left
            wait_for("beside-started")
            code = "open('/dev/shm/{name}', 'wb').write(bytes(4096))"
            subprocess.run([sys.executable, "-c", code], check=True)
            open("made", "w").close()

        def test_waits_beside_it():
            open("beside-started", "w").close()
            wait_for("made")
        """
    )
    result = inner.runpytest_subprocess("--gpu-leak-check", "-n", "2", *FAST)
    result.assert_outcomes(passed=2)
    out = result.stdout.str()
    assert "1 /dev/shm file appeared while tests ran, and nothing tied them" in out, out


def test_under_xdist_a_file_one_test_is_blamed_for_is_not_also_said_to_be_nobodys(
    inner: pytest.Pytester, shm_names: list[str]
) -> None:
    """The file a test leaves (named after a child it forked, gone by its end) appears in
    the window of the test beside it too, where nothing ties it: the summary does not count
    it among the files of no test."""
    token = uuid.uuid4().int % 10**9
    inner.makepyfile(
        test_side_by_side=WAIT_FOR
        + f"""
        import multiprocessing, os, time

        def write():  # as a DataLoader worker's file_system segment is named
            open(f"/dev/shm/torch_{{os.getpid()}}_{token}_0", "wb").write(b"x" * 4096)
            open("child-pid", "w").write(str(os.getpid()))

        def test_makes_a_file():
            wait_for("beside-started")
            child = multiprocessing.get_context("fork").Process(target=write)
            child.start()
            child.join()
            open("made", "w").close()

        def test_waits_beside_it():
            open("beside-started", "w").close()
            wait_for("made")
        """
    )
    try:
        result = inner.runpytest_subprocess("--gpu-leak-check", "-n", "2", *FAST)
    finally:
        with contextlib.suppress(OSError):
            shm_names.append(f"torch_{(inner.path / 'child-pid').read_text()}_{token}_0")
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    assert "LEAKED test_side_by_side.py::test_makes_a_file: 1 /dev/shm file" in out, out
    assert "appeared while tests ran" not in out, out


def test_under_xdist_a_file_of_another_workers_test_is_not_in_a_failing_tests_section(
    inner: pytest.Pytester, leftovers: Path, shm_names: list[str]
) -> None:
    """A test that leaked a process fails with its own leak alone: a file nobody can tie to
    a test, made meanwhile on the other worker, is said once, in the summary."""
    name, arg = f"lc_test_{uuid.uuid4().hex[:12]}", _sleep_arg()
    shm_names.append(name)
    inner.makepyfile(
        test_side_by_side=WAIT_FOR
        + f"""
        import os, subprocess, sys, time

        def test_makes_a_file():  # through a child that is gone: no evidence left
            wait_for("beside-started")
            code = "open('/dev/shm/{name}', 'wb').write(bytes(4096))"
            subprocess.run([sys.executable, "-c", code], check=True)
            open("made", "w").close()

        def test_leaves_a_process():
            open("beside-started", "w").close()
            proc = subprocess.Popen(["sleep", "{arg}"])
            with open(os.path.join({str(leftovers)!r}, "{arg}"), "w") as handle:
                handle.write(str(proc.pid))
            wait_for("made")
        """
    )
    result = inner.runpytest_subprocess("--gpu-leak-check", "-n", "2", *FAST)
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    assert f"LEAK survivor  descendant sleep {arg}" in out, out
    assert name not in out, out
    assert "1 /dev/shm file appeared while tests ran, and nothing tied them" in out, out


def test_under_xdist_a_fixture_is_not_blamed_for_a_file_another_workers_fixture_made(
    inner: pytest.Pytester, shm_names: list[str]
) -> None:
    """Two module fixtures set up at once on two workers: the segment one leaves is its own
    leak, not the other's, whose setup saw the file appear."""
    name = f"lc_test_{uuid.uuid4().hex[:12]}"
    shm_names.append(name)
    header = (
        WAIT_FOR
        + """
        from multiprocessing import shared_memory
        import pytest
        """
    )
    inner.makepyfile(
        test_clean=header
        + """
        @pytest.fixture(scope="module")
        def clean_segment():
            segment = shared_memory.SharedMemory(create=True, size=4096)
            open("clean-started", "w").close()
            wait_for("made")
            yield segment
            segment.close()
            segment.unlink()

        def test_clean(clean_segment):
            pass
        """,
        test_leaves=header
        + f"""
        @pytest.fixture(scope="module")
        def left_segment():
            wait_for("clean-started")
            segment = shared_memory.SharedMemory(create=True, size=4096, name="{name}")
            open("made", "w").close()
            yield segment
            segment.close()  # never unlinked

        def test_leaves(left_segment):
            pass
        """,
    )
    result = inner.runpytest_subprocess("--gpu-leak-check", "-n", "2", "-v", *FAST)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*PASSED*test_clean.py::test_clean*"])
    out = result.stdout.str()
    assert "leakcheck: module-scoped fixture 'left_segment' left 1 /dev/shm file" in out, out
    assert "clean_segment' left" not in out, out


def test_a_fixture_whose_first_read_failed_raises_its_own_error_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A wide-scope fixture whose allocator read failed is left unowned, and its own setup
    error carries no leakcheck error as its context (pytest would print both)."""
    from leakcheck.adapters import plugin_observe

    def broken(*, collect: bool = False) -> None:
        raise OSError("allocator unreadable")

    checker = Checker()
    window = checker.begin()
    monkeypatch.setattr(plugin_observe, "allocator_bytes", broken)
    scope = checker.fixture_scope("key", "fixture 'data'", window)
    with pytest.raises(ValueError, match="setup failed") as raised, scope:
        raise ValueError("setup failed")
    assert raised.value.__context__ is None
    checker.fixture_finished("key")
    checker.end_environment(window)
