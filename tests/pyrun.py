"""Run a snippet of Python in a fresh interpreter with this checkout's leakcheck importable.

A fresh interpreter, so that what a test asserts about torch, CUDA or the environment is not
decided by what other tests did in the pytest process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_python(
    code: str, *, env: dict[str, str] | None = None, timeout_s: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` (dedented) with ``python -c``; ``env`` adds to the environment."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout_s,
    )
