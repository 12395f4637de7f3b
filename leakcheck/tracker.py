"""Tracker: samples the job's processes and devices in the background, per epoch.

(skeleton: the public surface is final, the body is being written)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import TYPE_CHECKING

from leakcheck.model import EndReason, EpochRecord, ProcessKey, RuleConfig, Timeline

if TYPE_CHECKING:
    from leakcheck.report import Report
    from leakcheck.snapshot import Snapshot


class Tracker:
    """Attribute GPU memory to every process of a job, per epoch.

    Use as a context manager::

        with leakcheck.Tracker() as tracker:
            for epoch in range(5):
                with tracker.epoch(f"epoch {epoch}"):
                    train_one_epoch()
        print(tracker.report().format())

    Args:
        root_pid: The job's root process (default: this process).
        interval: Seconds between background samples (default 0.05).
        devices: Device indices to watch (default: all).
        tolerance: Growth/residual below this is noise (``"16MiB"``, bytes).
        warmup_epochs: Epochs the growth rule ignores.
        grace: Seconds a process born in an epoch may outlive it.
        persistent_workers: Workers are expected to live across epochs.
        strict: Raise leakcheck's own failures instead of recording them.
        use_nvml: Read NVML (False: host-side checks only).
    """

    def __init__(
        self,
        *,
        root_pid: int | None = None,
        interval: float = 0.05,
        devices: list[int] | None = None,
        tolerance: str | int = "16MiB",
        warmup_epochs: int = 1,
        grace: float = 2.0,
        persistent_workers: bool = False,
        strict: bool = False,
        use_nvml: bool = True,
    ) -> None:
        raise NotImplementedError

    @property
    def session_id(self) -> str:
        """The tag every child inherits as ``LEAKCHECK_SESSION``."""
        raise NotImplementedError

    @property
    def config(self) -> RuleConfig:
        """Rule thresholds resolved from the constructor's options."""
        raise NotImplementedError

    def start(self) -> Tracker:
        """Take the baseline and start the sampler thread. Idempotent."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop sampling: wait out the grace period of processes born in the last epoch
        (at most ``grace`` seconds), take the final state. Idempotent."""
        raise NotImplementedError

    def __enter__(self) -> Tracker:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def begin_epoch(self, label: str | None = None) -> int:
        """Open an epoch (closing any open one as ``closed``); returns its index."""
        raise NotImplementedError

    def end_epoch(self, reason: EndReason = "completed", error: str | None = None) -> None:
        """Close the open epoch; a no-op when none is open."""
        raise NotImplementedError

    @contextmanager
    def epoch(self, label: str | None = None) -> Iterator[int]:
        """Context manager around one epoch; the end reason follows how the block ended."""
        raise NotImplementedError
        yield 0

    def register_worker(
        self, pid: int, create_time: float | None = None, *, persistent: bool | None = None
    ) -> None:
        """Declare a process as a worker of the job (exact identities, not a guess)."""
        raise NotImplementedError

    def worker_keys(self) -> list[ProcessKey]:
        """Workers registered so far."""
        raise NotImplementedError

    def epochs(self) -> tuple[EpochRecord, ...]:
        """Closed epochs so far."""
        raise NotImplementedError

    def snapshot(self) -> Snapshot:
        """Who in the job holds what, right now."""
        raise NotImplementedError

    def timeline(self) -> Timeline:
        """All observations so far, frozen."""
        raise NotImplementedError

    def report(self) -> Report:
        """Judge the timeline (closed epochs, and the final state once closed)."""
        raise NotImplementedError
