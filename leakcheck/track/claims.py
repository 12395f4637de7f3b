"""Whose process is it: ownership among the trackers of one process.

NOTE [claims]: one process often runs several trackers (a train and a validation loader each
under ``watch()``, a ``watch()`` inside a test the pytest plugin checks), each walking the same
root's children: without owners, one loader's persistent worker is another's survivor. Each
placed process's owner is:

1. a worker that reported itself through a tracker's mailbox is that tracker's: exact;
2. a process whose parent is claimed is the parent's owner's, and follows it when rule 1
   corrects the parent; children of a root several trackers share are told apart by 3;
3. otherwise the tracker whose epoch was the innermost open at its birth (its start ticks:
   NOTE [process identity] in procs.py), not when a walk first saw it;
4. with no epoch open anywhere at its birth, the tracker that places it first.

A tracker judges only what it owns and counts what another owns as the job's memory. Claims
outlive the tracker's close (what is born after it is not the closed tracker's); those of
processes seen gone are kept a while; what rule 1 takes from a session waits in ``taken_from``.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from leakcheck.core.model import ProcessKey
from leakcheck.observe import procs

__all__ = [
    "add_root",
    "claim",
    "claim_worker",
    "epoch_closed",
    "epoch_opened",
    "forget",
    "owner_of",
    "session_closed",
    "taken_from",
]


@dataclass
class _Claim:

    owner: str
    parent: ProcessKey | None = None  # the parent a rule-2 claim came through
    exact: bool = False  # rule 1's: no correction of a parent moves it


_lock = threading.Lock()
_live: dict[ProcessKey, _Claim] = {}
_gone: dict[ProcessKey, _Claim] = {}  # the latest seen gone, oldest first
_KEPT_GONE = 1024
_roots: dict[ProcessKey, set[str]] = {}  # the sessions of the trackers rooted at each
_taken: dict[tuple[str, ProcessKey], None] = {}  # (session, process) rule 1 took from it
# (session, opened, closed) of epochs in seconds since boot (the start ticks' clock), in the
# order they opened; closed ones kept a while, for processes seen late.
_epochs: list[tuple[str, float, float | None]] = []
_KEPT_EPOCHS = 256
_closed: dict[str, float] = {}  # closed sessions, with when (seconds since boot), oldest first


def owner_of(key: ProcessKey) -> str | None:
    """The session that owns ``key``, if any claimed it."""
    found = _live.get(key)
    return found.owner if found is not None else None


def claim_worker(key: ProcessKey, session: str) -> None:
    """Record an exact claim: the worker reported itself to ``session``'s mailbox (rule 1)."""
    with _lock:
        found = _live.get(key)
        if found is None and key not in _gone:
            found = _live[key] = _Claim(session)
        if found is not None:  # else seen gone before its report was read
            found.exact = True
        _take(key, found or _gone[key], session)
        corrected = [key]
        while corrected:
            parent = corrected.pop()
            for heir, heirs in [*_live.items(), *_gone.items()]:
                if heirs.parent == parent and not heirs.exact:
                    _take(heir, heirs, session)
                    corrected.append(heir)


def _take(key: ProcessKey, found: _Claim, session: str) -> None:
    if found.owner != session:
        _taken[found.owner, key] = None
        while len(_taken) > _KEPT_GONE:
            del _taken[next(iter(_taken))]
    found.owner = session


def taken_from(session: str) -> set[ProcessKey]:
    """The processes rule 1 took from ``session`` since it last asked: not its own."""
    with _lock:
        if not _taken:
            return set()
        mine = [entry for entry in _taken if entry[0] == session]
        for entry in mine:
            del _taken[entry]
        return {key for _, key in mine}


def claim(key: ProcessKey, parent: ProcessKey | None, session: str) -> str:
    """The owner of ``key`` as ``session``'s tracker places it (rules 2-4 of NOTE [claims])."""
    with _lock:
        found = _live.get(key) or _gone.get(key)
        if found is not None:
            return found.owner  # a gone one: placed from a listing taken before it was gone
        owner: str | None = None
        rooted = _roots.get(parent) if parent is not None else None
        ticks_per_s = procs.clock_ticks()
        born_s = key.start_ticks / ticks_per_s  # NOTE [process identity] in procs.py
        heir_of = None
        if rooted:
            owner = next(iter(rooted)) if len(rooted) == 1 else None
        elif parent is not None and parent in _live:
            owner = _live[parent].owner
            if _closed_before(owner, born_s, 1 / ticks_per_s):
                owner = None  # born after its parent's tracker closed: not that one's
            else:
                heir_of = parent
        if owner is None:
            owner = _epoch_at(key.start_ticks, ticks_per_s) or session
        _live[key] = _Claim(owner, heir_of)
        return owner


def _epoch_at(start_ticks: int, ticks_per_s: int) -> str | None:
    # Rule 3: the innermost epoch open over the whole tick of the birth; else the latest
    # opened of those open for part of it (processes start as an epoch opens).
    born_s = start_ticks / ticks_per_s
    window_end_s = (start_ticks + 1) / ticks_per_s
    for session, opened, closed in reversed(_epochs):
        if opened <= born_s and (closed is None or closed >= window_end_s):
            return session
    overlapping = [
        (opened, session)
        for session, opened, closed in _epochs
        if opened < window_end_s
        and (closed is None or closed >= born_s)
        and not _closed_before(session, born_s, 1 / ticks_per_s)
    ]
    return max(overlapping)[1] if overlapping else None


def _closed_before(session: str, born_s: float, tick_s: float) -> bool:
    closed_s = _closed.get(session)
    return closed_s is not None and born_s + tick_s > closed_s


def add_root(key: ProcessKey, session: str) -> None:
    """``session``'s tracker watches the tree under ``key``."""
    with _lock:
        _roots.setdefault(key, set()).add(session)


def forget(keys: list[ProcessKey]) -> None:
    """Drop the claims of processes seen gone (their identities never come back)."""
    with _lock:
        for key in keys:
            found = _live.pop(key, None)
            if found is not None:
                found.exact = False
                _gone.pop(key, None)
                _gone[key] = found
            _roots.pop(key, None)
        while len(_gone) > _KEPT_GONE:
            del _gone[next(iter(_gone))]


def epoch_opened(session: str) -> None:
    """``session`` opened an epoch: it claims what is born from now on (rule 3)."""
    with _lock:
        _close_open(session)
        _epochs.append((session, procs.since_boot_s(), None))
        del _epochs[:-_KEPT_EPOCHS]


def epoch_closed(session: str) -> None:
    """``session``'s epoch ended."""
    with _lock:
        _close_open(session)


def session_closed(session: str) -> None:
    """``session``'s tracker closed: its claims stand, it claims nothing born from now on."""
    with _lock:
        _close_open(session)
        _closed[session] = procs.since_boot_s()
        while len(_closed) > _KEPT_EPOCHS:
            del _closed[next(iter(_closed))]
        for root in [root for root, sessions in _roots.items() if session in sessions]:
            _roots[root].discard(session)
            if not _roots[root]:
                del _roots[root]


def _close_open(session: str) -> None:
    now = procs.since_boot_s()
    for index, (owner, opened, closed) in enumerate(_epochs):
        if owner == session and closed is None:
            _epochs[index] = (owner, opened, now)


def _reset_after_fork() -> None:
    # A child starts with no tracker of its own; its parent's claims are not its business,
    # and a lock held by another thread at fork time would stay held for ever.
    global _lock
    _lock = threading.Lock()
    for registry in (_live, _gone, _roots, _taken, _epochs, _closed):
        registry.clear()


os.register_at_fork(after_in_child=_reset_after_fork)
