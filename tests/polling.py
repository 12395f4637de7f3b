"""Waiting in tests for what other processes and threads do: poll, never sleep a fixed time."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(predicate: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    """Poll ``predicate`` every 5 ms until it holds or ``timeout_s`` passed; its last value.

    The deadline is for a loaded 2-core CI machine: generous, and it costs nothing where the
    state comes (the poll returns then). Assert with it only what must come, never that
    something does not happen (that would wait out the whole deadline).
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()
