"""A process of the job near its RLIMIT_NOFILE is named at the epoch end (``fd-pressure``)."""

from __future__ import annotations

import os
import resource
from typing import ClassVar

from torch.utils.data import DataLoader, Dataset

import leakcheck

_LIMIT = 256


def low_fd_limit(worker_id: int) -> None:
    """A worker whose soft descriptor limit is low (the hard one stays)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (_LIMIT, hard))


class HoldsDescriptors(Dataset[int]):
    """Opens descriptors it never closes, up to 90% of the worker's limit."""

    held: ClassVar[list[int]] = []

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        while len(os.listdir("/proc/self/fd")) < 0.9 * _LIMIT:
            HoldsDescriptors.held.append(os.open(os.devnull, os.O_RDONLY))
        return index


def test_a_worker_holding_most_of_its_descriptor_limit_is_named() -> None:
    loader = leakcheck.watch(
        DataLoader(
            HoldsDescriptors(),
            num_workers=1,
            batch_size=2,
            collate_fn=list,
            persistent_workers=True,
            worker_init_fn=low_fd_limit,
        )
    )
    for _ in loader:
        pass
    [worker] = loader.tracker.worker_keys()
    findings = [f for f in loader.report().findings if f.rule == "fd-pressure"]
    loader.close()
    assert [f.pid for f in findings] == [worker.pid]
    assert f"of its limit {_LIMIT} (9" in findings[0].message
    assert "at the end of epoch 0" in findings[0].message
    assert "ulimit -n" in findings[0].remedy and "file_system" in findings[0].remedy


def test_a_loader_far_from_its_limits_has_no_pressure() -> None:
    items: list[int] = list(range(8))
    loader = leakcheck.watch(
        DataLoader(items, num_workers=1, persistent_workers=True)  # type: ignore[arg-type]
    )
    for _ in loader:
        pass
    loader.close()
    assert not [f for f in loader.report().findings if f.rule == "fd-pressure"]


def test_the_sweep_scenario_stages_descriptor_pressure() -> None:
    from leakcheck.commands.sweep import SweepOptions, run_sweep
    from leakcheck.commands.workload import WorkloadSpec, builtin_factory

    spec = WorkloadSpec(scenario="fd-pressure", batches=4, batch_size=4, features=8)
    options = SweepOptions(workers=(2,), epochs=1, grace_s=0.3, interval_s=0.02)
    result = run_sweep(options, builtin_factory(spec), loader="built-in", gpu=(False, "no GPU"))
    findings = [f for f in result.configs[0].report.findings if f.rule == "fd-pressure"]
    assert len(findings) == 2  # each worker, against its own limit
    assert all("of its limit 256 (9" in f.message for f in findings)
