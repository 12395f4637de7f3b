"""The environment variables trackers export to their children, as layers.

Trackers rooted in this process export ``LEAKCHECK_SESSION`` and their mailbox, and overlap
in any order: closing one removes its layer, and the variable takes the newest layer left, or
its value before the first. One changed from outside since is left as it is, and the layers
under it are dropped as stale.
"""

from __future__ import annotations

import itertools
import os
import threading

__all__ = ["export", "exported_since", "mark", "withdraw"]

_lock = threading.Lock()
_tokens = itertools.count(1)
# variable -> (token, value) layers, oldest first, above its value before them (token 0)
_layers: dict[str, list[tuple[int, str | None]]] = {}
_history: list[tuple[int, str, str]] = []  # (token, variable, value) of the latest exports
_KEPT_EXPORTS = 4096


def export(values: dict[str, str]) -> int:
    """Set the variables as a new layer; returns the token that withdraws it."""
    with _lock:
        token = next(_tokens)
        for name, value in values.items():
            _history.append((token, name, value))
            layers = _layers.get(name)
            if not layers or os.environ.get(name) != layers[-1][1]:  # none, or stale ones
                layers = _layers[name] = [(0, os.environ.get(name))]
            layers.append((token, value))
            os.environ[name] = value
        del _history[:-_KEPT_EXPORTS]
        return token


def mark() -> int:
    """A mark to ask ``exported_since`` about: the exports made after this call."""
    with _lock:
        return _history[-1][0] if _history else 0


def exported_since(since: int, name: str) -> list[str]:
    """The values of ``name`` exported after ``since`` (the tags of trackers started since)."""
    with _lock:
        return [value for token, variable, value in _history if token > since and variable == name]


def withdraw(token: int) -> None:
    """Remove the layer of ``token``; each variable shows what is left."""
    with _lock:
        for name, layers in list(_layers.items()):
            remaining = [layer for layer in layers if layer[0] != token]
            if len(remaining) == len(layers):
                continue
            if os.environ.get(name) != layers[-1][1]:  # changed from outside: stale layers
                del _layers[name]
                continue
            _layers[name] = remaining  # at least the value from before: token 0
            value = remaining[-1][1]
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _reset_after_fork() -> None:
    # A child's variables are its own: none of its parent's trackers will withdraw there.
    global _lock
    _lock = threading.Lock()
    _layers.clear()


os.register_at_fork(after_in_child=_reset_after_fork)
