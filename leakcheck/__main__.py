"""``python -m leakcheck``: the same as the ``leakcheck`` command."""

from __future__ import annotations

from leakcheck.commands.cli import command

# The guard matters: spawned DataLoader workers re-import the parent's main module.
if __name__ == "__main__":
    command()
