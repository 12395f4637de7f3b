"""leakcheck.observe.torch_state on the CPU: it never imports torch and never initialises CUDA."""

from __future__ import annotations

from tests.pyrun import run_python


def _run(code: str) -> str:
    done = run_python(code)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_torch_never_imported_stays_unimported() -> None:
    out = _run(
        "import sys\n"
        "from leakcheck.observe.torch_state import initialized_cuda\n"
        "print(initialized_cuda(), 'torch' in sys.modules)\n"
    )
    assert out == "None False"


def test_torch_imported_without_a_context_is_none_and_stays_so() -> None:
    out = _run(
        "import torch\n"
        "from leakcheck.observe.torch_state import initialized_cuda\n"
        "print(initialized_cuda(), torch.cuda.is_initialized())\n"
    )
    assert out == "None False"
