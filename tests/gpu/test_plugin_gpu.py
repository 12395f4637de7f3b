"""The pytest plugin on a real GPU: inner pytest sessions in subprocesses (pytester).

CUDA is only ever initialised in the inner sessions and their children, never in this
process. The inner sessions load the plugin through a ``pytest11`` entry point declared by a
small ``.dist-info`` on ``PYTHONPATH`` (as an installed leakcheck would). Processes an inner
test leaves behind on purpose are killed by the outer test, after their command line was
checked.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
pytest_plugins = ["pytester"]

ARGS = ("--gpu-leak-check", "--gpu-leak-grace=1", "-p", "no:cacheprovider", "-rA")


@pytest.fixture
def leftovers(tmp_path: Path) -> Iterator[Path]:
    """Inner tests write ``PID TOKEN`` files here; each live match is killed at the end."""
    folder = tmp_path / "pids"
    folder.mkdir()
    yield folder
    for pid_file in folder.iterdir():
        pid_text, token = pid_file.read_text().split(maxsplit=1)
        try:
            cmdline = Path(f"/proc/{pid_text}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if token.strip().encode() in cmdline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_text), signal.SIGKILL)


def test_tensor_kept_in_a_module_list_fails_with_its_mib(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        test_tensors="""
        import torch

        KEEP = []
        MIB = 2**20

        def test_first_cuda_use_creates_the_context():
            torch.zeros(1, device="cuda")
            torch.cuda.synchronize()

        def test_keeps_a_tensor():
            KEEP.append(torch.empty(256 * MIB, dtype=torch.uint8, device="cuda"))

        def test_frees_its_tensor():
            x = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
            del x

        def test_matmul_loads_libraries():
            a = torch.randn(1024, 1024, device="cuda")
            (a @ a).sum().item()
        """
    )
    result = inner.runpytest_subprocess(*ARGS)
    result.assert_outcomes(passed=3, failed=1)
    out = result.stdout.str()
    result.stdout.fnmatch_lines(["LEAKED test_tensors.py::test_keeps_a_tensor*"])
    assert "LEAK residual  parent " in out
    assert "still holds GPU0 256 MiB of CUDA tensors more than at the start" in out
    # The first CUDA test of the session is not blamed for creating the context.
    assert "LEAKED test_tensors.py::test_first_cuda_use_creates_the_context" not in out
    assert "1 of 4 checked tests left something behind" in out


def test_first_cuda_test_of_a_session_is_not_flagged(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        test_context="""
        import torch

        def test_only_creates_a_context():
            x = torch.ones(1024, device="cuda")
            assert x.sum().item() == 1024
        """
    )
    result = inner.runpytest_subprocess(*ARGS)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*LEAK REPORT: no leaks in 1 checked test; GPU: checked (NVML)*"])


def test_dataloader_workers_touching_cuda_and_exiting_pass(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        test_loader="""
        import torch
        from torch.utils.data import DataLoader, Dataset

        class CudaTouching(Dataset):
            def __len__(self):
                return 8

            def __getitem__(self, index):
                x = torch.ones(1024, device="cuda")  # each worker creates a context
                return float(x.sum().item())

        def test_loader_epoch():
            loader = DataLoader(CudaTouching(), num_workers=2, multiprocessing_context="spawn")
            assert [float(b) for b in loader] == [1024.0] * 8
        """
    )
    result = inner.runpytest_subprocess(*ARGS)
    result.assert_outcomes(passed=1)
    assert "no leaks in 1 checked test" in result.stdout.str()


def test_grandchild_holding_a_context_fails_naming_the_orphan(
    inner: pytest.Pytester, leftovers: Path
) -> None:
    token = f"lc_orphan_{uuid.uuid4().hex[:10]}"
    pid_file = leftovers / token
    inner.makepyfile(
        **{
            token: f"""
            import os, sys, time
            import torch

            x = torch.ones(1, device="cuda")
            torch.cuda.synchronize()
            with open({str(pid_file)!r}, "w") as handle:
                handle.write(f"{{os.getpid()}} {token}")
            time.sleep(600)
            """,
            "test_orphan": f"""
            import os, subprocess, sys, time

            def test_shell_leaves_a_cuda_grandchild():
                script = os.path.join(os.getcwd(), "{token}.py")
                subprocess.run(
                    ["sh", "-c", f"{{sys.executable}} {{script}} >/dev/null 2>&1 &"], check=True
                )
                deadline = time.monotonic() + 120
                while not os.path.exists({str(pid_file)!r}) and time.monotonic() < deadline:
                    time.sleep(0.1)
            """,
        }
    )
    result = inner.runpytest_subprocess(*ARGS)
    pid = int(pid_file.read_text().split()[0])
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    match = re.search(rf"LEAK orphan  .*\(PID {pid}\) outlived its .*; holds GPU0 (\d+) MiB", out)
    assert match is not None, out
    assert int(match.group(1)) > 100  # a CUDA context is hundreds of MiB
    assert f"or kill {pid}" in out
