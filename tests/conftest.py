"""Fixtures shared by the CPU and GPU test suites."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A pytester whose subprocess sessions find leakcheck and its entry point.

    The inner sessions load the plugin through a ``pytest11`` entry point declared by a small
    ``.dist-info`` on ``PYTHONPATH``, as an installed leakcheck would, so ``-p no:leakcheck``
    works even before the package is installed. Needs ``pytest_plugins = ["pytester"]`` in
    the test module.
    """
    site = pytester.path.parent / f"{pytester.path.name}-site"
    dist = site / "leakcheck_plugin_under_test-0.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: leakcheck-plugin-under-test\nVersion: 0.0\n"
    )
    (dist / "entry_points.txt").write_text("[pytest11]\nleakcheck = leakcheck.plugin\n")
    path = [str(site), str(REPO), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in path if p))
    for name in list(os.environ):
        if name.startswith("LEAKCHECK_") or name.startswith("PYTEST_XDIST"):
            monkeypatch.delenv(name)
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    # pytest prints whole failure messages in its short summary under CI: the inner
    # sessions' output must read the same here and in CI.
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("BUILD_NUMBER", raising=False)
    return pytester
