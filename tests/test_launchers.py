"""``leakcheck run`` under every launcher: the loaders of every Python process, named well.

Real programs under a real ``leakcheck run``: DDP started with ``torch.multiprocessing.spawn``
(``examples/ddp_spawn_train.py``), plain ``multiprocessing`` children of each start method,
``start_processes`` children, a Lightning ``ddp_spawn`` fit, and a loader that a library makes
for the program. What a leaking job leaves is stopped afterwards by (pid, start_ticks).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from leakcheck.commands.instrument import LoaderResult
from leakcheck.commands.launcher import _read_loaders
from leakcheck.core.model import Finding, ProcessKey, RankInfo
from leakcheck.core.ranks import EXPORTED_RANK_ENV
from leakcheck.judge.report import is_said, report_from_dict
from leakcheck.observe import procs

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "ddp_spawn_train.py"
TIMEOUT_S = 240


@pytest.fixture
def private_tmp() -> Iterator[Path]:
    """A TMPDIR of the test's own, with a short path (AF_UNIX sockets live there)."""
    folder = Path(tempfile.mkdtemp(prefix="lclaunch-"))
    (folder / "tmp").mkdir()
    yield folder / "tmp"
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def leftovers() -> Iterator[list[tuple[int, int]]]:
    """(pid, start_ticks) of what a job left; stopped after the test, by identity."""
    found: list[tuple[int, int]] = []
    yield found
    for pid, ticks in found:
        with contextlib.suppress(psutil.Error):
            if procs.process_key(pid) == ProcessKey(pid, ticks):
                proc = psutil.Process(pid)
                proc.kill()
                proc.wait(5)


def leakcheck_run(
    args: list[str],
    private_tmp: Path,
    *,
    cwd: Path = ROOT,
    pythonpath: tuple[Path, ...] = (),
    leftovers: list[tuple[int, int]] | None = None,
) -> tuple[int, str, dict[str, Any]]:
    """``python -m leakcheck run --json ... -- ARGS``: status, standard error, the JSON."""
    json_path = private_tmp.parent / "run.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEAKCHECK_")}
    env.update(
        PYTHONPATH=os.pathsep.join(map(str, (ROOT, *pythonpath))),
        TMPDIR=str(private_tmp),
        OMP_NUM_THREADS="1",
    )
    # Files, not pipes: a leaked process inherits them, and would hold a pipe open.
    out_path, err_path = private_tmp.parent / "out", private_tmp.parent / "err"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.run(
            [sys.executable, "-m", "leakcheck", "run", "--json", str(json_path), "--", *args],
            stdout=out,
            stderr=err,
            env=env,
            cwd=cwd,
            timeout=TIMEOUT_S,
        )
    stderr = err_path.read_text()
    assert json_path.exists(), stderr
    data: dict[str, Any] = json.loads(json_path.read_text())
    if leftovers is not None:
        for report in reports_of(data):
            for finding in report["findings"]:
                if finding["severity"] == "leak" and finding["start_ticks"] is not None:
                    leftovers.append((finding["pid"], finding["start_ticks"]))
    return proc.returncode, stderr, data


def said(report: dict[str, Any]) -> list[Finding]:
    """The findings a text report writes (``report.is_said``): the JSON also keeps information
    no one can act on (spawn workers' copy-on-read that cannot be told, /dev/shm files of
    other jobs that ran beside the work)."""
    return [f for f in report_from_dict(report).findings if is_said(f)]


def reports_of(data: dict[str, Any]) -> list[dict[str, Any]]:
    found = [loader["report"] for loader in data["loaders"] if loader["report"]]
    return found + ([data["tree"]["report"]] if data["tree"]["report"] else [])


def leaks(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for f in report["findings"] if f["severity"] == "leak"]


def line_of(path: Path, text: str) -> int:
    lines = path.read_text().splitlines()
    return next(number for number, line in enumerate(lines, 1) if text in line)


def exported_rank(pid: int) -> str | None:
    """What the process itself says: ``LEAKCHECK_RANK`` in its initial environment."""
    prefix = f"{EXPORTED_RANK_ENV}=".encode()
    with open(f"/proc/{pid}/environ", "rb") as handle:
        for entry in handle.read().split(b"\0"):
            if entry.startswith(prefix):
                return entry[len(prefix) :].decode()
    return None


# --------------------------------------------------------------------------- mp.spawn DDP


def test_an_mp_spawn_ddp_job_names_each_ranks_loader_and_what_its_workers_left(
    private_tmp: Path, leftovers: list[tuple[int, int]]
) -> None:
    """The ImageNet example's way (mp.spawn, gloo, DistributedSampler, 2 workers a rank):
    each worker starts a helper that outlives it; each rank's loader reports its own two,
    named with the rank, and the tree and the job give them to that rank too."""
    args = [sys.executable, str(EXAMPLE), "--epochs", "1", "--leak", "--helper-s", "60"]
    status, err, data = leakcheck_run(args, private_tmp, leftovers=leftovers)
    assert status == 0, err
    label = f"examples/ddp_spawn_train.py:{line_of(EXAMPLE, 'loader = DataLoader(')}"
    loaders = {loader["rank"]["rank"]: loader for loader in data["loaders"] if loader["rank"]}
    assert sorted(loaders) == [0, 1] and len(data["loaders"]) == 2, err
    program = data["program"]["pid"]
    for rank, loader in loaders.items():
        assert loader["label"] == label
        assert loader["pid"] != program
        assert (loader["rank"]["local_rank"], loader["rank"]["world_size"]) == (rank, 2)
        assert f"loader {label} (rank {rank} PID {loader['pid']}): 1 epoch" in err
        found = leaks(loader["report"])
        assert [(f["rule"], f["rank"]) for f in found] == [("orphan", rank)] * 2, err
        for finding in found:
            assert "sleep 60" in finding["cmdline"]
            assert exported_rank(finding["pid"]) == f"{rank},{rank},2"  # the helper agrees
            assert any(
                line.lstrip().startswith("LEAK orphan  ")
                and f"rank {rank} sleep 60" in line
                and str(finding["pid"]) in line
                for line in err.splitlines()
            ), err
    # The outside view: the same helpers, each with its rank; each rank's own process too.
    tree = data["tree"]["report"]
    by_pid = {f["pid"]: f["rank"] for f in leaks(tree)}
    for rank, loader in loaders.items():
        for finding in leaks(loader["report"]):
            assert by_pid[finding["pid"]] == rank
    seen = {(p["key"]["pid"], p["rank"]) for rec in tree["epochs"] for p in rec["processes"]}
    assert {(loader["pid"], rank) for rank, loader in loaders.items()} <= seen
    job = {rank["rank"]: rank for rank in data["job"]["ranks"]}
    assert data["job"]["world_size"] == 2 and sorted(job) == [0, 1]
    for rank, loader in loaders.items():
        assert job[rank]["verdict"] == "leak" and job[rank]["pids"] == [loader["pid"]]
        assert sorted(f["pid"] for f in job[rank]["leaks"]) == sorted(
            f["pid"] for f in leaks(loader["report"])
        )
    assert data["leak_count"] == 4


def test_the_mp_spawn_ddp_job_without_the_leak_is_clean(private_tmp: Path) -> None:
    status, err, data = leakcheck_run([sys.executable, str(EXAMPLE), "--epochs", "1"], private_tmp)
    assert status == 0, err
    assert sorted(loader["rank"]["rank"] for loader in data["loaders"]) == [0, 1], err
    for loader in data["loaders"]:
        assert [e["end_reason"] for e in loader["report"]["epochs"]] == ["completed"]
        assert said(loader["report"]) == [], err
    assert data["verdict"] == "clean" and data["leak_count"] == 0, err
    assert [(r["rank"], r["verdict"]) for r in data["job"]["ranks"]] == [(0, "clean"), (1, "clean")]
    assert "verdict clean, 0 leaks (2 loaders, 2 ranks and the process tree)" in err


def test_loaders_are_shown_rank_by_rank_whichever_rank_started_first(tmp_path: Path) -> None:
    """Ranks start their loaders at once: the report's order must not follow the race."""
    made = [  # (pid, rank, index, started): rank 1 a hair first, then a second loader each
        (20, 1, 0, 100.0),
        (10, 0, 0, 100.1),
        (10, 0, 1, 101.0),
        (20, 1, 1, 100.9),
        (5, None, 0, 99.0),
    ]
    for pid, rank, index, started in made:
        info = RankInfo(rank=rank, world_size=2) if rank is not None else None
        loader = LoaderResult(
            label="t.py:1", pid=pid, rank=info, index=index, started_unix_s=started
        )
        (tmp_path / f"loader-{pid}-{index}.json").write_text(json.dumps(loader.to_dict()))
    shown = [(r.pid, r.index) for r in _read_loaders(str(tmp_path), [])]
    assert shown == [(5, 0), (10, 0), (10, 1), (20, 0), (20, 1)]


# --------------------------------------------------------------------------- multiprocessing


CHILDREN = """\
import multiprocessing, sys
import torch.multiprocessing
from torch.utils.data import DataLoader, Dataset


class Nested(Dataset):
    \"\"\"Each item iterates a loader of its own, inside the worker: never tracked.\"\"\"

    def __len__(self):
        return 4

    def __getitem__(self, index):
        return sum(int(b.sum()) for b in DataLoader(list(range(4)), batch_size=2))  # NESTED


def iterate(parent):
    own = DataLoader(Nested(), batch_size=2, num_workers=1, multiprocessing_context="fork")  # CHILD
    for epoch in range(2):
        for batch in own:
            pass
    for batch in parent:
        pass


def rank(index, parent):
    iterate(parent)


if __name__ == "__main__":
    launcher, method = sys.argv[1:]
    # Its workers fork wherever it is iterated: with the default context, a forkserver
    # child would start a forkserver of its own, which outlives the child by moments, and
    # the program's loader tracker (whose session tag it carries) would call it an orphan.
    parent = DataLoader(  # PARENT
        list(range(4)), batch_size=2, num_workers=1, multiprocessing_context="fork"
    )
    for batch in parent:
        pass
    if launcher == "Process":
        child = multiprocessing.get_context(method).Process(target=iterate, args=(parent,))
        child.start()
        child.join()
        assert child.exitcode == 0, child.exitcode
    else:
        torch.multiprocessing.start_processes(rank, args=(parent,), nprocs=2, start_method=method)
    print("done")
"""


@pytest.mark.parametrize(
    ("launcher", "method"),
    [
        ("Process", "fork"),
        ("Process", "spawn"),
        ("Process", "forkserver"),
        ("start_processes", "fork"),
        ("start_processes", "spawn"),
    ],
)
def test_the_loaders_of_multiprocessing_children_are_tracked_and_not_their_workers(
    launcher: str, method: str, tmp_path: Path, private_tmp: Path
) -> None:
    """A child iterates a loader of its own (whose dataset iterates one in each worker) and
    the program's loader (after the program did: a forked child inherits its trackers, a
    spawned one gets the loader pickled). Each process reports its own loaders at its exit
    (a forked child ends with os._exit); start_processes's children are ranks by index."""
    script = tmp_path / "children.py"
    script.write_text(CHILDREN)
    status, err, data = leakcheck_run(
        [sys.executable, "children.py", launcher, method], private_tmp, cwd=tmp_path
    )
    assert status == 0, err
    program = data["program"]["pid"]
    child, parent = (f"children.py:{line_of(script, m)}" for m in ("# CHILD", "# PARENT"))
    labels = sorted((loader["label"], loader["pid"] == program) for loader in data["loaders"])
    children = 1 if launcher == "Process" else 2
    expected = [(child, False)] * children + [(parent, False)] * children + [(parent, True)]
    assert labels == sorted(expected), err  # the workers' nested loaders: none
    for loader in data["loaders"]:
        assert loader["missing"] is None, loader
        epochs = loader["report"]["epochs"]
        own = loader["label"] == child
        assert [e["end_reason"] for e in epochs] == ["completed"] * (2 if own else 1)
        assert said(loader["report"]) == [], err
        if own:  # its one worker per epoch, no more: the nested loaders started none
            assert loader["report"]["summary"]["processes"] == 1 + 2
    ranks = sorted(
        loader["rank"]["rank"]
        for loader in data["loaders"]
        if loader["label"] == child and loader["rank"] is not None
    )
    assert ranks == ([] if launcher == "Process" else [0, 1])
    assert data["verdict"] == "clean", err


# --------------------------------------------------------------------------- Lightning


FIT = """\
import torch
from torch.utils.data import Dataset


class Pairs(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, index):
        generator = torch.Generator().manual_seed(index)
        return torch.randn(4, generator=generator), torch.randn(1, generator=generator)


if __name__ == "__main__":
    # Lightning is imported here and in tinymodel.py alone: each spawned DataLoader worker
    # imports this file again, and needs torch only.
    import lightning.pytorch as pl
    from tinymodel import Tiny

    trainer = pl.Trainer(
        strategy="ddp_spawn",
        accelerator="cpu",
        devices=2,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(Pairs()))
    print("fit done")
"""

TINY = """\
import torch
import lightning.pytorch as pl
from torch.utils.data import DataLoader


class Tiny(pl.LightningModule):
    def __init__(self, dataset):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.dataset = dataset

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(self.dataset, batch_size=4, num_workers=2, persistent_workers=True)
"""


def test_a_lightning_ddp_spawn_fit_tracks_each_ranks_train_loader(
    tmp_path: Path, private_tmp: Path
) -> None:
    """Lightning makes each rank's loader again with a DistributedSampler, in a rank whose
    stack holds no line of the program: the label is still the line that made the first."""
    pytest.importorskip("lightning.pytorch", reason="needs lightning: pip install -e '.[dev]'")
    (tmp_path / "fit.py").write_text(FIT)
    (tmp_path / "tinymodel.py").write_text(TINY)
    status, err, data = leakcheck_run([sys.executable, "fit.py"], private_tmp, cwd=tmp_path)
    assert status == 0, err
    label = f"tinymodel.py:{line_of(tmp_path / 'tinymodel.py', 'return DataLoader(')} via lightning"
    assert sorted((loader["label"], loader["rank"]["rank"]) for loader in data["loaders"]) == [
        (label, 0),
        (label, 1),
    ], err
    for loader in data["loaders"]:
        # Lightning stops at the last batch without asking for another: the epoch is complete.
        assert [e["end_reason"] for e in loader["report"]["epochs"]] == ["completed"] * 2, err
        assert said(loader["report"]) == [], err
    assert "not completed" not in err
    assert data["verdict"] == "clean" and data["leak_count"] == 0, err
    assert [r["verdict"] for r in data["job"]["ranks"]] == ["clean", "clean"]


DDP_FIT = """\
import subprocess

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader


def leave_a_sleep(worker_id):
    subprocess.Popen(["sleep", "120"])  # never waited for: an orphan once the worker exits


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(torch.randn(8, 4), batch_size=4, num_workers=1,
                          worker_init_fn=leave_a_sleep)


if __name__ == "__main__":
    trainer = pl.Trainer(
        strategy="ddp", accelerator="cpu", devices=2, max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(Tiny())
"""


def test_a_lightning_ddp_fit_gives_each_rank_the_leaks_of_its_own_workers(
    tmp_path: Path, private_tmp: Path, leftovers: list[tuple[int, int]]
) -> None:
    """Lightning's ``ddp`` starts ranks 1.. as children of rank 0 (no ``RANK``: ``LOCAL_RANK``,
    ``NODE_RANK``, ``WORLD_SIZE``): rank 0's loader watches a tree that holds rank 1, whose
    orphans are rank 1's to name, once."""
    pytest.importorskip("lightning.pytorch", reason="needs lightning: pip install -e '.[dev]'")
    (tmp_path / "fit.py").write_text(DDP_FIT)
    status, err, data = leakcheck_run(
        [sys.executable, "fit.py"], private_tmp, cwd=tmp_path, leftovers=leftovers
    )
    assert status == 0, err
    named = {}
    for loader in data["loaders"]:
        orphans = [f for f in leaks(loader["report"]) if f["rule"] == "orphan"]
        named[loader["rank"]["rank"]] = sorted({f["rank"] for f in orphans})
        assert len(orphans) == 1, err  # its one worker's sleep
    assert named == {0: [0], 1: [1]}, err
    assert [(r["rank"], len(r["leaks"])) for r in data["job"]["ranks"]] == [(0, 1), (1, 1)], err
    assert data["leak_count"] == 2, err


# --------------------------------------------------------------------------- labels


FAKELIB = """\
from torch.utils.data import DataLoader


def make_loader(n):
    return DataLoader(list(range(n)), batch_size=2, num_workers=1)


class Trainer:
    def __init__(self, n):
        self.n = n

    def train(self):
        for batch in self._loader():
            pass

    def _loader(self):
        return make_loader(self.n)
"""

PROGRAM = """\
import fakelib
from torch.utils.data import DataLoader

loader = fakelib.make_loader(4)  # MAKE
for batch in loader:
    pass
fakelib.Trainer(6).train()  # TRAIN
for batch in DataLoader(list(range(4)), batch_size=2):  # OWN
    pass
"""


def test_a_loader_a_library_made_is_labelled_by_the_programs_line_via_the_library(
    tmp_path: Path, private_tmp: Path
) -> None:
    """The library sits in a site-packages folder; the program runs from another folder than
    its own, so its file is shown with its folder."""
    library = tmp_path / "env" / "lib" / "site-packages"
    (library / "fakelib").mkdir(parents=True)
    (library / "fakelib" / "__init__.py").write_text(FAKELIB)
    scripts, work = tmp_path / "scripts", tmp_path / "work"
    scripts.mkdir()
    work.mkdir()
    program = scripts / "program.py"
    program.write_text(PROGRAM)
    status, err, data = leakcheck_run(
        [sys.executable, str(program)], private_tmp, cwd=work, pythonpath=(library,)
    )
    assert status == 0, err
    make, train, own = (line_of(program, m) for m in ("# MAKE", "# TRAIN", "# OWN"))
    assert [loader["label"] for loader in data["loaders"]] == [
        f"scripts/program.py:{make} via fakelib",
        f"scripts/program.py:{train} via fakelib Trainer",
        f"scripts/program.py:{own}",
    ], err
    assert f"loader scripts/program.py:{make} via fakelib (PID " in err


def test_a_library_frame_is_told_from_the_users(tmp_path: Path) -> None:
    """The shim's rule for a frame's file, as a spawned child and a program see it."""
    code = textwrap.dedent(
        """
        import os, sys, runpy
        shim = runpy.run_path(sys.argv[1])
        library = shim["_library"]
        site = os.sep.join(["", "x", "lib", "python3", "site-packages", ""])
        print(library(site + "transformers/trainer.py"), library(site + "six.py"),
              library(os.__file__) == "", library("<frozen runpy>") == "",
              library("/home/me/train.py"), library("<string>"))
        """
    )
    shim = ROOT / "leakcheck" / "commands" / "_shim" / "sitecustomize.py"
    done = subprocess.run(
        [sys.executable, "-c", code, str(shim)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["transformers", "six", "True", "True", "None", "None"]
