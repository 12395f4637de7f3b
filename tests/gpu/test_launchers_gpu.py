"""``leakcheck run`` under the launchers users use, on the GPU: DDP started with
``torch.multiprocessing.spawn`` (NCCL, one rank per GPU) and a transformers ``Trainer`` fit.

The programs are the CPU tests' (tests/test_launchers.py) or written as users write them; here
the ranks and the model hold real CUDA contexts. Each loader must be tracked in the process that
iterates it, labelled by the program's own line, and a clean job must say nothing but its lines.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.test_launchers import (
    EXAMPLE,
    leakcheck_run,
    leaks,
    leftovers,
    line_of,
    private_tmp,
    said,
)

pytestmark = pytest.mark.gpu

__all__ = ["leftovers", "private_tmp"]  # fixtures, used by name

HF_TRAIN = Path(__file__).with_name("hf_train.py")


def test_an_mp_spawn_ddp_rank_on_the_gpu_has_its_loader_tracked_and_its_leftovers_named(
    private_tmp: Path, leftovers: list[tuple[int, int]]
) -> None:
    label = f"examples/ddp_spawn_train.py:{line_of(EXAMPLE, 'loader = DataLoader(')}"
    clean = [sys.executable, str(EXAMPLE), "--world-size", "1", "--epochs", "2"]
    status, err, data = leakcheck_run(clean, private_tmp)
    assert status == 0, err
    assert [(ld["label"], ld["rank"]["rank"]) for ld in data["loaders"]] == [(label, 0)], err
    report = data["loaders"][0]["report"]
    assert [e["end_reason"] for e in report["epochs"]] == ["completed"] * 2
    assert said(report) == [] and data["verdict"] == "clean", err
    assert f"loader {label} (rank 0 PID {data['loaders'][0]['pid']}): 2 epochs" in err

    leaking = [*clean[:-1], "1", "--leak", "--helper-s", "60"]
    status, err, data = leakcheck_run(leaking, private_tmp, leftovers=leftovers)
    assert status == 0, err
    found = leaks(data["loaders"][0]["report"])
    assert [(f["rule"], f["rank"]) for f in found] == [("orphan", 0)] * 2, err
    grouped = "LEAK orphan  2 \N{MULTIPLICATION SIGN} rank 0 sleep 60"
    assert any(grouped in line for line in err.splitlines()), err


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="no transformers")
def test_a_transformers_trainer_fit_is_labelled_by_the_programs_line_and_clean(
    private_tmp: Path, tmp_path: Path
) -> None:
    args = [sys.executable, str(HF_TRAIN), str(tmp_path / "out")]
    status, err, data = leakcheck_run(args, private_tmp, cwd=HF_TRAIN.parent)
    assert status == 0, err
    line = f"hf_train.py:{line_of(HF_TRAIN, '# TRAIN')} via transformers Trainer"
    labels = [loader["label"] for loader in data["loaders"]]
    assert len(labels) >= 2 and all(label.startswith(line) for label in labels), err
    for loader in data["loaders"]:
        assert said(loader["report"]) == [], err  # no info lines for healthy workers
        assert loader["report"]["summary"]["processes"] >= 1 + 4
    assert data["verdict"] == "clean", err
    report_lines = [ln for ln in err.splitlines() if ln.startswith(("leakcheck run", "loader "))]
    assert len(report_lines) == 2 + len(labels), err  # the run's line, the loaders, the verdict
