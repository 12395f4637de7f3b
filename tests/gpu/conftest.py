"""Skip every test in tests/gpu unless NVML works and torch sees a CUDA device.

With ``LEAKCHECK_REQUIRE_GPU=1`` the run fails instead, so a GPU run cannot pass by skipping.
The check runs in a subprocess: the pytest process must not open NVML's ``/dev/nvidia*``
descriptors or call ``cuInit`` (the default ``torch.cuda.is_available()`` does), because
its forked children would inherit them and the tests inspect exactly that.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_HERE = Path(__file__).parent
_CHECK = """
import os
from leakcheck.observe import nvml
ok, reason = nvml.availability()
if ok:
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # no cuInit
    import torch
    if not torch.cuda.is_available():
        reason = "torch.cuda.is_available() is False (a CPU build of torch?)"
print(reason)
"""


def _gpu_unavailable_reason() -> str | None:
    # The child must import the same leakcheck as this process, installed or not.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run(
        [sys.executable, "-c", _CHECK], env=env, capture_output=True, text=True, timeout=300
    )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"GPU check failed: {last}"
    return done.stdout.strip() or None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # This hook sees the whole session's items: act on tests/gpu only.
    gpu_items = [item for item in items if _HERE in Path(str(item.path)).parents]
    if not gpu_items:
        return
    reason = _gpu_unavailable_reason()
    if reason is None:
        return
    if os.environ.get("LEAKCHECK_REQUIRE_GPU") == "1":
        raise pytest.UsageError(f"LEAKCHECK_REQUIRE_GPU=1 but GPU tests cannot run: {reason}")
    skip = pytest.mark.skip(reason=f"no usable GPU: {reason}")
    for item in gpu_items:
        item.add_marker(skip)
