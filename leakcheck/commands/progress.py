"""Progress of a sweep: a one-line bar on a terminal, plain lines in logs and CI.

A carriage-return bar in a log file is noise (every redraw is kept), so the bar is drawn
only when the stream is a terminal; otherwise each finished epoch is one plain line.
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import TextIO


class Progress:
    """Reports the sweep's progress on ``stream`` (standard error by default).

    Args:
        total_epochs: Epochs over all configurations (the bar's 100%).
        stream: Where to write.
        tty: Draw a bar; default: whether ``stream`` is a terminal.
        enabled: False writes nothing at all.

    """

    def __init__(
        self,
        total_epochs: int,
        *,
        stream: TextIO | None = None,
        tty: bool | None = None,
        enabled: bool = True,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.total_epochs = max(total_epochs, 1)
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty()) if tty is None and callable(isatty) else bool(tty)
        self.enabled = enabled
        self.done_epochs = 0
        self._label = ""
        self._started_s = time.monotonic()
        self._bar_drawn = False

    def note(self, message: str) -> None:
        """A line that stays (cooldown waits, cleanup), above the bar on a terminal."""
        if not self.enabled:
            return
        self._clear_bar()
        self.stream.write(f"leakcheck sweep: {message}\n")
        self.stream.flush()
        self._draw()

    def begin(self, label: str) -> None:
        """An epoch starts; ``label`` names it (``workers=4 epoch 1 (2 of 5)``)."""
        self._label = label
        self._draw()

    def batch(self, count: int, total: int | None) -> None:
        """``count`` batches of the running epoch are done (redraws the bar only)."""
        if self.tty and (count == 1 or count % 4 == 0 or count == total):
            suffix = f" batch {count}/{total}" if total else f" batch {count}"
            self._draw(suffix)

    @property
    def wants_summary(self) -> bool:
        """Whether ``end()`` prints its summary (plain lines, not the terminal's bar)."""
        return self.enabled and not self.tty

    def end(self, summary: str) -> None:
        """The running epoch ended; ``summary`` says what it measured."""
        self.done_epochs += 1
        if not self.enabled:
            return
        if self.tty:
            self._draw()
        else:
            self.stream.write(f"leakcheck sweep: {self._label}: {summary}\n")
            self.stream.flush()

    def close(self) -> None:
        """Remove the bar; the terminal is left clean for the report."""
        self._clear_bar()

    def _draw(self, suffix: str = "") -> None:
        if not (self.enabled and self.tty):
            return
        width = max(shutil.get_terminal_size((80, 20)).columns, 40)
        fraction = min(self.done_epochs / self.total_epochs, 1.0)
        elapsed_s = time.monotonic() - self._started_s
        text = f" {fraction:4.0%} {self._label}{suffix}  {elapsed_s:.0f} s"
        bar_cells = 24  # fixed: a bar that changes width with its label jitters
        filled = round(fraction * bar_cells)
        line = f"[{'#' * filled}{'.' * (bar_cells - filled)}]{text}"
        self.stream.write("\r" + line[: width - 1].ljust(width - 1))
        self.stream.flush()
        self._bar_drawn = True

    def _clear_bar(self) -> None:
        if self._bar_drawn:
            width = max(shutil.get_terminal_size((80, 20)).columns, 40)
            self.stream.write("\r" + " " * (width - 1) + "\r")
            self.stream.flush()
            self._bar_drawn = False
