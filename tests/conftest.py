"""Fixtures shared by the CPU and GPU test suites."""

from __future__ import annotations

import fcntl
import os
import signal
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# A suite started in the background of a shell without job control inherits SIGINT ignored,
# and so would every program a test starts (exec keeps an ignored signal ignored): the tests
# that press Ctrl-C on a child need it delivered, so the suite takes Python's default back.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def shm_file() -> Iterator[Path]:
    """A unique path in the real /dev/shm, removed at the end whatever happens."""
    path = Path("/dev/shm") / f"leakcheck-test-{uuid.uuid4().hex}"
    if not path.parent.is_dir():
        pytest.skip("no /dev/shm")
    yield path
    path.unlink(missing_ok=True)


@pytest.fixture
def kernel_threads() -> set[int]:
    """PIDs of the kernel threads /proc lists now (kthreadd, PID 2, among them on a host).

    Told by ``PF_KTHREAD`` (0x00200000) in each stat line's flags (field 9), read here
    without leakcheck. Skips where there is none to see: no /proc, or a PID namespace of its
    own (a container), where kernel threads are not listed.
    """
    found: set[int] = set()
    names = os.listdir("/proc") if os.path.isdir("/proc") else []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as stat:
                line = stat.read()
        except OSError:
            continue  # exited meanwhile
        flags = int(line[line.rfind(b")") + 2 :].split()[6])
        if flags & 0x00200000:
            found.add(int(name))
    if not found:
        pytest.skip("no kernel thread listed in /proc here")
    return found


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
    (dist / "entry_points.txt").write_text("[pytest11]\nleakcheck = leakcheck.adapters.plugin\n")
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


# The pytest plugin run by itself (no xdist) blames a new /dev/shm file that nobody holds on
# the test that ran while it appeared: a user's serial session is the only test running.
# Here the suite runs under pytest-xdist, and these tests make and leave real /dev/shm files
# (on purpose, or for a moment) or run such plugin sessions inside: run side by side, one's
# file is another's leak. So they take turns, one at a time on the host, fixtures' setup and
# teardown included, by a lock on a file outside /dev/shm (``_dev_shm_turn``); the rest of
# the suite makes no such files (its semaphores are not judged). The lock is what keeps them
# apart. The scheduling only keeps workers from waiting on it: the xdist group "dev-shm"
# (``--dist loadgroup`` in pyproject.toml; the marks are set before xdist's own hook reads
# them, hence tryfirst) and, because pytest 9.2 drops xdist's group suffix from node IDs
# (pytest-dev/pytest-xdist#1386), a scheduler that sends the three modules below to one
# worker by their paths.
_DEV_SHM_MODULES = ("test_plugin.py", "test_run.py", "test_tracker_host.py")
_DEV_SHM_FIXTURES = ("shm_file", "inner")
_DEV_SHM_GROUP = "dev-shm"
_DEV_SHM_LOCK = Path(tempfile.gettempdir()) / f"leakcheck-tests-dev-shm-{os.getuid()}.lock"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put the tests that touch the real /dev/shm in one xdist group."""
    group = pytest.mark.xdist_group(_DEV_SHM_GROUP)
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if Path(str(item.path)).name in _DEV_SHM_MODULES or any(
            name in fixtures for name in _DEV_SHM_FIXTURES
        ):
            item.add_marker(group)


@pytest.fixture(autouse=True)
def _dev_shm_turn(request: pytest.FixtureRequest) -> Iterator[None]:
    """Run a test of the "dev-shm" group alone among the group's tests (see above)."""
    mark = request.node.get_closest_marker("xdist_group")
    if mark is None or mark.args[:1] != (_DEV_SHM_GROUP,):
        yield
        return
    # A POSIX record lock: forked children (a test's loader workers) do not inherit it,
    # and it ends with the process holding it, so a worker that dies mid-test frees it.
    with open(_DEV_SHM_LOCK, "a") as lock:
        fcntl.lockf(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.lockf(lock, fcntl.LOCK_UN)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """Under ``--dist loadgroup``, send the dev-shm modules' tests to one worker, told by
    their node IDs' paths (the controller sees no marks, and the group's suffix may be
    lost)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling  # type: ignore[import-untyped]

    if not hasattr(LoadGroupScheduling, "_split_scope"):
        return None  # another xdist: its own scheduling, and the lock still keeps turns

    class _DevShmScheduling(LoadGroupScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            if Path(nodeid.split("::", 1)[0]).name in _DEV_SHM_MODULES:
                return _DEV_SHM_GROUP
            return str(super()._split_scope(nodeid))

    return _DevShmScheduling(config, log)
