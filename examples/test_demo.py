"""Three tests for ``pytest --gpu-leak-check examples/test_demo.py``: one clean, one that
leaves a helper process running, one that leaves a /dev/shm segment (both fail)."""

from __future__ import annotations

import subprocess
import sys
from multiprocessing import shared_memory


def test_clean() -> None:
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_leaves_a_helper_running() -> None:
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])


def test_leaves_a_shared_memory_segment() -> None:
    segment = shared_memory.SharedMemory(name="demo_segment", create=True, size=2**20)
    segment.close()  # closed, never unlinked
