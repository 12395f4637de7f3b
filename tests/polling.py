"""Waiting in tests for what other processes and threads do: poll, never sleep a fixed time."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(predicate: Callable[[], bool], timeout_s: float = 2.0) -> bool:
    """Poll ``predicate`` every 5 ms until it holds or ``timeout_s`` passed; its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()
