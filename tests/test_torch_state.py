"""leakcheck.torch_state on the CPU: it never imports torch and never initialises CUDA."""

from __future__ import annotations

import os
import subprocess
import sys


def _run(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_torch_never_imported_stays_unimported() -> None:
    out = _run(
        "import sys\n"
        "from leakcheck.torch_state import initialized_cuda\n"
        "print(initialized_cuda(), 'torch' in sys.modules)\n"
    )
    assert out == "None False"


def test_torch_imported_without_a_context_is_none_and_stays_so() -> None:
    out = _run(
        "import torch\n"
        "from leakcheck.torch_state import initialized_cuda\n"
        "print(initialized_cuda(), torch.cuda.is_initialized())\n"
    )
    assert out == "None False"
