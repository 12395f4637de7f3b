"""``leakcheck run -- CMD``: unmodified programs, tracked inside (per loader) and outside.

Every test runs ``leakcheck run`` as a real command in a fresh process, with a private
TMPDIR (so that what a run leaves behind is visible), and stops the processes a leaking
program left, by (pid, start_ticks) from the run's own JSON report.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from leakcheck.commands.instrument import RUN_ENV
from leakcheck.commands.launcher import child_environment, shim_folder
from leakcheck.core.model import ProcessKey
from leakcheck.observe import procs
from leakcheck.track.tracker import Tracker
from tests.polling import wait_for

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TIMEOUT_S = 240
RUN = [sys.executable, "-m", "leakcheck", "run"]


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    data: dict[str, Any] | None


@pytest.fixture
def private_tmp() -> Iterator[Path]:
    """A TMPDIR of the test's own, with a short path: multiprocessing makes AF_UNIX sockets
    there (torch shares tensors through them), and their paths must stay below 108 bytes."""
    folder = Path(tempfile.mkdtemp(prefix="lcrun-"))
    (folder / "tmp").mkdir()
    yield folder / "tmp"
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def leftovers() -> Iterator[list[dict[str, Any]]]:
    """JSON reports whose leaked processes the test stops afterwards."""
    reports: list[dict[str, Any]] = []
    yield reports
    for data in reports:
        for report in _reports(data):
            for finding in report["findings"]:
                if finding["severity"] == "leak" and finding["role"] != "parent":
                    _stop(finding.get("pid"), finding.get("start_ticks"))


def _reports(data: dict[str, Any]) -> list[dict[str, Any]]:
    found = [loader["report"] for loader in data["loaders"] if loader["report"]]
    return found + ([data["tree"]["report"]] if data["tree"]["report"] else [])


def _stop(pid: object, start_ticks: object) -> None:
    if not isinstance(pid, int) or not isinstance(start_ticks, int):
        return
    with contextlib.suppress(psutil.Error):
        proc = psutil.Process(pid)
        if procs.process_key(pid) == ProcessKey(pid, start_ticks):
            proc.kill()
            proc.wait(5)


def _env(private_tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEAKCHECK_")}
    env.update({"PYTHONPATH": str(ROOT), "TMPDIR": str(private_tmp), **extra})
    return env


def leakcheck_run(
    *args: str,
    private_tmp: Path,
    cwd: Path = ROOT,
    leftovers: list[dict[str, Any]] | None = None,
    env: dict[str, str] | None = None,
) -> Run:
    """``python -m leakcheck run --json ... ARGS``; the JSON is read back and removed."""
    json_path = private_tmp.parent / "run.json"
    # Files, not pipes: a leaked process inherits them, and would hold a pipe open.
    out_path, err_path = private_tmp.parent / "run.out", private_tmp.parent / "run.err"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.run(
            [sys.executable, "-m", "leakcheck", "run", "--json", str(json_path), *args],
            stdout=out,
            stderr=err,
            env=env or _env(private_tmp),
            cwd=cwd,
            timeout=TIMEOUT_S,
        )
    data = None
    if json_path.exists():
        data = json.loads(json_path.read_text())
        json_path.unlink()
        if leftovers is not None:
            leftovers.append(data)
    return Run(proc.returncode, out_path.read_text(), err_path.read_text(), data)


def leakcheck_files(folder: Path) -> list[str]:
    """What leakcheck made in a TMPDIR and left there (the run folder, mailboxes).

    Only leakcheck's own: multiprocessing leaves its ``pymp-*`` folders there when its
    workers are killed at exit, with or without leakcheck.
    """
    return sorted(path.name for path in folder.iterdir() if "leakcheck" in path.name)


def _not_the_works(finding: dict[str, Any]) -> bool:
    """A /dev/shm file that appeared while the program ran but that nothing ties to it."""
    return finding["rule"] == "shm" and "nothing ties it to the work" in finding["message"]


def said(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The findings a text report writes: not an unheld /dev/shm file nothing ties to the work
    (an info in the JSON only), which tests running beside this one make."""
    return [
        f
        for f in report["findings"]
        if not (f["rule"] == "shm" and f["severity"] == "info" and f["pid"] is None)
    ]


def findings(report: dict[str, Any], severity: str = "leak") -> collections.Counter[Any]:
    return collections.Counter(
        (f["rule"], f["role"]) for f in report["findings"] if f["severity"] == severity
    )


def loader(data: dict[str, Any], label: str) -> dict[str, Any]:
    matches: list[dict[str, Any]] = [item for item in data["loaders"] if item["label"] == label]
    assert len(matches) == 1, [item["label"] for item in data["loaders"]]
    return matches[0]


def line_of(path: Path, text: str) -> int:
    lines = path.read_text().splitlines()
    return next(number for number, line in enumerate(lines, 1) if text in line)


WATCH_HARNESS = """
import collections, json, runpy, sys
import leakcheck
made = []
original = leakcheck.watch
def recording(*args, **kwargs):
    made.append(original(*args, **kwargs))
    return made[-1]
leakcheck.watch = recording
sys.path.insert(0, sys.argv[1])
sys.argv = [sys.argv[2]]
runpy.run_path(sys.argv[0], run_name="__main__")
print("FINDINGS" + json.dumps([
    [[f.rule, f.role, f.severity, f.pid, f.start_ticks] for f in w.report().findings]
    for w in made
]))
"""


def watch_findings(script: str, private_tmp: Path) -> list[list[list[Any]]]:
    """The findings of each ``watch()`` wrapper the example makes, as it runs them."""
    proc = subprocess.run(
        [sys.executable, "-c", WATCH_HARNESS, str(EXAMPLES), str(EXAMPLES / script)],
        capture_output=True,
        text=True,
        env=_env(private_tmp),
        cwd=ROOT,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr
    line = next(line for line in proc.stdout.splitlines() if line.startswith("FINDINGS"))
    found: list[list[list[Any]]] = json.loads(line[len("FINDINGS") :])
    for wrapper in found:
        for _rule, role, severity, pid, start_ticks in wrapper:
            if severity == "leak" and role != "parent":
                _stop(pid, start_ticks)
    return found


def counted(wrapper: list[list[Any]], severity: str = "leak") -> collections.Counter[Any]:
    return collections.Counter((rule, role) for rule, role, sev, _, _ in wrapper if sev == severity)


# --------------------------------------------------------------------------- same as watch()


@pytest.mark.parametrize(
    ("watched", "plain", "expected"),
    [
        ("grandchild_leak.py", "plain_grandchild_leak.py", {("orphan", "orphan"): 2}),
        ("grandchild_fixed.py", "plain_grandchild_fixed.py", {}),
        ("persistent_cache_leak.py", "plain_persistent_cache_leak.py", None),
        ("persistent_cache_fixed.py", "plain_persistent_cache_fixed.py", None),
    ],
)
def test_unmodified_script_gets_the_findings_of_its_watch_version(
    watched: str,
    plain: str,
    expected: dict[Any, int] | None,
    private_tmp: Path,
    leftovers: list[dict[str, Any]],
) -> None:
    (by_watch,) = watch_findings(watched, private_tmp)
    run = leakcheck_run(
        "--", sys.executable, f"examples/{plain}", private_tmp=private_tmp, leftovers=leftovers
    )
    assert run.returncode == 0, run.stderr
    assert run.data is not None
    (item,) = run.data["loaders"]
    assert item["label"].startswith("examples/plain_")
    # Left out of the comparison: advice about /dev/shm files nothing ties to the work (other
    # jobs' files appearing on a busy machine), and host growth, whose USS reads are paced by
    # their cost, so that in runs of a few seconds which epochs get one depends on the load
    # (host-growth, and its info line on ends without USS, have tests of their own).
    noise = {("shm", None), *(("host-growth", role) for role in ("worker", "parent", None))}
    for severity in ("leak", "info"):
        ran = findings(item["report"], severity)
        for key in noise:
            ran.pop(key, None)
        watched_found = counted(by_watch, severity)
        for key in noise:
            watched_found.pop(key, None)
        assert ran == watched_found, run.stderr
    if expected is not None:  # on a GPU the persistent-cache leak is growth, on a CPU clean
        assert dict(findings(item["report"])) == expected
    # The tree's view holds the same leaking processes (and no others on these scripts).
    loader_leaks = findings(item["report"])
    for key in noise:
        loader_leaks.pop(key, None)
    tree_leaks = findings(run.data["tree"]["report"])
    assert tree_leaks == loader_leaks
    assert run.data["leak_count"] == sum(findings(item["report"]).values())
    verdict = "leak" if findings(item["report"]) else "clean"
    assert f"leakcheck run: verdict {verdict}" in run.stderr
    assert run.stdout.strip().splitlines()[-1] in ("done", "epoch 4 done")
    assert leakcheck_files(private_tmp) == [], "the run left files in TMPDIR"


def test_teardown_on_request_keeps_the_findings(
    private_tmp: Path, leftovers: list[dict[str, Any]]
) -> None:
    run = leakcheck_run(
        "--teardown",
        "--",
        sys.executable,
        "examples/plain_grandchild_leak.py",
        private_tmp=private_tmp,
        leftovers=leftovers,
    )
    assert run.returncode == 0, run.stderr
    assert run.data is not None and run.data["options"]["teardown"] is True
    (item,) = run.data["loaders"]
    assert dict(findings(item["report"])) == {("orphan", "orphan"): 2}
    assert "teardown on" in run.stderr
    # The policy ran in each worker: they reported their teardown.
    assert len(item["report"]["teardowns"]) == 2


# --------------------------------------------------------------------------- loaders


TRAIN_VAL = """\
import sys
from torch.utils.data import DataLoader


def make(n):
    return DataLoader(list(range(n)), batch_size=2, num_workers=1)  # HELPER


train = DataLoader(list(range(8)), batch_size=2, num_workers=2)  # TRAIN
val = DataLoader(list(range(4)), batch_size=2, num_workers=1)  # VAL
a, b = make(4), make(6)
for epoch in range(3):
    for batch in train:
        pass
    for batch in val:
        pass
    fresh = DataLoader(list(range(4)), batch_size=2, num_workers=1)  # FRESH
    for batch in fresh:
        pass
    for batch in a:
        pass
    for batch in b:
        pass
batches = iter(train)
print("len", len(batches), type(batches).__name__, "done")
"""


def test_loaders_are_reported_apart_by_where_they_were_made(
    tmp_path: Path, private_tmp: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN_VAL)
    run = leakcheck_run("--", sys.executable, "train.py", private_tmp=private_tmp, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "len 4 " in run.stdout and run.stdout.strip().endswith("done")
    assert run.data is not None
    labels = [item["label"] for item in run.data["loaders"]]
    train, val, fresh, helper = (
        f"train.py:{line_of(script, marker)}" for marker in ("TRAIN", "VAL", "FRESH", "HELPER")
    )
    # Two loaders of one line alive together are two; one made anew each epoch is one.
    assert sorted(labels) == sorted([train, val, fresh, helper, f"{helper} #2"])
    for label, workers in ((train, 2), (val, 1), (fresh, 1), (helper, 1), (f"{helper} #2", 1)):
        report = loader(run.data, label)["report"]
        epochs = report["epochs"]
        assert len(epochs) == 3, label
        assert all(epoch["end_reason"] == "completed" for epoch in epochs), label
        assert said(report) == [], label
        # Each loader's tracker judged only its own workers.
        assert report["summary"]["processes"] == 1 + 3 * workers, label
    for label in labels:
        assert f"loader {label} (PID {run.data['program']['pid']}): 3 epochs" in run.stderr


CLEAN_TRAIN_VAL = """\
from torch.utils.data import DataLoader

train = DataLoader(list(range(16)), batch_size=4, num_workers=2)
val = DataLoader(list(range(8)), batch_size=4, num_workers=2)
for epoch in range(3):
    for batch in train:
        pass
    for batch in val:
        pass
print("done")
"""


def test_a_clean_train_and_val_run_is_a_few_lines(tmp_path: Path, private_tmp: Path) -> None:
    """Quiet where nothing is wrong: the first line, a line per loader, the tree, the verdict;
    no GPU said once, briefly; nothing about what only the loaders' trackers saw."""
    (tmp_path / "train.py").write_text(CLEAN_TRAIN_VAL)
    run = leakcheck_run("--", sys.executable, "train.py", private_tmp=private_tmp, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.data is not None and run.data["verdict"] == "clean", run.stderr
    report = run.stderr[run.stderr.index("leakcheck run: ") :].rstrip("\n").splitlines()
    assert len(report) <= 6, run.stderr
    assert report[0].startswith("leakcheck run: train.py: program PID ")
    assert [line for line in report if line.startswith("loader train.py:")] == [
        line for line in report[1:3]
    ]
    assert report[-1].startswith("leakcheck run: verdict clean, 0 leaks (2 loaders")
    assert all(line.strip() and len(line) <= 160 for line in report), report
    # The tree holds every loader's processes, its short-lived workers too (the parent once).
    counts = [int(re.search(r"(\d+) processes", line)[1]) for line in report[1:4]]  # type: ignore[index]
    assert "process tree of PID" in report[3] and counts[2] >= counts[0] + counts[1] - 1, report
    if not run.data["gpu"]["checked"]:
        assert run.stderr.count("GPU") == 1 and "; GPU: not checked (" in report[0]


def test_a_loader_line_counts_its_epochs_that_did_not_complete(
    tmp_path: Path, private_tmp: Path
) -> None:
    (tmp_path / "train.py").write_text(
        "from torch.utils.data import DataLoader\n"
        "loader = DataLoader(range(64), batch_size=8)\n"
        "for epoch in range(3):\n"
        "    for i, batch in enumerate(loader):\n"
        "        if epoch and i == 2:\n"
        "            break\n"
    )
    run = leakcheck_run("--", sys.executable, "train.py", private_tmp=private_tmp, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    [line] = [line for line in run.stderr.splitlines() if line.startswith("loader train.py:2 ")]
    assert ": 3 epochs, 2 not completed (break), 1 process; verdict CLEAN" in line, run.stderr


SIX_ORPHANS = """\
import subprocess
from torch.utils.data import DataLoader, Dataset


class StartsThree(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        if not hasattr(self, "helpers"):
            self.helpers = [subprocess.Popen(["sleep", "{sleep}"]) for _ in range(3)]
        return index


for batch in DataLoader(StartsThree(), batch_size=1, num_workers=2):
    pass
print("done")
"""


def test_six_orphans_of_one_cause_are_one_line_under_one_fix(
    tmp_path: Path, private_tmp: Path, leftovers: list[dict[str, Any]]
) -> None:
    sleep = f"{600 + os.getpid() % 1000}.{time.monotonic_ns() % 10**6}"
    (tmp_path / "orphans.py").write_text(SIX_ORPHANS.format(sleep=sleep))
    run = leakcheck_run(
        "--", sys.executable, "orphans.py", private_tmp=private_tmp, cwd=tmp_path,
        leftovers=leftovers,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.data is not None
    (item,) = run.data["loaders"]
    pids = sorted(f["pid"] for f in item["report"]["findings"] if f["rule"] == "orphan")
    assert len(pids) == 6, run.stderr
    lines = run.stderr.splitlines()
    named = [line for line in lines if f"sleep {sleep}" in line]
    assert named == [
        f"  LEAK orphan  6 \u00d7 sleep {sleep} (PIDs {pids[0]}, {pids[1]}, {pids[2]}, \u2026) "
        "outlived its parent since epoch 0, alive after the job"
    ] or (  # a walk that caught a helper under its worker says whose child it was
        len(named) == 1 and "outlived its worker" in named[0]
    ), run.stderr
    fixes = [line for line in lines if line.lstrip().startswith("fix: ") and " kill " in line]
    assert fixes == [
        "    fix: leakcheck.worker_init_fn(terminate_children=True), or kill "
        + " ".join(map(str, pids))
    ], run.stderr
    assert all(len(line) <= 160 for line in lines), run.stderr


LONG_PATH_PROGRAM = """\
import multiprocessing, subprocess, sys, time
from torch.utils.data import DataLoader, Dataset


class StartsOne(Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, index):
        if index == 0:
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep({sleep})"])
        return index


if __name__ == "__main__":
    # Spawned workers: multiprocessing starts its resource tracker with this interpreter.
    loader = DataLoader(StartsOne(), batch_size=1, num_workers=1, multiprocessing_context="spawn")
    for epoch in range(2):
        for batch in loader:
            pass
    time.sleep(1.5)  # the resource tracker lives on, past the grace of its epoch
    print("done")
"""


def test_a_long_interpreter_path_names_nothing_and_hides_no_helper(
    tmp_path: Path, private_tmp: Path, leftovers: list[dict[str, Any]]
) -> None:
    """An interpreter reached through 300+ characters of path: multiprocessing's resource
    tracker is still told by its whole command line (cut at 300 characters, it was a
    survivor), and what leaked is named by what it runs, not by that path."""
    # The venv itself under a long folder: its interpreter finds its packages from where it
    # was started (pyvenv.cfg one folder up), and reports that path as sys.executable.
    folder = tmp_path
    for part in range(3):
        folder = folder / (f"checkout-{part}-" + "x" * 110)
    folder.parent.mkdir(parents=True)
    folder.symlink_to(Path(sys.prefix), target_is_directory=True)
    python = folder / "bin" / Path(sys.executable).name
    assert len(str(python)) > 300 and python.exists()
    sleep = f"{600 + os.getpid() % 97}"  # short: the name's whole code fits
    (tmp_path / "long.py").write_text(LONG_PATH_PROGRAM.format(sleep=sleep))
    run = leakcheck_run(
        "--grace", "0.5", "--", str(python), "long.py", private_tmp=private_tmp, cwd=tmp_path,
        leftovers=leftovers,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.data is not None
    (item,) = run.data["loaders"]
    found = item["report"]["findings"]
    helpers = [f for f in found if "multiprocessing.resource_tracker" in (f["cmdline"] or "")]
    assert helpers == [], run.stderr
    orphans = [f for f in found if f["rule"] == "orphan"]  # one per epoch's worker
    assert len(orphans) == 2, run.stderr
    assert all(str(python) in f["cmdline"] for f in orphans)  # kept whole for decisions
    named = [line for line in run.stderr.splitlines() if line.startswith("  LEAK orphan  ")]
    assert named and all(
        f'python -c "import time; time.sleep({sleep})" (PID' in line for line in named
    ), run.stderr
    assert "checkout-" not in run.stderr and all(len(line) <= 160 for line in named)


def test_a_python_child_with_its_own_loader_is_tracked(tmp_path: Path, private_tmp: Path) -> None:
    (tmp_path / "child.py").write_text(
        "from torch.utils.data import DataLoader\n"
        "loader = DataLoader(list(range(6)), batch_size=2, num_workers=2)\n"
        "for epoch in range(2):\n"
        "    for batch in loader:\n"
        "        pass\n"
    )
    (tmp_path / "parent.py").write_text(
        "import subprocess, sys\n"
        "subprocess.run([sys.executable, 'child.py'], check=True)\n"
        "print('parent done')\n"
    )
    run = leakcheck_run("--", sys.executable, "parent.py", private_tmp=private_tmp, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.data is not None
    item = loader(run.data, "child.py:2")
    assert item["pid"] != run.data["program"]["pid"]
    assert item["argv"] == ["child.py"]
    assert len(item["report"]["epochs"]) == 2
    assert said(item["report"]) == []


WATCHED = """\
import atexit, gc
import os

import leakcheck
from torch.utils.data import DataLoader

kept = []  # KEEP_MIB: the loop keeps that much in this list each epoch
loader = leakcheck.watch(DataLoader(list(range(6)), batch_size=2, num_workers=1))
if os.environ["END"] == "atexit":  # made before the run's exit handler: runs after it
    atexit.register(lambda: print(sum(1 for _ in loader), "batches at exit", flush=True))
for epoch in range(8):
    for i, batch in enumerate(loader):
        if i == 0 and os.environ["KEEP_MIB"]:
            kept.append(bytearray(int(os.environ["KEEP_MIB"]) << 20))
print(len(loader.report().epochs), "epochs", flush=True)
if os.environ["END"] == "close":
    loader.close()
elif os.environ["END"] == "collected":
    del loader
    gc.collect()
elif os.environ["END"] == "os._exit":
    os._exit(0)
"""


@pytest.mark.parametrize(
    ("keep_mib", "end"),
    [
        ("", "close"),
        ("", "open"),
        ("", "atexit"),
        ("40", "close"),
        ("40", "collected"),
        ("40", "open"),
    ],
)
def test_a_loader_the_program_watches_itself_is_a_loader_of_the_run(
    tmp_path: Path, private_tmp: Path, keep_mib: str, end: str
) -> None:
    """Left to watch() (tracked once, its workers its own), its report is the run's: closed,
    collected or still open at exit (then its exit handler may still iterate it)."""
    (tmp_path / "watched.py").write_text(WATCHED)
    env = _env(private_tmp, KEEP_MIB=keep_mib, END=end)
    run = leakcheck_run(
        "--", sys.executable, "watched.py", private_tmp=private_tmp, cwd=tmp_path, env=env
    )
    assert run.returncode == 0, run.stderr
    assert "8 epochs" in run.stdout and run.data is not None, run.stderr
    (item,) = run.data["loaders"]  # not also the run's own "watched.py:8"
    assert item["label"] == "watched.py:8 via watch()" and item["missing"] is None, run.stderr
    assert len(item["report"]["epochs"]) == 8, item["report"]["epochs"]
    report = run.stderr[run.stderr.index("leakcheck run: watched.py: ") :].splitlines()
    if end == "atexit":  # the program's own exit handler iterates it after the run's report
        assert "3 batches at exit" in run.stdout and "Traceback" not in run.stderr, run.stderr
    if not keep_mib:
        assert run.data["verdict"] == "clean" and said(item["report"]) == [], run.stderr
        assert "LEAK" not in run.stderr and len(report) == 4, report  # quiet
        assert report[-1].startswith("leakcheck run: verdict clean, 0 leaks (1 loader"), report
        return
    assert findings(item["report"]) == {("host-growth", "parent"): 1}, run.stderr
    assert "LeakWarning" in run.stderr  # watch()'s own, and the run's report, once
    assert sum("LEAK host-growth  parent" in line for line in report) == 1, run.stderr
    assert report[-1].startswith("leakcheck run: verdict leak, 1 leak (1 loader"), run.stderr


def test_a_watched_loader_of_a_process_ended_by_os_exit_is_named_missing(
    tmp_path: Path, private_tmp: Path
) -> None:
    (tmp_path / "watched.py").write_text(WATCHED)
    env = _env(private_tmp, KEEP_MIB="", END="os._exit")
    run = leakcheck_run(
        "--", sys.executable, "watched.py", private_tmp=private_tmp, cwd=tmp_path, env=env
    )
    assert run.returncode == 0 and run.data is not None, run.stderr
    (item,) = run.data["loaders"]
    assert item["report"] is None and "exit handlers" in item["missing"], run.stderr
    assert "loader watched.py:8 via watch() (PID " in run.stderr
    # The verdict line says what it could not judge (it said "(1 loader and the process tree)").
    assert "0 leaks (1 loader (1 without a report) and the process tree)" in run.stderr


CHDIR_THEN_EXEC = """\
import os, sys
from torch.utils.data import DataLoader

os.chdir("data")  # relative: where the program reads its files from
loader = DataLoader(list(range(8)), batch_size=4, num_workers=1)  # MADE
for epoch in range(2):
    for batch in loader:
        pass
if sys.argv[1:] == ["exec"]:
    os.chdir("..")
    os.execv(sys.executable, [sys.executable, sys.argv[0], "again"])
print("done")
"""


def test_a_loader_made_after_a_chdir_is_labelled_from_where_the_run_began(
    tmp_path: Path, private_tmp: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text(CHDIR_THEN_EXEC)
    (tmp_path / "data").mkdir()
    run = leakcheck_run("--", sys.executable, "train.py", private_tmp=private_tmp, cwd=tmp_path)
    assert run.returncode == 0 and run.data is not None, run.stderr
    (item,) = run.data["loaders"]  # it said "<tmp_path's name>/train.py:5"
    assert item["label"] == f"train.py:{line_of(script, 'MADE')}", run.stderr


def test_the_loaders_of_a_program_before_it_execs_itself_are_not_overwritten(
    tmp_path: Path, private_tmp: Path
) -> None:
    """An exec keeps the PID: the first program's loader is named as one without a report
    (its exit handlers never ran), not replaced by the second one's (it was, silently)."""
    script = tmp_path / "train.py"
    script.write_text(CHDIR_THEN_EXEC)
    (tmp_path / "data").mkdir()
    run = leakcheck_run(
        "--", sys.executable, "train.py", "exec", private_tmp=private_tmp, cwd=tmp_path
    )
    assert run.returncode == 0 and run.stdout.strip() == "done", run.stderr
    assert run.data is not None
    before, after = run.data["loaders"]
    assert before["argv"][1:] == ["exec"] and after["argv"][1:] == ["again"], run.data["loaders"]
    assert before["report"] is None and "exec" in before["missing"], before
    assert len(after["report"]["epochs"]) == 2 and said(after["report"]) == [], after
    assert "0 leaks (2 loaders (1 without a report) and the process tree)" in run.stderr


def test_a_loader_record_that_cannot_be_read_is_said_not_dropped(
    tmp_path: Path, private_tmp: Path
) -> None:
    (tmp_path / "bad.py").write_text(
        "import os\n"
        "path = os.path.join(os.environ['LEAKCHECK_RUN'], 'loader-1-0.json')\n"
        "open(path, 'w').write('{\"pid\": ')\n"
    )
    run = leakcheck_run(
        "--", sys.executable, "bad.py", private_tmp=private_tmp, cwd=tmp_path,
        env=_env(private_tmp),
    )  # fmt: skip
    assert run.data is not None and run.data["loaders"] == [], run.stderr
    assert run.data["failures"] == ["a loader's record cannot be read: loader-1-0.json"]
    assert "leakcheck itself: a loader's record cannot be read: loader-1-0.json" in run.stderr


SLOW_EXIT_CHILD = """\
import atexit, sys, time
from torch.utils.data import DataLoader
if sys.argv[1] == "after":  # runs after leakcheck's own exit handler (last in, first out)
    atexit.register(time.sleep, 4)
for _ in DataLoader(list(range(4)), num_workers=0):
    pass
if sys.argv[1] == "before":
    atexit.register(time.sleep, 4)
print("iterated", flush=True)
"""


@pytest.mark.parametrize("slow", ["before", "after"])
def test_a_process_of_the_run_still_in_its_exit_handlers_is_waited_for_not_an_orphan(
    slow: str, tmp_path: Path, private_tmp: Path
) -> None:
    """A Lightning ddp rank 1 ending after rank 0 (the program) spent > 2 s (the grace) in its
    exit handlers on a loaded machine, before or after writing its report: run named it
    "orphan ... outlived its parent"."""
    (tmp_path / "child.py").write_text(SLOW_EXIT_CHILD)
    (tmp_path / "parent.py").write_text(
        "import subprocess, sys\n"
        f"child = subprocess.Popen([sys.executable, 'child.py', '{slow}'], stdout=-1, text=True)\n"
        "assert child.stdout.readline().strip() == 'iterated'\n"  # it has its run record
    )
    run = leakcheck_run(
        "--", sys.executable, "parent.py", private_tmp=private_tmp, cwd=tmp_path,
        env=_env(private_tmp),
    )  # fmt: skip
    assert run.returncode == 0 and run.data is not None, run.stderr
    assert len(run.data["loaders"]) == 1, run.stderr
    (item,) = run.data["loaders"]
    assert item["label"] == "child.py:5" and item["report"] is not None, run.stderr
    assert said(run.data["tree"]["report"]) == [], run.stderr
    assert run.data["verdict"] == "clean", run.stderr


CALLBACK_FIT = """\\
import os

import torch
import lightning.pytorch as pl
from torch.utils.data import DataLoader
from leakcheck.integrations.lightning import LeakCheckCallback

kept = []  # KEEP_MIB: the loop keeps that much in this list each training epoch


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        if batch_idx == 0 and os.environ.get("KEEP_MIB"):
            kept.append(bytearray(int(os.environ["KEEP_MIB"]) << 20))
        return self.layer(batch).sum()

    def validation_step(self, batch, batch_idx):
        pass

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(torch.randn(8, 2), batch_size=4, num_workers=1)

    def val_dataloader(self):
        return DataLoader(torch.randn(4, 2), batch_size=4, num_workers=1)


callback = LeakCheckCallback()
pl.Trainer(
    accelerator="cpu", max_epochs=8, callbacks=[callback], logger=False,
    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
).fit(Tiny())
print(callback.format())
"""


@pytest.mark.parametrize("keep_mib", ["", "40"])
def test_the_programs_lightning_callback_reports_its_loaders_to_the_run(
    tmp_path: Path, private_tmp: Path, keep_mib: str
) -> None:
    """The loaders the callback adopted are left to it (the run's own report of them would be
    their parent alone); what its stages found is the run's, each finding said once."""
    pytest.importorskip("lightning.pytorch", reason="needs lightning: pip install -e '.[dev]'")
    (tmp_path / "fit.py").write_text(CALLBACK_FIT)
    env = _env(private_tmp, KEEP_MIB=keep_mib)
    run = leakcheck_run(
        "--", sys.executable, "fit.py", private_tmp=private_tmp, cwd=tmp_path, env=env
    )
    assert run.returncode == 0, run.stderr
    assert run.data is not None, run.stderr
    stages = ["train_dataloader", "val_dataloader"]
    labels = [item["label"] for item in run.data["loaders"]]
    assert labels == [f"{stage} via LeakCheckCallback" for stage in stages], run.stderr
    for stage, item in zip(stages, run.data["loaders"], strict=True):
        report = item["report"]
        assert item["pid"] == run.data["program"]["pid"] and item["missing"] is None
        # The callback's own words about its stage, and the run's, count the same.
        epochs, processes = len(report["epochs"]), report["summary"]["processes"]
        assert epochs >= 8 and processes > epochs, report["epochs"]
        own = run.stdout.split(f"{stage}: leakcheck")[1].split("_dataloader: ")[0]
        assert f" in {epochs} epochs ({processes} processes" in own, run.stdout
    report = run.stderr[run.stderr.index("leakcheck run: fit.py: ") :].splitlines()
    if not keep_mib:
        assert run.data["verdict"] == "clean" and run.data["leak_count"] == 0, run.stderr
        assert all(said(item["report"]) == [] for item in run.data["loaders"])
        assert "no leaks in 8 epochs" in run.stdout and "LEAK" not in run.stderr
        assert len(report) == 5, report  # quiet: a line per loader, the tree, the verdict
        assert report[-1].startswith("leakcheck run: verdict clean, 0 leaks (2 loaders")
        return
    train = run.data["loaders"][0]["report"]["findings"]
    assert [(f["rule"], f["role"]) for f in train] == [("host-growth", "parent")], run.stderr
    assert run.data["verdict"] == "leak" and run.data["leak_count"] == 1, run.stderr
    # The callback warned once as it found it; the run's report names it once over both stages.
    assert sum("LEAK host-growth  parent" in line for line in report) == 1, run.stderr
    assert run.stderr.count("LEAK host-growth  parent") == 2, run.stderr
    assert report[-1].startswith("leakcheck run: verdict leak, 1 leak (2 loaders"), run.stderr


# --------------------------------------------------------------------------- exits


FAILING = """\
import sys
from torch.utils.data import DataLoader
loader = DataLoader(list(range(8)), batch_size=2, num_workers=2)
for epoch in range(2):
    for index, batch in enumerate(loader):
        if epoch == 1 and index == 1:
            {action}
"""


@pytest.mark.parametrize(
    ("action", "status", "tree_reason", "ended"),
    [
        (
            "raise RuntimeError('bad batch')",
            1,
            "exception",
            ("exception", "RuntimeError: bad batch"),
        ),
        # Python keeps a SystemExit out of reach: the loop was left by an exception, unnamed.
        ("sys.exit(3)", 3, "exception", ("exception", None)),
        ("sys.exit(0)", 0, "completed", ("exception", None)),
        ("break", 0, "completed", ("break", None)),
    ],
)
def test_a_program_that_fails_or_exits_keeps_its_status_and_gets_its_report(
    action: str,
    status: int,
    tree_reason: str,
    ended: tuple[str, str | None],
    tmp_path: Path,
    private_tmp: Path,
) -> None:
    (tmp_path / "fails.py").write_text(FAILING.format(action=action))
    run = leakcheck_run("--", sys.executable, "fails.py", private_tmp=private_tmp, cwd=tmp_path)
    assert run.returncode == status, run.stderr
    if "raise" in action:
        assert "RuntimeError: bad batch" in run.stderr  # the program's own traceback
    assert run.data is not None
    assert run.data["program"]["exit_status"] == status
    report = loader(run.data, "fails.py:3")["report"]
    epochs = [(epoch["end_reason"], epoch["error"]) for epoch in report["epochs"]]
    assert epochs == [("completed", None), ended]
    # The second epoch's workers were stopped, not left (files other processes made in
    # /dev/shm meanwhile are said as not the work's, and are not this test's business).
    assert [f for f in report["findings"] if not _not_the_works(f)] == []
    assert run.data["tree"]["report"]["epochs"][0]["end_reason"] == tree_reason
    assert f"program exit status {status}" in run.stderr
    assert "loader fails.py:3" in run.stderr
    assert leakcheck_files(private_tmp) == []


def _interrupted_run(
    script: str, tmp_path: Path, private_tmp: Path
) -> tuple[int, str, str, dict[str, Any]]:
    """``leakcheck run -- python SCRIPT``, sent SIGINT once the program printed ``ready``:
    its exit status, the program's standard output (after ``ready``), standard error, and
    the run's JSON."""
    json_path = tmp_path / "run.json"
    proc = subprocess.Popen(
        [*RUN, "--json", str(json_path), "--", sys.executable, script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(private_tmp),
        cwd=tmp_path,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    data: dict[str, Any] = json.loads(json_path.read_text())
    return proc.returncode, stdout, stderr, data


def test_an_interrupted_run_forwards_sigint_reports_and_exits_130(
    tmp_path: Path, private_tmp: Path
) -> None:
    (tmp_path / "slow.py").write_text(
        "import time\n"
        "from torch.utils.data import DataLoader\n"
        "loader = DataLoader(list(range(10000)), batch_size=1, num_workers=2)\n"
        "for index, batch in enumerate(loader):\n"
        "    if index == 0:\n"
        "        print('ready', flush=True)\n"
        "    time.sleep(0.01)\n"
    )
    returncode, _, stderr, data = _interrupted_run("slow.py", tmp_path, private_tmp)
    assert returncode == 130, stderr
    assert "KeyboardInterrupt" in stderr  # the program got it, once
    assert stderr.count("KeyboardInterrupt\n") == 1, stderr
    assert data["program"]["interrupted"] is True
    assert data["program"]["signal"] == signal.SIGINT
    (item,) = data["loaders"]
    assert item["label"] == "slow.py:3"
    # In the loop body or while fetching a batch (NOTE [epoch ends]); the workers were stopped.
    epoch = item["report"]["epochs"][0]
    assert (epoch["end_reason"], epoch["error"]) == ("interrupt", "KeyboardInterrupt")
    assert [f for f in item["report"]["findings"] if not _not_the_works(f)] == []
    assert data["tree"]["report"]["epochs"][0]["end_reason"] == "interrupt"
    assert "interrupted" in stderr and "loader slow.py:3" in stderr
    assert leakcheck_files(private_tmp) == []


def test_a_program_that_handles_the_interrupt_keeps_its_own_status(
    tmp_path: Path, private_tmp: Path
) -> None:
    (tmp_path / "handles.py").write_text(
        "import time\n"
        "try:\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(60)\n"
        "except KeyboardInterrupt:\n"
        "    print('saved', flush=True)\n"
    )
    returncode, stdout, stderr, data = _interrupted_run("handles.py", tmp_path, private_tmp)
    assert returncode == 0, stderr
    assert stdout.strip() == "saved"
    assert data["program"]["interrupted"] is True and data["program"]["exit_status"] == 0
    assert "exited with status 0 (interrupted)" in stderr


CTRL_C = """
import time
from torch.utils.data import DataLoader, Dataset
class Big(Dataset):
    def __len__(self): return 100000
    def __getitem__(self, index): return [0.0] * 20000  # a pipe's worth: queued, not sent
loader = DataLoader(Big(), batch_size=4, num_workers=2, collate_fn=lambda items: items)
for index, batch in enumerate(loader):
    if index == 0:
        print("ready", flush=True)
    time.sleep(0.05)
"""


def test_a_ctrl_c_at_a_terminal_ends_the_epoch_as_interrupt_and_tells_of_no_hang(
    tmp_path: Path, private_tmp: Path
) -> None:
    # The terminal's SIGINT reaches every process of its group: the workers leave their loops
    # with batches queued to a parent that stops reading, and wait to send them at exit until
    # the shutdown's join ends them. Interrupted, not hung.
    (tmp_path / "ctrl_c.py").write_text(CTRL_C)
    json_path = tmp_path / "run.json"
    master, slave = os.openpty()
    # A session of its own whose controlling terminal is the pty: Ctrl-C there is the kernel's.
    trampoline = "import os, sys; os.close(0); os.open(sys.argv[1], os.O_RDWR); "
    trampoline += "os.execv(sys.argv[2], sys.argv[2:])"
    proc = subprocess.Popen(
        [sys.executable, "-c", trampoline, os.ttyname(slave), *RUN, "--json", str(json_path),
         "--", sys.executable, "ctrl_c.py"],
        stdout=slave, stderr=slave, env=_env(private_tmp), cwd=tmp_path, start_new_session=True,
    )  # fmt: skip
    os.close(slave)
    output = b""
    try:
        while b"ready" not in output:
            output += os.read(master, 65536)  # EOF (an exit) raises OSError
        os.write(master, b"\x03")
        with contextlib.suppress(OSError):  # EIO once every process of the pty has closed it
            while chunk := os.read(master, 65536):
                output += chunk
        proc.wait(TIMEOUT_S)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = output.decode(errors="replace")
    assert proc.returncode == 130, text
    data = json.loads(json_path.read_text())
    assert data["program"]["interrupted"] is True
    report = loader(data, "ctrl_c.py:7")["report"]
    ended = [(epoch["end_reason"], epoch["error"]) for epoch in report["epochs"]]
    assert ended == [("interrupt", "KeyboardInterrupt")]
    assert [f for f in report["findings"] if not _not_the_works(f)] == [], text
    assert "did not exit" not in text
    assert leakcheck_files(private_tmp) == []


BLOCKED_WORKER = """
import os, sys, time
from torch.utils.data import DataLoader, Dataset

class BlocksAt(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        while index == 4 and not os.path.exists(sys.argv[1]):
            time.sleep(0.01)
        return index

print(list(DataLoader(BlocksAt(), num_workers=1, batch_size=2, collate_fn=list)))
"""


def test_hang_after_shows_the_blocked_workers_stack_and_the_program_goes_on(
    tmp_path: Path, private_tmp: Path
) -> None:
    """``--hang-after 2`` reaches the program's loader: its worker blocks in ``__getitem__``
    until the stall was written with that worker's stack; then the program finishes."""
    script, release = tmp_path / "blocked.py", tmp_path / "release"
    script.write_text(BLOCKED_WORKER)
    json_path, err_path = tmp_path / "run.json", tmp_path / "run.err"
    command = [*RUN, "--hang-after", "2", "--json", str(json_path), "--"]
    with open(err_path, "w") as err:
        proc = subprocess.Popen(
            [*command, sys.executable, str(script), str(release)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=_env(private_tmp),
            cwd=tmp_path,
        )
        try:
            shown = wait_for(lambda: " in __getitem__" in err_path.read_text(), timeout_s=120)
        finally:
            release.touch()
            stdout, _ = proc.communicate(timeout=TIMEOUT_S)
    stderr = err_path.read_text()
    assert shown, stderr
    assert proc.returncode == 0, stderr
    assert stdout.strip() == "[[0, 1], [2, 3], [4, 5], [6, 7]]"  # undisturbed
    assert "leakcheck: no batch for" in stderr and "--- worker PID" in stderr
    (item,) = json.loads(json_path.read_text())["loaders"]
    hangs = [f for f in item["report"]["findings"] if f["rule"] == "hang"]
    assert hangs and all("in epoch 0" in f["message"] for f in hangs)
    assert any(" in __getitem__" in f["stack"].split("--- the loop's process")[0] for f in hangs)
    assert "info hang" in stderr and "in __getitem__ (blocked.py:" in stderr  # the report
    assert json.loads(json_path.read_text())["options"]["hang_after_s"] == 2.0
    assert leakcheck_files(private_tmp) == []


SHM_LEFT = """
import os
from torch.utils.data import DataLoader, Dataset

class LeavesShm(Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, index):
        name = "/dev/shm/{prefix}_%d" % os.getpid()
        if not os.path.exists(name):
            with open(name, "wb") as handle:
                handle.write(b"x" * 65536)
        return index

for batch in DataLoader(LeavesShm(), batch_size=1, num_workers=1):
    pass
"""


def test_a_shm_file_a_loader_blamed_is_not_contradicted_by_the_tree(
    tmp_path: Path, private_tmp: Path
) -> None:
    """The loader knows its short-lived worker from its report; the tree, which may not have
    sampled that worker, leaves the file to the loader instead of calling it no one's."""
    prefix = f"leakcheck_test_run_{os.getpid()}"
    script = tmp_path / "shm.py"
    script.write_text(SHM_LEFT.format(prefix=prefix))
    try:
        run = leakcheck_run(sys.executable, str(script), private_tmp=private_tmp)
    finally:
        left = [name for name in os.listdir("/dev/shm") if name.startswith(prefix)]
        for name in left:
            os.unlink(os.path.join("/dev/shm", name))
    assert run.returncode == 0, run.stderr
    assert run.data is not None and len(left) == 1
    (item,) = run.data["loaders"]
    mine = [f for f in item["report"]["findings"] if f["shm_name"] == left[0]]
    assert [f["severity"] for f in mine] == ["leak"]
    tree = [f for f in run.data["tree"]["report"]["findings"] if f["shm_name"] == left[0]]
    assert len(tree) == 1  # the tree found the file too (in its words, JSON keeps them)
    tree_text = run.stderr[run.stderr.index("process tree of PID") :].split("\n\n")[0]
    finding_lines = [line for line in tree_text.splitlines() if line.startswith("  ")]
    assert not [line for line in finding_lines if left[0] in line and "leakcheck:" not in line]
    assert "; 1 finding named above" in tree_text
    assert run.data["leak_count"] == 1
    assert f"  LEAK shm  /dev/shm/{left[0]} (64 KiB) left behind" in run.stderr


# A train and a validation loader; the loop keeps 40 MiB after each training epoch.
PARENT_GROWS = """
import torch
from torch.utils.data import DataLoader, TensorDataset
kept = []
data = TensorDataset(torch.arange(64.0))
train = DataLoader(data, batch_size=16, num_workers=1)
val = DataLoader(data, batch_size=32, num_workers=1)
for epoch in range(5):
    for batch in train:
        pass
    kept.append(bytearray(40 << 20))
    for batch in val:
        pass
"""


def test_a_leak_of_the_programs_own_process_is_named_once_over_its_loaders(
    tmp_path: Path, private_tmp: Path
) -> None:
    """Each loader's tracker judges the program's process: the second says "named above"."""
    script = tmp_path / "grows.py"
    script.write_text(PARENT_GROWS)
    run = leakcheck_run(sys.executable, str(script), private_tmp=private_tmp)
    assert run.returncode == 0, run.stderr
    assert run.data is not None
    growth = [
        [f for f in loader["report"]["findings"] if f["rule"] == "host-growth" and f["role"]]
        for loader in run.data["loaders"]
    ]
    assert [[f["role"] for f in found] for found in growth] == [["parent"], ["parent"]]
    assert run.stderr.count("LEAK host-growth  parent") == 1, run.stderr
    assert "verdict LEAK; 1 finding named above" in run.stderr
    assert run.data["leak_count"] == 1


# A training loop with no leakcheck in it: 200k dicts, 2 persistent forked workers, 3 epochs.
PLAIN_COPY_ON_READ = """
import torch
from torch.utils.data import DataLoader
rows = [{"id": i, "label": i % 10, "weight": float(i)} for i in range(200_000)]
def collate(indices):
    return torch.tensor([[rows[i]["id"], rows[i]["label"], rows[i]["weight"]] for i in indices])
loader = DataLoader(range(len(rows)), batch_size=512, shuffle=True, num_workers=2,
                    persistent_workers=True, collate_fn=collate, multiprocessing_context="fork")
for epoch in range(3):
    for batch in loader:
        pass
"""


def test_forked_workers_copying_a_dataset_of_dicts_fail_a_run_in_its_first_epoch(
    private_tmp: Path, leftovers: list[dict[str, Any]]
) -> None:
    """The classic copy-on-read (copied in epoch 0, flat after), which the host-growth rule
    cannot see, fails ``--fail-on-leak``; its tolerance comes from ``--copy-tolerance``."""
    args = ("--", sys.executable, "-c", PLAIN_COPY_ON_READ)
    png = private_tmp.parent / "run.png"
    run = leakcheck_run(
        "--fail-on-leak", "--copy-tolerance", "16MiB", "--plot", str(png), *args,
        private_tmp=private_tmp, leftovers=leftovers,
    )  # fmt: skip
    assert run.returncode == 1, run.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # drawn, and the leak still fails
    png.unlink()
    assert run.data is not None
    (loader,) = [report for report in _reports(run.data) if report["epochs"]][:1]
    copies = [f for f in loader["findings"] if f["rule"] == "copy-on-read"]
    assert [(f["severity"], f["epoch"]) for f in copies] == [("leak", 0)], run.stderr
    assert "2 forked workers of PID" in copies[0]["message"]
    assert "LEAK copy-on-read" in run.stderr
    assert loader["config"]["copy_tolerance_bytes"] == 16 * 2**20
    # A tolerance above the copies: the same run is clean.
    clean = leakcheck_run(
        "--fail-on-leak", *args, private_tmp=private_tmp, leftovers=leftovers,
        env=_env(private_tmp, LEAKCHECK_COPY_TOLERANCE="1GiB"),
    )  # fmt: skip
    assert clean.returncode == 0, clean.stderr


def test_fail_on_leak_turns_a_successful_leaking_run_into_1(
    private_tmp: Path, leftovers: list[dict[str, Any]], tmp_path: Path
) -> None:
    run = leakcheck_run(
        "--fail-on-leak",
        "--grace",
        "1",
        "--",
        sys.executable,
        "examples/plain_grandchild_leak.py",
        private_tmp=private_tmp,
        leftovers=leftovers,
    )
    assert run.returncode == 1, run.stderr
    assert run.data is not None and run.data["leak_count"] == 2
    clean = leakcheck_run(
        "--fail-on-leak", "--", sys.executable, "-c", "pass", private_tmp=private_tmp
    )
    assert clean.returncode == 0, clean.stderr
    assert "loaders: none tracked: no DataLoader iterated in a Python process" in clean.stderr
    # A failing program keeps its own status, leak or not.
    failing = leakcheck_run(
        "--fail-on-leak",
        "--",
        sys.executable,
        "-c",
        "import subprocess, sys; subprocess.Popen(['sleep', '30']); sys.exit(5)",
        private_tmp=private_tmp,
        leftovers=leftovers,
    )
    assert failing.returncode == 5, failing.stderr
    assert failing.data is not None
    assert dict(findings(failing.data["tree"]["report"])) == {("orphan", "orphan"): 1}


def test_a_program_killed_by_a_signal_is_named_with_the_evidence(private_tmp: Path) -> None:
    run = leakcheck_run("--", "sh", "-c", "kill -KILL $$", private_tmp=private_tmp)
    assert run.returncode == 128 + signal.SIGKILL
    assert run.data is not None
    [died] = [f for f in run.data["tree"]["report"]["findings"] if f["rule"] == "died"]
    assert died["pid"] == run.data["program"]["pid"]
    # Sender unknown here, unless the machine's OOM killer was busy meanwhile (evidence).
    assert "SIGKILL" in died["message"] and "in epoch 0" in died["message"]


def test_a_non_python_command_is_watched_from_outside(private_tmp: Path) -> None:
    run = leakcheck_run("--", "sh", "-c", "sleep 0.2; exit 4", private_tmp=private_tmp)
    assert run.returncode == 4
    assert run.data is not None
    assert run.data["loaders"] == [] and said(run.data["tree"]["report"]) == []
    assert run.data["tree"]["report"]["root"]["pid"] == run.data["program"]["pid"]


# --------------------------------------------------------------------------- usage


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "expected a command after --"),
        (["--"], "expected a command after --"),
        (["--tolerance", "lots", "--", "MARK"], "--tolerance"),
        (["--grace", "-1", "--", "MARK"], "--grace"),
        (["--interval", "0", "--", "MARK"], "--interval: expected 1ms or more"),
        (["--interval", "0.5ms", "--", "MARK"], "--interval: expected 1ms or more"),
        (["--device", "x", "--", "MARK"], "--device: expected a GPU index"),
        (["--plot", "run.txt", "--", "MARK"], "--plot: expected a file name ending in .png"),
        (["--json", "/no/such/folder/run.json", "--", "MARK"], "--json: expected a path in"),
        (["--json", "/dev/null", "--", "MARK"], "--json: expected a regular file to write"),
        (["--json", "-", "--", "MARK"], "--json: expected a file path, got '-'"),
        (["--rollup-share", "0", "--", "MARK"], "--rollup-share: expected a share of time in"),
        (["--hang-after", "soon", "--", "MARK"], "--hang-after: expected"),
        (["--rollup-share", "2%x", "--", "MARK"], "--rollup-share: expected a share of time in"),
        (["--bogus", "--", "MARK"], "unrecognized arguments: --bogus"),
        (["--tolerance"], "expected one argument"),
    ],
)
def test_bad_usage_exits_2_with_one_line_and_starts_nothing(
    args: list[str], message: str, tmp_path: Path, private_tmp: Path
) -> None:
    marker = tmp_path / "started"
    command = [sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"]
    argv = [part for arg in args for part in (command if arg == "MARK" else [arg])]
    proc = subprocess.run(
        [sys.executable, "-m", "leakcheck", "run", *argv],
        capture_output=True,
        text=True,
        env=_env(private_tmp),
        cwd=tmp_path,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("leakcheck run: ") and message in proc.stderr
    assert not marker.exists()
    assert leakcheck_files(private_tmp) == []


@pytest.mark.parametrize(("command", "status"), [("no-such-command", 127), ("not-executable", 126)])
def test_a_command_that_cannot_start_is_one_line(
    command: str, status: int, tmp_path: Path, private_tmp: Path
) -> None:
    (tmp_path / "not-executable").write_text("#!/bin/sh\n")
    run = leakcheck_run("--", str(tmp_path / command), private_tmp=private_tmp, cwd=tmp_path)
    assert run.returncode == status
    assert run.stderr.strip().splitlines() == [run.stderr.strip()]
    assert "cannot run" in run.stderr
    assert run.data is None
    assert leakcheck_files(private_tmp) == []


def test_help_documents_the_options() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "leakcheck", "run", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=60,
    )
    assert proc.returncode == 0
    for option in ("--tolerance", "--grace", "--interval", "--teardown", "--json", "--plot"):
        assert option in proc.stdout
    assert "--fail-on-leak" in proc.stdout and "--device" in proc.stdout
    assert "--rollup-share" in proc.stdout and "--hang-after" in proc.stdout
    assert "leakcheck run [options] -- CMD" in proc.stdout


# --------------------------------------------------------------------------- environment


def test_the_users_sitecustomize_still_runs(tmp_path: Path, private_tmp: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nos.environ['USER_SITE_RAN'] = 'yes'\n")
    code = (
        "import os, sys, sitecustomize\n"
        "print(os.environ.get('USER_SITE_RAN'), sitecustomize.__file__)\n"
        "print(any(p.endswith('_shim') for p in sys.path))\n"
    )
    env = _env(private_tmp, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]))
    run = leakcheck_run("--", sys.executable, "-c", code, private_tmp=private_tmp, env=env)
    assert run.returncode == 0, run.stderr
    first, second = run.stdout.splitlines()
    assert first == f"yes {site / 'sitecustomize.py'}"
    assert second == "False"  # the shim's folder is off sys.path again


def test_nothing_is_left_in_the_callers_environment(tmp_path: Path, private_tmp: Path) -> None:
    code = textwrap.dedent(
        """
        import os, sys
        from leakcheck.commands.cli import main
        before = dict(os.environ)
        probe = "import os; print(sorted(k for k in os.environ if k.startswith('LEAKCHECK_')))"
        status = main(["run", "--", sys.executable, "-c", probe])
        assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())
        print("status", status)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=_env(private_tmp),
        cwd=tmp_path,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr
    program, status = proc.stdout.strip().splitlines()
    assert program == "['LEAKCHECK_RUN']"  # what the program sees; the caller keeps nothing
    assert status == "status 0"
    assert leakcheck_files(private_tmp) == []


SHIM_PROBE = """
import multiprocessing, sys
import torch.utils.data as data

def patched():
    return bool(data.DataLoader.__dict__.get("_leakcheck_patched"))

if __name__ == "__main__":
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        in_spawned = pool.apply(patched)
    print(patched(), in_spawned, type(iter(data.DataLoader([1, 2]))).__name__)
"""


@pytest.mark.parametrize("folder", ["missing", "unset", "present"])
def test_the_shim_is_inert_without_a_run_and_active_in_multiprocessing_children(
    folder: str, tmp_path: Path, private_tmp: Path
) -> None:
    env = _env(private_tmp)
    if folder != "unset":
        run_folder = tmp_path / "run"
        if folder == "present":
            run_folder.mkdir()
        env = child_environment(env, str(run_folder))
    else:
        env["PYTHONPATH"] = os.pathsep.join([shim_folder(), env["PYTHONPATH"]])
    script = tmp_path / "probe.py"
    script.write_text(SHIM_PROBE)
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr
    active = folder == "present"
    expected_iter = "_EpochIterator" if active else "_SingleProcessDataLoaderIter"
    # A spawned process of the run tracks its own loaders (a pool's worker here).
    assert proc.stdout.split() == [str(active), str(active), expected_iter]


# --------------------------------------------------------------------------- the pieces


def test_a_tag_scan_finds_processes_by_another_variable(tmp_path: Path) -> None:
    root = procs.process_key(os.getpid())
    assert root is not None
    value = str(tmp_path)
    env = {**os.environ, RUN_ENV: value}
    sleeper = subprocess.Popen(["sleep", "30"], env=env)
    other = subprocess.Popen(["sleep", "30"], env={**os.environ, RUN_ENV: value + "-other"})
    try:
        deadline = time.monotonic() + 5
        found: list[int] = []
        scan = procs.TagScan(value, born_since=root, variable=RUN_ENV)
        while not found and time.monotonic() < deadline:
            found = [info.key.pid for info in scan.scan()]
        assert found == [sleeper.pid]
        info = procs.read_proc(sleeper.pid, session_id=value, tag_variable=RUN_ENV)
        assert info is not None and info.tagged
        info = procs.read_proc(sleeper.pid, session_id=value)  # LEAKCHECK_SESSION: no
        assert info is not None and not info.tagged
    finally:
        for proc in (sleeper, other):
            proc.kill()
            proc.wait()


def test_session_tag_is_validated() -> None:
    from leakcheck.core.errors import UsageError

    for bad in (("", "x"), ("A=B", "x"), ("NAME",), "NAME=x"):
        with pytest.raises(UsageError, match="session_tag"):
            Tracker(session_tag=bad)  # type: ignore[arg-type]


ITERATOR_ATTRIBUTES = """
from torch.utils.data import DataLoader

loader = DataLoader(list(range(16)), batch_size=4, num_workers=2)
iterator = iter(loader)
iterator.tag = "train"  # a program's own attribute, before the first batch
next(iterator)
print("yielded", iterator._num_yielded, len(iterator), iterator.tag)
iterator._num_yielded = 0
print("reset", iterator._num_yielded)
iterator._shutdown_workers()
"""


def test_the_programs_iterator_still_answers_for_the_dataloaders(
    tmp_path: Path, private_tmp: Path
) -> None:
    """Programs and libraries read the DataLoader iterator's own attributes: under `run`
    its epoch iterator hands them over from the first batch on."""
    script = tmp_path / "attributes.py"
    script.write_text(ITERATOR_ATTRIBUTES)
    run = leakcheck_run(sys.executable, str(script), private_tmp=private_tmp)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[:2] == ["yielded 1 4 train", "reset 0"]


KEPT_PEEK = """
from torch.utils.data import DataLoader

loader = DataLoader(list(range(32)), batch_size=8, num_workers=2)
kept = iter(loader)
first = next(kept)  # a peek at the first batch, its iterator kept
for epoch in range(3):
    for batch in loader:
        pass
"""


KEPT_PEEK_DROPPED = """
from torch.utils.data import DataLoader

loader = DataLoader(list(range(32)), batch_size=8, num_workers=2)
kept = iter(loader)
first = next(kept)
for epoch in range(3):
    for index, batch in enumerate(loader):
        if epoch == 1 and index == 1:
            del kept  # the peek's iterator goes in the middle of the second loop
"""


def test_a_kept_peek_iterator_dropped_later_ends_only_its_own_epoch(
    tmp_path: Path, private_tmp: Path
) -> None:
    script = tmp_path / "peek.py"
    script.write_text(KEPT_PEEK_DROPPED)
    run = leakcheck_run(sys.executable, str(script), private_tmp=private_tmp)
    assert run.returncode == 0, run.stderr
    assert run.data is not None
    (item,) = run.data["loaders"]
    epochs = [(e["end_reason"], e["batches"]) for e in item["report"]["epochs"]]
    assert epochs == [("closed", None)] + [("completed", 4)] * 3


def test_epochs_after_a_kept_peek_iterator_are_tracked(tmp_path: Path, private_tmp: Path) -> None:
    """The kept iterator leaves the run's own hook on the loader: the loops after it are
    still epochs of the loader, not taken for a loader the program watches itself."""
    script = tmp_path / "peek.py"
    script.write_text(KEPT_PEEK)
    run = leakcheck_run(sys.executable, str(script), private_tmp=private_tmp)
    assert run.returncode == 0, run.stderr
    assert run.data is not None
    (loader,) = run.data["loaders"]
    reasons = [epoch["end_reason"] for epoch in loader["report"]["epochs"]]
    assert len(reasons) == 4 and reasons[1:] == ["completed"] * 3, reasons


SEVEN_EPOCHS = """
import time
from torch.utils.data import DataLoader

loader = DataLoader(list(range(8)), batch_size=4)
for epoch in range(7):
    for batch in loader:
        time.sleep(0.05)
"""


@pytest.mark.parametrize(
    ("share", "sources"), [("1e-9", ["rss", "uss"] + ["rss"] * 5), ("1", ["uss"] * 7)]
)
def test_rollup_share_reaches_the_programs_trackers(
    share: str, sources: list[str], tmp_path: Path, private_tmp: Path
) -> None:
    """A share too small for more reads leaves every end but the first judged one on resident
    memory (the parent alone: NOTE [host pacing]); a share of 1 reads USS at every one."""
    script = tmp_path / "seven.py"
    script.write_text(SEVEN_EPOCHS)
    run = leakcheck_run(
        "--rollup-share", share, "--", sys.executable, str(script), private_tmp=private_tmp
    )
    assert run.returncode == 0, run.stderr
    assert run.data is not None and run.data["options"]["rollup_share"] == float(share)
    # The program's torch, which the launcher never imports, is recorded from its loaders.
    assert run.data["environment"]["torch"] == torch.__version__
    (item,) = run.data["loaders"]
    parents = [
        next(p for p in epoch["processes"] if p["role"] == "parent")
        for epoch in item["report"]["epochs"]
    ]
    assert [p["host_source"] for p in parents] == sources


def test_an_epoch_iterator_can_be_copied() -> None:
    """copy and pickle make the object without __init__: no slot is set when they ask."""
    import copy

    from leakcheck.commands.instrument import _EpochIterator

    duplicate = copy.copy(_EpochIterator(None, [], (n for n in [1])))
    assert isinstance(duplicate, _EpochIterator)


FORKSERVER_PROGRAM = """
import multiprocessing

if __name__ == "__main__":
    child = multiprocessing.get_context("forkserver").Process(target=print, args=("hi",))
    child.start()
    child.join()
"""


def test_helpers_that_exit_with_their_program_are_no_orphans(
    tmp_path: Path, private_tmp: Path
) -> None:
    """The forkserver and resource tracker leave the tree when the program ends and exit
    moments later: the tree waits for them as for any process, and they are no leak."""
    script = tmp_path / "forkserver.py"
    script.write_text(FORKSERVER_PROGRAM)
    for _ in range(3):  # a race before: flagged in 3 of 5 runs
        # They exit within milliseconds, but an interpreter's shutdown on a loaded 2-core
        # host took over the default 2 s once (1 run in 8 beside three busy loops): the
        # tree waits only while they live, so a longer grace costs nothing here.
        run = leakcheck_run(
            "--grace", "20", "--", sys.executable, str(script), private_tmp=private_tmp
        )
        assert run.returncode == 0, run.stderr
        assert "verdict clean, 0 leaks" in run.stderr, run.stderr
