"""Whose process is it: ownership among the trackers of one process.

NOTE [claims]: one training process often runs several trackers at once: a train loader and
a validation loader each wrapped by ``watch()``, a ``watch()`` inside a test that the pytest
plugin checks. Each walks the same root's children, so each must know which of them are its
own; otherwise one loader's healthy persistent worker is another's survivor, and an orphan
is reported twice. This process-wide registry records, for every process a tracker places,
the session that owns it:

1. a worker that reported itself through a tracker's mailbox belongs to that tracker; this
   claim is exact and replaces any other;
2. a process whose parent is claimed belongs to the parent's owner (a worker's children are
   its loader's), and follows it when rule 1 corrects the parent's claim: a worker can be
   placed, and start a helper, before its report reaches the mailbox. A child of a
   tracker's root belongs to that tracker where it is the only one rooted there: a
   ``Tracker(root_pid=S)`` beside a tracker of this process watches S's tree, though the
   other placed S first (and may place S's children first); this process's own trackers
   share their root, and rule 3 tells them apart;
3. otherwise the tracker whose epoch was the innermost one open when the process was born
   (its start ticks, as seconds since boot: NOTE [process identity] in procs.py) claims it:
   a loader's epoch is open when its workers start, and a validation loader run inside the
   training epoch opens its epoch inside the training one. Birth time, not the time a walk
   first sees it: the other tracker's sampler may walk first;
4. with no epoch open anywhere at its birth, the tracker that places it first.

A tracker judges only what it owns; what another owns it counts as the job's memory (so a
sibling's workers never look like unexplained device memory) and never judges. Claims stay
until the process is seen gone, and a tracker's claims outlive its close: a leftover of a
closed tracker is still not another's to judge. What is born after the close is not the
closed tracker's, though: rules 2 and 3 pass it by (``session_closed``), so a helper one
tracker claimed (a process it saw born, still alive) does not hand the children it starts
later to a tracker that no longer judges anything, and a root leaves only live trackers
rooted there.

A correction by rule 1 must reach the tracker that lost the process even where the worker
is gone by then. Rule 3 can give a validation worker to the training tracker (forked in
the tick its epoch opened, its start reads before the opening), and a short-lived worker
can be seen gone, by either tracker (and its claim forgotten), before its report is
read from the mailbox, or before the losing tracker walks again: re-reading the claim finds
none, and the worker stayed in the losing tracker's epoch as its own. So the owners of
processes seen gone, and the parents of gone heirs, are kept a while (the report comes within
a sampler tick or two), a late report changes those without claiming anything again, and
every process rule 1 takes from a session, alive or gone, is queued for that session's
table, which takes it out of what it calls its own (``taken_from``) at its next walk and
epoch end.
"""

from __future__ import annotations

import os
import threading

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

_lock = threading.Lock()
_owners: dict[ProcessKey, str] = {}
_heir_of: dict[ProcessKey, ProcessKey] = {}
"""The parent each process claimed through its parent (rule 2) was claimed through."""
_exact: set[ProcessKey] = set()
"""Workers claimed by their own report (rule 1): no correction of a parent moves them."""
_gone: dict[ProcessKey, str] = {}
"""The owners of the latest processes seen gone, oldest first: a report read after a
tracker saw its worker gone still finds whom it corrects."""
_roots: dict[ProcessKey, set[str]] = {}
"""The sessions of the trackers rooted at each process (rule 2 of NOTE [claims])."""
_gone_heir_of: dict[ProcessKey, ProcessKey] = {}
"""``_heir_of`` of the latest heirs seen gone: a late report of their parent still moves them."""
_KEPT_GONE = 1024
_taken: dict[tuple[str, ProcessKey], None] = {}
"""(session, process) for each process rule 1 took from a session, until that session's
table takes it back (taken_from); oldest first, the latest ``_KEPT_GONE`` kept (a closed
tracker never asks again)."""
_epochs: list[tuple[str, float, float | None]] = []
"""(session, opened, closed or None) of the epochs of live trackers, in seconds since boot
(the clock of a process's start ticks in /proc), in the order they opened; closed ones are
kept for a while, for processes seen late."""
_KEPT_EPOCHS = 256
_closed: dict[str, float] = {}
"""The sessions of closed trackers, with when each closed (seconds since boot), oldest first;
the latest ``_KEPT_EPOCHS`` kept."""


def owner_of(key: ProcessKey) -> str | None:
    """The session that owns ``key``, if any claimed it."""
    return _owners.get(key)


def claim_worker(key: ProcessKey, session: str) -> None:
    """Record an exact claim: the worker reported itself to ``session``'s mailbox (rule 1)."""
    with _lock:
        if key not in _owners and key in _gone:
            _take_gone(key, session)  # seen gone before its report was read: no new claim
        else:
            _exact.add(key)
            _take(key, _owners.get(key), session)
        corrected = [key]
        while corrected:
            parent = corrected.pop()
            for heir, heir_parent in _heir_of.items():
                if heir_parent == parent and heir not in _exact and heir in _owners:
                    _take(heir, _owners[heir], session)
                    corrected.append(heir)
            for heir, heir_parent in _gone_heir_of.items():
                if heir_parent == parent and heir in _gone:
                    _take_gone(heir, session)
                    corrected.append(heir)


def _take(key: ProcessKey, previous: str | None, session: str) -> None:
    """Give ``key`` to ``session``, queueing the correction for its previous owner."""
    _owners[key] = session
    _queue(key, previous, session)


def _take_gone(key: ProcessKey, session: str) -> None:
    """The same for a process seen gone: its kept owner changes, no claim is made again."""
    previous, _gone[key] = _gone[key], session
    _queue(key, previous, session)


def _queue(key: ProcessKey, previous: str | None, session: str) -> None:
    if previous is not None and previous != session:
        _taken[previous, key] = None
        while len(_taken) > _KEPT_GONE:
            del _taken[next(iter(_taken))]


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
    """The owner of a process a tracker of ``session`` places now, claimed if it was not.

    Args:
        key: The process.
        parent: Its parent's identity, if known.
        session: The placing tracker's session.

    Returns:
        The owning session (rules 2-4 of NOTE [claims]; an existing claim stands).

    """
    with _lock:
        if key in _gone and key not in _owners:
            return _gone[key]  # placed from a listing taken before it was seen gone
        owner = _owners.get(key)
        rooted = _roots.get(parent) if parent is not None else None
        ticks_per_s = procs.clock_ticks()
        born_s = key.start_ticks / ticks_per_s  # NOTE [process identity] in procs.py
        if owner is None and rooted:
            # A child of a tracker's root: that tracker's, where it is the only one rooted
            # there; several (this process's trackers) are told apart by rule 3.
            owner = next(iter(rooted)) if len(rooted) == 1 else None
        elif owner is None and parent is not None:
            owner = _owners.get(parent)
            if owner is not None and _closed_before(owner, born_s, 1 / ticks_per_s):
                owner = None  # born after its parent's tracker closed: not that one's
            if owner is not None:
                _heir_of[key] = parent
        if owner is None:
            owner = _epoch_at(key.start_ticks, ticks_per_s) or session
        _owners[key] = owner
        return owner


def _epoch_at(start_ticks: int, ticks_per_s: int) -> str | None:
    """The session of the innermost epoch open when a process was born (rule 3).

    Start ticks say only that the birth fell within that clock tick (the kernel truncates).
    An epoch open over that whole tick was open at the birth, and the innermost such epoch
    wins: a loader's first batch can open an inner epoch a few milliseconds after the
    loader's last worker was forked, in the same tick. Where no epoch covers the whole tick,
    one that was open for part of it wins, the latest opened: processes start as an epoch
    opens (its loader's workers), not as the one before it closes (two loaders' epochs back
    to back).
    """
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
    """Whether ``session``'s tracker closed before a birth at ``born_s`` (whole tick late)."""
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
            owner = _owners.pop(key, None)
            if owner is not None:
                _gone[key] = owner
            parent = _heir_of.pop(key, None)
            if parent is not None:
                _gone_heir_of[key] = parent
            _exact.discard(key)
            _roots.pop(key, None)
        for kept in (_gone, _gone_heir_of):
            while len(kept) > _KEPT_GONE:
                del kept[next(iter(kept))]


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
    """``session``'s tracker closed: it claims nothing born from now on (NOTE [claims]).

    Its claims stand; it leaves the roots it watched, and its open epoch, if any, ends.
    """
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
    _owners.clear()
    _heir_of.clear()
    _exact.clear()
    _gone.clear()
    _gone_heir_of.clear()
    _roots.clear()
    _taken.clear()
    _epochs.clear()
    _closed.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)
