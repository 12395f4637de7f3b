"""Distributed jobs on the CPU: real torchrun, gloo, DataLoaders with workers (issue 16).

Each test runs ``tests/dist_train.py`` with 2 ranks of one forked worker each, under
``leakcheck run`` (``--nproc-per-node``, or wrapping torchrun itself) or under plain
torchrun with ``leakcheck.gather_reports``. What a rank leaves behind is checked against the
process itself (its ``RANK`` in ``/proc/PID/environ``), and stopped afterwards by
(pid, start_ticks).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from leakcheck.commands.cli import torchrun_command
from leakcheck.core.model import Finding, ProcessKey, RankInfo
from leakcheck.judge.job import RankReport, judge_job
from leakcheck.judge.report import build_report
from leakcheck.observe.procs import process_key

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "tests/dist_train.py"
TIMEOUT_S = 120
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A short private folder (AF_UNIX paths stay short) with a TMPDIR of its own."""
    folder = Path(tempfile.mkdtemp(prefix="lcdist-"))
    (folder / "tmp").mkdir()
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def leftovers() -> Iterator[list[tuple[int, int]]]:
    """(pid, start_ticks) of what a job left; stopped after the test, by identity."""
    found: list[tuple[int, int]] = []
    yield found
    procs: list[psutil.Process] = []
    trackers: list[psutil.Process] = []
    for pid, start_ticks in found:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            if process_key(pid) == ProcessKey(pid, start_ticks):
                tracker = "multiprocessing.resource_tracker" in " ".join(proc.cmdline())
                (trackers if tracker else procs).append(proc)
    # A killed rank's resource tracker unlinks the rank's named semaphores (/dev/shm/sem.mp-*)
    # once the last holder of its pipe is gone: its forkserver and the worker forked from
    # it. Stop those first (the worker too: it watches the forkserver, not the rank), then
    # let the tracker clean up and exit; kill it only if it does not.
    for proc in list(procs):
        with contextlib.suppress(psutil.Error):
            procs += proc.children(recursive=True)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(procs, timeout=5)
    _gone, alive = psutil.wait_procs(trackers, timeout=5)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
            proc.wait(5)


def _env(workdir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEAKCHECK_")}
    env.update({"PYTHONPATH": str(ROOT), "TMPDIR": str(workdir / "tmp")})
    return env


def _run(argv: list[str], workdir: Path) -> tuple[int, str, str]:
    # Files, not pipes: a leaked process inherits them, and would hold a pipe open.
    out_path, err_path = workdir / "out", workdir / "err"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.run(
            argv, stdout=out, stderr=err, env=_env(workdir), cwd=ROOT, timeout=TIMEOUT_S
        )
    return proc.returncode, out_path.read_text(), err_path.read_text()


def leakcheck_run(
    args: list[str], workdir: Path, leftovers: list[tuple[int, int]]
) -> tuple[int, str, dict[str, Any]]:
    """``leakcheck run --json ... ARGS``: status, standard error, the JSON."""
    json_path = workdir / "run.json"
    argv = [sys.executable, "-m", "leakcheck", "run", "--json", str(json_path), *args]
    status, _out, err = _run(argv, workdir)
    data: dict[str, Any] = json.loads(json_path.read_text())
    reports = [loader["report"] for loader in data["loaders"] if loader["report"]]
    reports += [data["tree"]["report"]] if data["tree"]["report"] else []
    for report in reports:
        for finding in report["findings"]:
            # A /dev/shm finding names its holder by PID alone: not a process to stop.
            if finding["start_ticks"] is not None and finding["role"] != "parent":
                leftovers.append((finding["pid"], finding["start_ticks"]))
    return status, err, data


def rank_in_environ(pid: int) -> str | None:
    """What the process itself says: ``RANK`` in its initial environment."""
    with open(f"/proc/{pid}/environ", "rb") as handle:
        for entry in handle.read().split(b"\0"):
            if entry.startswith(b"RANK="):
                return entry[5:].decode()
    return None


def ranks_of(data: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {rank["rank"]: rank for rank in data["job"]["ranks"]}


def helper_leaks(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Leaks of the helpers dist_train.py starts (their command line names their file)."""
    return [
        f
        for f in report["findings"]
        if f["severity"] == "leak" and "helper-1-" in (f["cmdline"] or "")
    ]


# --------------------------------------------------------------------------- real jobs


def test_a_clean_two_rank_job_has_a_clean_verdict_per_rank(
    workdir: Path, leftovers: list[tuple[int, int]]
) -> None:
    status, err, data = leakcheck_run(
        ["--nproc-per-node", "2", "--", SCRIPT, "--folder", str(workdir)], workdir, leftovers
    )
    assert status == 0, err
    assert data["schema_version"] == 2
    assert data["command"][1:5] == [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
    ]
    assert data["verdict"] == "clean" and data["leak_count"] == 0, err
    assert sorted(loader["rank"]["rank"] for loader in data["loaders"]) == [0, 1]
    job = data["job"]
    assert (job["verdict"], job["world_size"]) == ("clean", 2)
    ranks = ranks_of(data)
    assert sorted(ranks) == [0, 1]
    for rank, loader in (
        (r, next(x for x in data["loaders"] if x["rank"]["rank"] == r)) for r in ranks
    ):
        assert ranks[rank]["reported"] and ranks[rank]["verdict"] == "clean"
        assert ranks[rank]["pids"] == [loader["pid"]]
        assert f"  rank {rank} (PID {loader['pid']}): verdict CLEAN" in err
    # The outside tracker saw both ranks' processes with their rank (NOTE [rank read]: each
    # rank was forked by the agent, and read again once it had exec'd).
    seen = {
        (p["key"]["pid"], p["rank"])
        for rec in data["tree"]["report"]["epochs"]
        for p in rec["processes"]
    }
    for loader in data["loaders"]:
        assert (loader["pid"], loader["rank"]["rank"]) in seen, seen
    assert "leakcheck run: verdict clean, 0 leaks (2 loaders, 2 ranks and the process tree)" in err


def test_a_grandchild_left_by_rank_1_is_named_with_its_rank_wrapping_torchrun(
    workdir: Path, leftovers: list[tuple[int, int]]
) -> None:
    args = ["--", *TORCHRUN, SCRIPT, "--mode", "grandchild", "--folder", str(workdir)]
    status, err, data = leakcheck_run(args, workdir, leftovers)
    assert status == 0, err
    ranks = ranks_of(data)
    assert ranks[0]["verdict"] == "clean" and ranks[1]["verdict"] == "leak", err
    rank1 = next(loader for loader in data["loaders"] if loader["rank"]["rank"] == 1)
    leaks = helper_leaks(rank1["report"])
    assert len(leaks) == 2, err  # one helper per epoch's worker
    for leak in leaks:
        assert (leak["rule"], leak["rank"]) == ("orphan", 1)
        assert rank_in_environ(leak["pid"]) == "1"  # the process itself agrees
        assert _named_orphan(err, leak["pid"]), err
        assert leak["pid"] in {f["pid"] for f in ranks[1]["leaks"]}
    assert ranks[0]["leaks"] == []
    assert data["job"]["verdict"] == "leak" and data["leak_count"] == 2


def test_a_rank_killed_mid_epoch_is_named_with_its_leftovers_and_the_status_kept(
    workdir: Path, leftovers: list[tuple[int, int]]
) -> None:
    args = ["--nproc-per-node", "2", "--", SCRIPT, "--mode", "kill", "--folder", str(workdir)]
    status, err, data = leakcheck_run(args, workdir, leftovers)
    assert status == 1, err  # torchrun failed the job: its status is the run's
    assert data["program"]["exit_status"] == 1
    killed = next(loader for loader in data["loaders"] if loader["rank"]["rank"] == 1)
    assert killed["report"] is None and killed["missing"]
    rank1 = ranks_of(data)[1]
    assert rank1["verdict"] == "leak" and not rank1["reported"] and rank1["missing"]
    assert rank1["pids"] == [killed["pid"]]
    (helper,) = helper_leaks(data["tree"]["report"])
    assert (helper["rule"], helper["rank"]) == ("orphan", 1)
    assert rank_in_environ(helper["pid"]) == "1"
    assert helper["pid"] in {f["pid"] for f in rank1["leaks"]}
    assert _named_orphan(err, helper["pid"]), err
    line = f"rank 1 (PID {killed['pid']}): verdict LEAK as seen from outside"
    assert line in err and f"PID {killed['pid']}): no report: " in err
    assert "program exit status 1" in err


def test_reports_are_gathered_on_rank_0_through_torch_distributed(
    workdir: Path, leftovers: list[tuple[int, int]]
) -> None:
    argv = [*TORCHRUN, SCRIPT, "--mode", "grandchild", "--gather", "--folder", str(workdir)]
    status, out, err = _run(argv, workdir)
    assert status == 0, err
    job = json.loads((workdir / "job.json").read_text())  # written by rank 0 alone
    for rank in job["ranks"]:
        for leak in rank["leaks"]:
            leftovers.append((leak["pid"], leak["start_ticks"]))
    ranks = {rank["rank"]: rank for rank in job["ranks"]}
    assert sorted(ranks) == [0, 1] and all(rank["reported"] for rank in ranks.values())
    assert ranks[0]["verdict"] == "clean" and ranks[1]["verdict"] == "leak"
    assert len(ranks[1]["leaks"]) == 2
    for leak in ranks[1]["leaks"]:
        assert (leak["rule"], leak["rank"]) == ("orphan", 1)
        assert rank_in_environ(leak["pid"]) == "1"
    assert "job (world size 2, 2 ranks seen): verdict LEAK, 2 leaks" in out


# --------------------------------------------------------------------------- usage


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--nproc-per-node", "0", "--", "train.py"],
            "--nproc-per-node: expected a number of ranks",
        ),
        (["--nproc-per-node", "two", "--", "train.py"], "got 'two'"),
        (["--nproc-per-node", "2", "--", "torchrun", "train.py"], "got the launcher 'torchrun'"),
        (
            ["--nproc-per-node", "2", "--", "python", "-m", "torch.distributed.run", "t.py"],
            "got the launcher 'torch.distributed.run'",
        ),
        (["--nproc-per-node", "2", "--", "python"], "expected a script after --"),
    ],
)
def test_bad_nproc_per_node_exits_2_with_one_line(
    args: list[str], message: str, workdir: Path
) -> None:
    argv = [sys.executable, "-m", "leakcheck", "run", *args]
    status, out, err = _run(argv, workdir)
    assert status == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("leakcheck run: ") and message in err


def test_torchrun_command_accepts_a_script_python_or_a_module() -> None:
    head = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    assert torchrun_command(["train.py", "--lr", "1"], "2") == [*head, "train.py", "--lr", "1"]
    assert torchrun_command(["python3", "train.py"], "2") == [*head, "train.py"]
    assert torchrun_command(["python", "-m", "pkg.train"], "2") == [*head, "-m", "pkg.train"]


# --------------------------------------------------------------------------- merging


def _named_orphan(err: str, pid: int) -> bool:
    """A line of the report names ``pid`` as rank 1's orphan (alone, or among others)."""
    return any(
        line.lstrip().startswith("LEAK orphan  ") and "rank 1 " in line and str(pid) in line
        for line in err.splitlines()
    )


def _orphan(pid: int, rank: int | None) -> Finding:
    return Finding(
        rule="orphan",
        severity="leak",
        message=f"orphan PID {pid}",
        remedy="kill it",
        pid=pid,
        start_ticks=100,
        role="orphan",
        rank=rank,
    )


def test_judge_job_gives_outside_leaks_to_their_rank_and_counts_each_once() -> None:
    from leakcheck.core.model import RuleConfig
    from tests.timelines import epoch, parent, timeline

    clean = build_report(timeline([epoch(0, [parent(None)])]), RuleConfig())
    outside = build_report(timeline([epoch(0, [parent(None)])]), RuleConfig())
    outside = type(outside)(
        timeline=outside.timeline,
        findings=(_orphan(7, 1), _orphan(7, 1), _orphan(9, None)),
        config=outside.config,
    )
    entries = [
        RankReport(info=RankInfo(rank=0, world_size=3), pid=10, reports=(clean,)),
        RankReport(info=RankInfo(rank=1, world_size=3), pid=11, missing=("killed",)),
    ]
    job = judge_job(entries, [outside])
    assert [(r.rank, r.verdict, r.reported) for r in job.ranks] == [
        (0, "clean", True),
        (1, "leak", False),
    ]
    assert [f.pid for f in job.ranks[1].leaks] == [7]
    assert sorted(f.pid for f in job.leaks if f.pid is not None) == [7, 9]
    text = job.format()
    assert "no sign of rank 2" in text
    assert (
        "rank 1 (PID 11): verdict LEAK as seen from outside; 1 leak: orphan rank 1 process PID 7; "
        "its own report is missing: killed" in text
    )
    # Under leakcheck run the loaders' finding lines name the leaks: the rank's line counts them.
    assert (
        "  rank 1 (PID 11): verdict LEAK as seen from outside; 1 leak; its own report is missing: "
        "killed"
    ) in job.format_lines(named=False)
    again = RankReport.from_dict(json.loads(json.dumps(entries[0].to_dict())))
    assert again == entries[0]


MISSING_RANK = """
import json, os, sys, time, warnings
import torch.distributed as dist
import leakcheck

dist.init_process_group()  # no backend named: torch picks one, and get_backend() is no "gloo"
rank = dist.get_rank()
judged = sys.argv[1] + ".judged"
if rank == 1:
    # Never reaches gather_reports, as if it died or went elsewhere; it exits once rank 0
    # has judged without it (or after 60 s, when rank 0 would have waited for its exit).
    deadline = time.monotonic() + 60
    while not os.path.exists(judged) and time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(0)
started = time.monotonic()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    job = leakcheck.gather_reports([], timeout_s=1.0, folder=sys.argv[1])
open(judged, "w").close()
print("RESULT " + json.dumps({
    "waited_s": time.monotonic() - started,
    "ranks": [r.rank for r in job.ranks] if job is not None else None,
    "warnings": [str(w.message) for w in caught],
}))
"""


def test_a_rank_that_never_gathers_makes_rank_0_fall_back_within_the_timeout(
    workdir: Path,
) -> None:
    """NOTE [rank gathering]: rank 1 never calls gather_reports; rank 0 waits at most its
    timeout (1 s) for the count in the group's store, then judges its own report and warns,
    instead of blocking in gather_object until rank 1 exits (or the group's 30-minute
    timeout). The group is made without naming a backend, as torch's docs now show it."""
    script = workdir / "missing.py"
    script.write_text(MISSING_RANK)
    status, out, err = _run([*TORCHRUN, str(script), str(workdir / "ranks")], workdir)
    assert status == 0, err
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT ") :])
    assert result["ranks"] == [0]
    # At least its timeout, and back while rank 1 still ran (it waits for rank 0's word).
    assert 1.0 <= result["waited_s"] < 60.0, result
    assert any("1 of 2 ranks reached gather_reports" in w for w in result["warnings"]), result


@pytest.mark.parametrize("folder", ["missing", "a-file"])
def test_a_rank_folder_that_takes_no_file_is_warned_about(
    folder: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A LEAKCHECK_RANK_DIR not made yet (or a file) was passed over without a word."""
    import leakcheck

    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("LEAKCHECK_RANK_DIR", str(tmp_path / folder))
    with pytest.warns(UserWarning, match=r"^leakcheck: rank 0: report not written: "):
        job = leakcheck.gather_reports([])
    assert job is not None and [r.rank for r in job.ranks] == [0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]
