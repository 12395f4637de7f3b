"""The sampler's thread: when it ticks, and how an epoch end or a close wakes it at once.

A tick is due every ``interval_s``, or after as many intervals as the pacing says would be
empty (NOTE [idle ticks] in pacing.py). A wake (host reads an epoch end planned, or a stop)
is served at once and does not put the tick off: epochs shorter than the wait would
otherwise starve every tick, and with them the scans for processes reparented away. Its
CPU time goes to the cost meter. What a tick or a wake does is the sampler's.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

from leakcheck.track.cost import CostMeter

__all__ = ["Ticker"]


class Ticker:
    """One daemon thread that calls ``on_tick`` when a tick is due and ``on_wake`` when woken.

    Args:
        interval_s: Seconds between ticks.
        on_tick: Does one tick; returns how many intervals to wait for the next, or None
            to stop (the sampler closed).
        on_wake: Serves a wake (the host reads an epoch end planned).
        on_error: Told of an exception that stopped the thread (never raised).
        meter: Where the thread's CPU time is counted.

    """

    def __init__(
        self,
        interval_s: float,
        *,
        on_tick: Callable[[int], int | None],
        on_wake: Callable[[], None],
        on_error: Callable[[Exception], None],
        meter: CostMeter,
    ) -> None:
        self.interval_s = interval_s
        self._on_tick = on_tick
        self._on_wake = on_wake
        self._on_error = on_error
        self._meter = meter
        # Held but while someone wakes the thread: it waits on it between ticks, so a stop
        # (or an epoch end with host reads to make) wakes it at once; a timed acquire of a
        # plain lock is the cheapest wake measured.
        self._gate = threading.Lock()
        self._gate.acquire()
        self._thread: threading.Thread | None = None
        self.stopping = False

    def start(self) -> None:
        """Start the thread (once)."""
        self._thread = threading.Thread(target=self._run, name="leakcheck-sampler", daemon=True)
        self._meter.sampler_thread = self._thread
        self._thread.start()

    def wake(self) -> None:
        """Wake the thread now (it checks ``stopping`` first)."""
        with contextlib.suppress(RuntimeError):  # released already: a wake is pending
            self._gate.release()

    def stop(self) -> None:
        """Stop the thread and wait a while for it (not when called from it)."""
        if not self.stopping:
            self.stopping = True
            self.wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(1.0, 10 * self.interval_s))

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as error:  # the detector's own failure is reported, never lost
            self._on_error(error)

    def _loop(self) -> None:
        ticks = 1
        tick_due_s = time.monotonic() + self.interval_s
        while True:
            woken = self._gate.acquire(timeout=max(0.0, tick_due_s - time.monotonic()))
            if self.stopping:
                return
            cpu_start_s = time.thread_time()
            if woken:
                self._on_wake()  # then wait for the tick still due
                spent_s = time.thread_time() - cpu_start_s
                self._meter.sampler_ran(spent_s)
                self._meter.host_read(spent_s)
                continue
            next_ticks = self._on_tick(ticks)
            if next_ticks is None:
                return
            ticks = next_ticks
            tick_due_s = time.monotonic() + ticks * self.interval_s
            self._meter.sampler_ran(time.thread_time() - cpu_start_s)
