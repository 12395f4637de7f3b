"""Progress of a sweep: a one-line bar on a terminal, a plain line per epoch elsewhere."""

from __future__ import annotations

import shutil
import sys
import time
from typing import TextIO


class Progress:
    """Reports the sweep's progress on ``stream`` (standard error by default).

    ``total_epochs`` is the bar's 100%; ``tty`` draws a bar (default: ``stream`` is a terminal:
    a carriage-return bar in a log file is noise); ``enabled`` False writes nothing.
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
        self.tty = self.stream.isatty() if tty is None else tty
        self.enabled = enabled
        self.done_epochs = 0
        self._label = ""
        self._started_s = time.monotonic()
        self._bar_drawn = False

    @property
    def wants_summary(self) -> bool:
        """Whether ``end()`` prints its summary (plain lines, not the terminal's bar)."""
        return self.enabled and not self.tty

    def note(self, message: str) -> None:
        """A line that stays (cooldown waits, cleanup), above the bar on a terminal."""
        self._show(f"leakcheck sweep: {message}\n")

    def begin(self, label: str) -> None:
        """An epoch starts; ``label`` names it (``workers=4 epoch 1 (2 of 5)``)."""
        self._label = label
        self._show()

    def batch(self, count: int, total: int | None) -> None:
        """``count`` batches of the running epoch are done (redraws the bar only)."""
        if self.tty and (count == 1 or count % 4 == 0 or count == total):
            self._show(suffix=f" batch {count}/{total}" if total else f" batch {count}")

    def end(self, summary: str) -> None:
        """The running epoch ended; ``summary`` says what it measured."""
        self.done_epochs += 1
        self._show(f"leakcheck sweep: {self._label}: {summary}\n" if self.wants_summary else "")

    def close(self) -> None:
        """Remove the bar; the terminal is left clean for the report."""
        self._show(bar=False)

    def _show(self, line: str = "", *, suffix: str = "", bar: bool = True) -> None:
        """Clear the bar, write ``line`` (one that stays), then draw the bar again."""
        if not self.enabled:
            return
        width = max(shutil.get_terminal_size((80, 20)).columns, 40) - 1
        text = line
        if self._bar_drawn and (line or not bar):
            text = "\r" + " " * width + "\r" + line
            self._bar_drawn = False
        if self.tty and bar:
            fraction = min(self.done_epochs / self.total_epochs, 1.0)
            filled = round(fraction * 24)  # a fixed width: a bar that follows its label jitters
            shown = f"[{'#' * filled}{'.' * (24 - filled)}] {fraction:4.0%} {self._label}{suffix}"
            shown += f"  {time.monotonic() - self._started_s:.0f} s"
            text += "\r" + shown[:width].ljust(width)
            self._bar_drawn = True
        if text:
            try:
                self.stream.write(text)
                self.stream.flush()
            except (OSError, ValueError):  # stderr gone or full: the sweep goes on without it
                self.enabled = False
