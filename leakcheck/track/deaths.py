"""The deaths of a tracker's job: each process killed by a signal, with the evidence why.

Read as a death is noted (NOTE at the top of observe/machine.py): the cgroup's OOM kills
since the baseline, the machine's memory, /dev/shm's use, the stack its faulthandler wrote.
"""

from __future__ import annotations

from leakcheck.core.model import Death
from leakcheck.observe import machine, mailbox
from leakcheck.track.shm import ShmWatch
from leakcheck.track.table import Proc

__all__ = ["DeathLog"]


class DeathLog:
    """The job's deaths, each identity once, and the OOM-kill count they are judged against."""

    def __init__(self) -> None:
        self.deaths: list[Death] = []
        self._oom_kills: int | None = None  # what the next death is measured against

    def start(self, oom_kills: int | None) -> None:
        """The baseline: the count when tracking began."""
        self._oom_kills = oom_kills

    def note(
        self,
        proc: Proc,
        signal_number: int,
        *,
        at_s: float,
        epoch: int | None,
        shm: ShmWatch,
        mailbox_dir: str | None,
    ) -> None:
        """Keep ``proc``'s death by ``signal_number`` with what the machine says now."""
        if any(death.key == proc.key for death in self.deaths):
            return
        kills = machine.oom_kill_count()
        rise = None if kills is None or self._oom_kills is None else kills - self._oom_kills
        if rise and self._oom_kills is not None:
            # Each death takes one kill of the rise: deaths noted together share a burst.
            self._oom_kills += 1
        elif kills is not None:
            self._oom_kills = kills
        memory = machine.machine_memory()
        shm.note_usage()
        self.deaths.append(
            Death(
                key=proc.key,
                signal_number=signal_number,
                at_s=at_s,
                epoch=epoch,
                oom_kills=rise,
                memory_total_bytes=memory.total_bytes if memory else None,
                memory_available_bytes=memory.available_bytes if memory else None,
                shm_total_bytes=shm.total_bytes,
                shm_used_peak_bytes=shm.used_peak_bytes,
                rss_bytes_birth=proc.birth_host.rss_bytes if proc.birth_host else None,
                rss_bytes_last=proc.rss_bytes_last,
                stack=mailbox.read_stack(mailbox_dir, proc.key, remove=True)
                if mailbox_dir
                else None,
            )
        )
