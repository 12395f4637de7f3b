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
   its loader's);
3. otherwise the innermost tracker with an open epoch claims it: a loader's epoch is open
   when its workers start (a validation loader run inside the training epoch opens its epoch
   inside the training one);
4. with no epoch open anywhere, the tracker that places it first.

A tracker judges only what it owns; what another owns it counts as the job's memory (so a
sibling's workers never look like unexplained device memory) and never judges. Claims stay
until the process is seen gone, and a tracker's claims outlive its close: a leftover of a
closed tracker is still not another's to judge.
"""

from __future__ import annotations

import os
import threading

from leakcheck.model import ProcessKey

__all__ = ["claim", "claim_worker", "epoch_closed", "epoch_opened", "forget", "owner_of"]

_lock = threading.Lock()
_owners: dict[ProcessKey, str] = {}
_open_epochs: list[str] = []
"""Sessions with an open epoch, innermost (most recently opened) last."""


def owner_of(key: ProcessKey) -> str | None:
    """The session that owns ``key``, if any claimed it."""
    return _owners.get(key)


def claim_worker(key: ProcessKey, session: str) -> None:
    """Record an exact claim: the worker reported itself to ``session``'s mailbox (rule 1)."""
    with _lock:
        _owners[key] = session


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
        owner = _owners.get(key)
        if owner is None:
            owner = _owners.get(parent) if parent is not None else None
        if owner is None:
            owner = _open_epochs[-1] if _open_epochs else session
        _owners[key] = owner
        return owner


def forget(keys: list[ProcessKey]) -> None:
    """Drop the claims of processes seen gone (their identities never come back)."""
    with _lock:
        for key in keys:
            _owners.pop(key, None)


def epoch_opened(session: str) -> None:
    """``session`` opened an epoch: it claims what starts now (rule 3)."""
    with _lock:
        if session in _open_epochs:
            _open_epochs.remove(session)
        _open_epochs.append(session)


def epoch_closed(session: str) -> None:
    """``session``'s epoch ended."""
    with _lock:
        if session in _open_epochs:
            _open_epochs.remove(session)


def _reset_after_fork() -> None:
    # A child starts with no tracker of its own; its parent's claims are not its business,
    # and a lock held by another thread at fork time would stay held for ever.
    global _lock
    _lock = threading.Lock()
    _owners.clear()
    _open_epochs.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)
