"""``from leakcheck.integrations.lightning import LeakCheckCallback``: the public path."""

from __future__ import annotations

from leakcheck.adapters.lightning import LeakCheckCallback

__all__ = ["LeakCheckCallback"]
