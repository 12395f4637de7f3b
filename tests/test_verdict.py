from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest

from leakcheck.core.model import (
    MIB,
    EpochRecord,
    Finding,
    ProcessEpoch,
    Role,
    RuleConfig,
    ShmFile,
    Timeline,
)
from leakcheck.judge import verdict
from leakcheck.judge.report import finding_lines
from leakcheck.observe import procs
from tests.timelines import (
    BOOT_UNIX_S,
    ROOT_PID,
    clean_timeline,
    copier,
    device,
    epoch,
    final_state,
    key,
    mib,
    parent,
    proc,
    series_timeline,
    timeline,
)

CONFIG = RuleConfig()  # 16 MiB tolerance, 1 warm-up epoch, 2 s grace


def rules_of(findings: tuple[Finding, ...]) -> list[str]:
    return [f.rule for f in findings]


def one(findings: tuple[Finding, ...]) -> Finding:
    assert len(findings) == 1, findings
    return findings[0]


# --------------------------------------------------------------------------- survivor


def survivor_timeline(**worker: object) -> Timeline:
    w = proc(1234, born=True, gpu_mib=612, fds=31, **worker)  # type: ignore[arg-type]
    return timeline([epoch(0, [parent(600), w]), epoch(1, [parent(600)])])


def test_survivor_found_after_grace() -> None:
    found = one(verdict.survivor(survivor_timeline(last_seen_after_s=3.0), CONFIG))
    assert (found.rule, found.severity, found.pid, found.role) == (
        "survivor",
        "leak",
        1234,
        "worker",
    )
    assert found.epoch == 0
    assert found.gpu_bytes == mib(612)
    assert found.nvidia_fds == 31
    assert found.start_ticks == key(1234).start_ticks
    for part in ("worker of worker_1234.py (PID 1234)", "epoch 0", "GPU0 612 MiB", "31 /dev"):
        assert part in found.message
    assert "iterator" in found.remedy


def test_a_culprits_start_is_shown_as_a_unix_time_from_the_timelines_boot_time() -> None:
    """NOTE [process identity]: the identity is the start ticks; the create time is shown."""
    tl = survivor_timeline(last_seen_after_s=3.0)
    (found,) = [f for f in verdict.judge(tl, CONFIG) if f.rule == "survivor"]
    assert found.start_ticks == key(1234).start_ticks
    assert found.create_time == BOOT_UNIX_S + key(1234).start_ticks / procs.clock_ticks()
    unknown = replace(tl, boot_unix_s=None)
    assert [f.create_time for f in verdict.judge(unknown, CONFIG) if f.pid] == [None]


@pytest.mark.parametrize("parent_is_worker", [True, False])
def test_a_surviving_child_of_a_worker_is_told_it_is_one(parent_is_worker: bool) -> None:
    """Alive under its persistent worker it is a survivor; once the worker exits, an orphan:
    its fix says both, and stops it within the epoch."""
    worker = replace(proc(2000, persistent=True), born_in_epoch=False)
    helper = proc(2001, "descendant", born=True, ppid=2000 if parent_is_worker else ROOT_PID)
    rec = epoch(0, [parent(), worker, replace(helper, last_seen_after_s=3.0)])
    final = final_state([parent(), worker, helper], after_last_epoch=[rec])
    found = one(verdict.survivor(timeline([rec], final=final), CONFIG))
    assert found.pid == 2001
    assert (found.remedy == verdict.REMEDY_WORKER_CHILD) is parent_is_worker, found.remedy


def test_survivor_seen_alive_after_grace_then_gone_is_found() -> None:
    found = one(
        verdict.survivor(survivor_timeline(last_seen_after_s=2.4, exited_after_s=2.5), CONFIG)
    )
    assert found.pid == 1234
    assert "alive 2.4 s after it ended" in found.message


def test_exit_noticed_after_grace_without_a_sighting_after_it_is_not_a_survivor() -> None:
    """Last seen alive within the grace, found gone after it: it may have exited in time."""
    tl = survivor_timeline(last_seen_after_s=1.9, exited_after_s=2.1)
    assert verdict.survivor(tl, CONFIG) == ()


def test_survivor_within_grace_not_found() -> None:
    tl = survivor_timeline(last_seen_after_s=1.0, exited_after_s=1.2)
    assert verdict.survivor(tl, CONFIG) == ()


def test_worker_gone_before_epoch_end_not_a_survivor() -> None:
    tl = survivor_timeline(alive=False, exited_after_s=None)
    assert verdict.survivor(tl, CONFIG) == ()


def test_persistent_worker_alive_across_epochs_not_a_survivor() -> None:
    epochs = [
        epoch(
            i,
            [
                parent(600),
                proc(2000, born=i == 0, persistent=True, gpu_mib=300, last_seen_after_s=5.0),
            ],
        )
        for i in range(4)
    ]
    assert verdict.survivor(timeline(epochs), CONFIG) == ()


def test_parent_never_a_survivor() -> None:
    p = proc(ROOT_PID, "parent", born=True, last_seen_after_s=9.0)
    assert verdict.survivor(timeline([epoch(0, [p])]), CONFIG) == ()


def test_survivor_seen_alive_in_a_later_epoch_reported_once_in_birth_epoch() -> None:
    w0 = proc(1234, born=True, gpu_mib=500)  # no after-end observation in its own epoch
    w_later = proc(1234, born=False, gpu_mib=500, last_seen_after_s=0.1)
    epochs = [
        epoch(0, [parent(), w0]),
        epoch(1, [parent(), w_later]),
        epoch(2, [parent(), w_later]),
    ]
    found = one(verdict.survivor(timeline(epochs), CONFIG))
    assert (found.pid, found.epoch) == (1234, 0)
    assert "alive 2.1 s" in found.message


def test_a_helper_found_epochs_late_is_judged_from_the_epoch_it_was_born_in() -> None:
    """Placed in epoch 3 where a scan found it; its create time says epoch 1."""
    late = replace(proc(1234, "descendant", born=True, last_seen_after_s=0.1), born_epoch=1)
    epochs = [epoch(i, [parent()] + ([late] if i == 3 else [])) for i in range(4)]
    found = one(verdict.survivor(timeline(epochs), CONFIG))
    assert found.epoch == 1
    assert "started in epoch 1, alive 2.1 s after it ended" in found.message
    assert verdict.epoch_counts(timeline(epochs), CONFIG.grace_s)[1].alive_after == 1


def test_with_no_grace_a_survivor_is_one_seen_alive_after_its_epoch_ended() -> None:
    """The end's own sample, taken just before the end is stamped, is not "after" it."""
    no_grace = replace(CONFIG, grace_s=0.0)
    at_end = proc(1234, born=True, last_seen_after_s=-0.005)
    epochs = [epoch(0, [parent(), at_end])]
    assert verdict.survivor(timeline(epochs), no_grace) == ()
    assert verdict.epoch_counts(timeline(epochs), 0.0)[0].alive_after == 0
    final = final_state([parent(), proc(1234)], after_last_epoch=epochs, wait_s=0.01)
    found = one(verdict.survivor(timeline(epochs, final=final), no_grace))
    assert "alive 0.0 s after it ended" in found.message


def test_survivor_seen_in_final_state() -> None:
    epochs = [epoch(0, [parent(), proc(1234, born=True, last_seen_after_s=0.5)])]
    final = final_state([parent(), proc(1234)], after_last_epoch=epochs, wait_s=2.5)
    found = one(verdict.survivor(timeline(epochs, final=final), CONFIG))
    assert found.pid == 1234


def test_descendant_survivor_has_its_own_remedy() -> None:
    d = proc(1300, "descendant", born=True, last_seen_after_s=3.0)
    found = one(verdict.survivor(timeline([epoch(0, [parent(), d])]), CONFIG))
    assert found.role == "descendant"
    assert "join or terminate" in found.remedy


# --------------------------------------------------------------------------- orphan


def test_with_no_grace_an_orphan_is_judged_once_seen_after_the_end_that_first_listed_it() -> None:
    """As for survivors: strictly past the grace; a look at the end itself is not after it."""
    no_grace = replace(CONFIG, grace_s=0.0)
    orphaned = proc(4321, "orphan", last_seen_after_s=0.0)
    epochs = [epoch(0, [parent()]), epoch(1, [parent(), orphaned])]
    assert verdict.orphan(timeline(epochs), no_grace) == ()
    final = final_state([parent(), proc(4321, "orphan")], after_last_epoch=epochs, wait_s=0.01)
    assert one(verdict.orphan(timeline(epochs, final=final), no_grace)).pid == 4321


def test_a_runtime_helper_orphaned_is_judged_only_once_seen_more_than_the_grace_after() -> None:
    """A forkserver reparented away exits with its owner, or stays for ever: an orphan only
    when seen alive more than the grace after the end that first listed it."""
    forkserver = "python -c from multiprocessing.forkserver import main; main(3, 4)"

    def helper(after_s: float) -> ProcessEpoch:
        orphaned = proc(4321, "orphan", last_seen_after_s=after_s, cmdline=forkserver)
        return replace(orphaned, persistent=True)

    def listed(after_s: float) -> list[EpochRecord]:
        return [epoch(0, [parent()]), epoch(1, [parent(), helper(0.0)]),
                epoch(2, [parent(), helper(after_s)])]  # fmt: skip

    assert verdict.orphan(timeline(listed(CONFIG.grace_s)), CONFIG) == ()
    assert one(verdict.orphan(timeline(listed(CONFIG.grace_s + 0.1)), CONFIG)).pid == 4321


def test_orphan_found_with_max_bytes_and_fds() -> None:
    epochs = [
        epoch(0, [parent(), proc(4321, "descendant", born=True, gpu_mib=200, fds=10)]),
        epoch(1, [parent(), proc(4321, "orphan", gpu_mib=600, fds=31)]),
        epoch(2, [parent(), proc(4321, "orphan", gpu_mib=550, fds=31)]),
    ]
    final = final_state([parent(), proc(4321, "orphan", gpu_mib=550)], after_last_epoch=epochs)
    found = one(verdict.orphan(timeline(epochs, final=final), CONFIG))
    assert (found.rule, found.severity, found.pid, found.role) == ("orphan", "leak", 4321, "orphan")
    assert found.gpu_bytes == mib(600)
    assert found.nvidia_fds == 31
    assert found.epoch == 1
    # Born in epoch 0 under the job, outside its tree at epoch 1's end.
    assert found.message.startswith(
        "orphan_4321.py --flag (PID 4321) started in epoch 0, outlived its parent since epoch 1"
    )
    assert "GPU0 600 MiB" in found.message
    assert "alive after the job" in found.message
    assert "terminate_children=True" in found.remedy
    assert "worker_init_fn" in found.remedy


@pytest.mark.parametrize(
    ("inside_first", "born_epoch", "words"),
    [
        (True, None, "since epoch 2"),  # in the tree at epoch 1's end, outside at 2's
        (False, 2, "since epoch 2"),  # born in the epoch it was found in
        (False, 0, "since epoch 0"),  # born in epoch 0, outside the tree at its end already
        (False, None, "by epoch 2"),  # birth unknown: only that it had left by then
    ],
)
def test_orphan_says_the_epoch_it_left_the_tree_in(
    inside_first: bool, born_epoch: int | None, words: str
) -> None:
    first = [proc(4321, "descendant", born=True)] if inside_first else []
    found_as = replace(proc(4321, "orphan"), born_epoch=born_epoch)
    epochs = [
        epoch(0, [parent()]),
        epoch(1, [parent(), *first]),
        epoch(2, [parent(), found_as]),
        epoch(3, [parent(), found_as]),
    ]
    final = final_state([parent(), found_as], after_last_epoch=epochs)
    found = one(verdict.orphan(timeline(epochs, final=final), CONFIG))
    assert f"outlived its parent {words}, alive after the job" in found.message, found.message


@pytest.mark.parametrize(("seen_inside", "orphans"), [(False, [1, 1, 1]), (True, [0, 1, 1])])
def test_epoch_counts_place_a_late_found_orphan_in_the_epochs_it_outlived(
    seen_inside: bool, orphans: list[int]
) -> None:
    """Found by a scan in epoch 2 but started in epoch 0 and alive since: alive at each end
    in between, and outside the tree wherever the end's full walk did not list it."""
    found_as = replace(proc(4321, "orphan"), born_epoch=0)
    inside = [replace(proc(4321, "descendant", born=True), born_epoch=0)] if seen_inside else []
    epochs = [
        epoch(0, [parent(), *inside]),
        epoch(1, [parent()]),
        epoch(2, [parent(), found_as]),
    ]
    final = final_state([parent(), found_as], after_last_epoch=epochs)
    counts = verdict.epoch_counts(timeline(epochs, final=final), CONFIG.grace_s)
    assert [counts[i].orphans for i in range(3)] == orphans
    assert [counts[i].alive_after for i in range(3)] == [1, 0, 0]


def _counts(epochs: list[EpochRecord], final: Any = None) -> list[tuple[int, int]]:
    found = verdict.epoch_counts(timeline(epochs, final=final), CONFIG.grace_s)
    return [(found[rec.index].alive_after, found[rec.index].orphans) for rec in epochs]


def test_epoch_counts_stop_where_an_orphan_was_last_alive() -> None:
    """Listed alive at the ends of epochs 1 and 2 (last seen just before end 2's stamp),
    gone by end 3: an orphan at ends 1 and 2 only, never past its last sighting."""
    alive = replace(proc(4321, "orphan", last_seen_after_s=-0.003), born_epoch=1)
    epochs = [
        epoch(0, [parent()]),
        epoch(1, [parent(), alive]),
        epoch(2, [parent(), alive]),
        epoch(3, [parent(), replace(alive, alive_at_end=False, exited_after_s=-0.5)]),
    ]
    assert [o for _, o in _counts(epochs)] == [0, 1, 1, 0]


def test_epoch_counts_leave_out_persistent_processes_and_daemon_helpers() -> None:
    worker = replace(proc(2000, persistent=True), born_epoch=0)
    daemon = replace(
        proc(2001, "orphan", persistent=True, cmdline="/usr/lib/torch/bin/torch_shm_manager"),
        born_epoch=0,
    )
    epochs = [epoch(i, [parent(), worker, daemon]) for i in range(3)]
    final = final_state([parent(), worker, daemon], after_last_epoch=epochs)
    assert _counts(epochs, final) == [(0, 0)] * 3


def test_epoch_counts_count_what_outlived_the_job_and_births_before_a_window() -> None:
    """A helper alive only in the closed final state outlived the job: alive after its
    epoch; an orphan born before the epochs at hand counts from the first end listing it."""
    late = replace(proc(4400, "descendant", born=True, last_seen_after_s=0.1), born_epoch=1)
    old = replace(proc(4500, "orphan"), born_epoch=-5)
    epochs = [epoch(0, [parent(), old]), epoch(1, [parent(), late, old])]
    final = final_state([parent(), late, old], after_last_epoch=epochs, wait_s=0.5)
    assert _counts(epochs, final) == [(0, 1), (1, 1)]


def test_orphan_gone_before_epoch_end_not_found() -> None:
    epochs = [epoch(0, [parent(), proc(4321, "orphan", alive=False, gpu_mib=600)])]
    assert verdict.orphan(timeline(epochs), CONFIG) == ()


def test_orphan_only_in_final_state() -> None:
    epochs = [epoch(0, [parent()])]
    final = final_state([parent(), proc(4321, "orphan", gpu_mib=600)], after_last_epoch=epochs)
    found = one(verdict.orphan(timeline(epochs, final=final), CONFIG))
    assert found.epoch is None
    assert found.gpu_bytes == mib(600)


def test_judge_reports_an_orphaned_survivor_once_as_orphan() -> None:
    epochs = [
        epoch(0, [parent(), proc(4321, "descendant", born=True, gpu_mib=600, last_seen_after_s=4)])
    ]
    final = final_state([parent(), proc(4321, "orphan", gpu_mib=600)], after_last_epoch=epochs)
    tl = timeline(epochs, final=final)
    assert rules_of(verdict.survivor(tl, CONFIG)) == ["survivor"]
    leaks = [f for f in verdict.judge(tl, CONFIG) if f.severity == "leak"]
    assert rules_of(tuple(leaks)) == ["orphan"]


# --------------------------------------------------------------------------- growth


def test_slow_steady_leak_found() -> None:
    series = [100 + i for i in range(60)]  # 1 MiB/epoch, well under the 16 MiB tolerance each
    found = one(verdict.growth(series_timeline(series), CONFIG))
    assert (found.rule, found.severity, found.pid, found.role) == (
        "growth",
        "leak",
        ROOT_PID,
        "parent",
    )
    assert found.bytes_per_epoch == pytest.approx(MIB)
    assert found.gpu_bytes == mib(58)  # epochs 1..59 after one warm-up epoch
    assert found.epoch == 59
    assert "1.0 MiB/epoch" in found.message
    assert "101 -> 159 MiB on GPU0" in found.message


def test_stair_step_leak_found() -> None:
    series = [100 + 20 * (i // 20) for i in range(60)]  # allocator grabs 20 MiB every 20 epochs
    found = one(verdict.growth(series_timeline(series), CONFIG))
    assert found.gpu_bytes == mib(40)
    assert found.bytes_per_epoch is not None and found.bytes_per_epoch > 0


def test_rise_then_plateau_not_found() -> None:
    series = [100, 200, 300, 400, 450, 480, 490] + [490] * 10  # allocator warm-up, then flat
    assert verdict.growth(series_timeline(series), CONFIG) == ()


def test_plateau_with_small_noise_not_found() -> None:
    series = [100, 300, 500, 600, 600, 601, 600, 602, 601, 600, 603]
    assert verdict.growth(series_timeline(series), CONFIG) == ()


@pytest.mark.parametrize("seed", range(20))
def test_jitter_around_flat_line_not_found(seed: int) -> None:
    rng = random.Random(seed)
    half = CONFIG.tolerance_bytes / 2 / MIB
    series = [500 + rng.uniform(-half, half) for _ in range(40)]
    assert verdict.growth(series_timeline(series), CONFIG) == ()


def test_alternating_jitter_at_full_amplitude_not_found() -> None:
    half = CONFIG.tolerance_bytes / 2 / MIB
    series = [500 + (half if i % 2 else -half) for i in range(30)]
    assert verdict.growth(series_timeline(series), CONFIG) == ()


def test_persistent_worker_growth_found_with_worker_remedy() -> None:
    series = [600 + 256 * i for i in range(5)]
    found = one(verdict.growth(series_timeline(series, role="worker", pid=2000), CONFIG))
    assert (found.pid, found.role) == (2000, "worker")
    assert found.bytes_per_epoch == pytest.approx(256 * MIB)
    assert "256 MiB/epoch" in found.message
    assert "CPU" in found.remedy


def test_growth_drops_warmup_epochs() -> None:
    series = [0, 100, 200]
    assert verdict.growth(series_timeline(series), CONFIG) == ()  # 2 points after warm-up
    found = one(verdict.growth(series_timeline(series), RuleConfig(warmup_epochs=0)))
    assert found.bytes_per_epoch == pytest.approx(100 * MIB)


def test_growth_ignores_non_persistent_processes() -> None:
    epochs = [epoch(i, [proc(3000, gpu_mib=100 * i)]) for i in range(6)]
    assert verdict.growth(timeline(epochs), CONFIG) == ()


def test_growth_slope_helper() -> None:
    tol = CONFIG.tolerance_bytes

    def slope(series: list[int]) -> float | None:
        return verdict.growth_slope(list(enumerate(series)), tol)

    assert slope([0, 10 * tol]) is None  # too few points
    assert slope([0, tol // 2, tol]) is None  # rise == tolerance
    assert slope([0, 2 * tol, 2 * tol, 2 * tol, 2 * tol]) is None
    assert slope([0, tol, 2 * tol]) == pytest.approx(tol)
    assert slope([2 * tol, tol, 0]) is None  # shrinking


def test_growth_on_device_totals_when_blind() -> None:
    # In a foreign PID namespace NVML's PIDs match nothing: per-process bytes are all 0.
    epochs = [
        epoch(i, [proc(ROOT_PID, "parent", persistent=True)], [device(0, 1000 + 64 * i)])
        for i in range(6)
    ]
    tl = timeline(epochs, attribution="blind-namespace")
    found = one(verdict.growth(tl, CONFIG))
    assert found.pid is None
    assert found.device_index == 0
    assert found.bytes_per_epoch == pytest.approx(64 * MIB)
    assert "GPU0" in found.message


# --------------------------------------------------------------------------- residual


def residual_timeline(
    final_used_mib: float, final_procs: list[ProcessEpoch], **kwargs: object
) -> Timeline:
    epochs = [epoch(0, [parent(600)], [device(0, 650)])]
    final = final_state(final_procs, [device(0, final_used_mib)], after_last_epoch=epochs)
    return timeline(epochs, final=final, baseline=[device(0, 50)], **kwargs)  # type: ignore[arg-type]


def test_residual_found_and_foreign_process_named() -> None:
    foreign = proc(999, "foreign", gpu_mib=700, cmdline="python other_job.py")
    tl = residual_timeline(1350, [parent(600), foreign])
    found = one(verdict.residual(tl, CONFIG))
    assert (found.rule, found.severity, found.device_index) == ("residual", "leak", 0)
    assert found.gpu_bytes == mib(700)
    assert found.pid == 999
    assert found.role == "foreign"
    assert "foreign other_job.py (PID 999)" in found.message
    assert "700 MiB" in found.message
    assert "GPU0" in found.message


def test_residual_names_two_foreign_holders_and_counts_the_rest() -> None:
    holders = [proc(900 + i, "foreign", gpu_mib=200, cmdline=f"job{i}") for i in range(3)]
    unknown = proc(999, "foreign", unknown=True, cmdline="mig_job")
    tl = residual_timeline(1350, [parent(600), unknown, *holders])
    found = one(verdict.residual(tl, CONFIG))
    assert (
        "; held by foreign mig_job (PID 999) ? MiB, foreign job0 (PID 900) 200 MiB and 2 more"
        in found.message
    ), found.message
    assert found.pid is None  # several holders: none is the culprit


def test_residual_explained_by_the_job_not_found() -> None:
    tl = residual_timeline(660, [parent(600)])  # 10 MiB unexplained: under the tolerance
    assert verdict.residual(tl, CONFIG) == ()


def test_residual_memory_of_an_orphan_is_explained() -> None:
    tl = residual_timeline(1250, [parent(600), proc(4321, "orphan", gpu_mib=600)])
    assert verdict.residual(tl, CONFIG) == ()
    assert rules_of(verdict.judge(tl, CONFIG))[0] == "orphan"


def test_residual_subtracts_the_roots_own_baseline() -> None:
    # The root already held 600 MiB when tracking started; it still does.
    epochs = [epoch(0, [parent(600)], [device(0, 650)])]
    final = final_state([parent(600)], [device(0, 650)], after_last_epoch=epochs)
    tl = timeline(epochs, final=final, baseline=[device(0, 650)], baseline_gpu_mib={0: 600})
    assert verdict.residual(tl, CONFIG) == ()


def test_residual_roots_baseline_does_not_explain_new_memory() -> None:
    # The root's 600 MiB were there before tracking: they cannot explain 300 new MiB.
    epochs = [epoch(0, [parent(600)], [device(0, 650)])]
    foreign = proc(999, "foreign", gpu_mib=300)
    final = final_state([parent(600), foreign], [device(0, 950)], after_last_epoch=epochs)
    tl = timeline(epochs, final=final, baseline=[device(0, 650)], baseline_gpu_mib={0: 600})
    found = one(verdict.residual(tl, CONFIG))
    assert found.gpu_bytes == mib(300)


def test_residual_with_no_visible_holder() -> None:
    found = one(verdict.residual(residual_timeline(1000, [parent(600)]), CONFIG))
    assert found.gpu_bytes == mib(350)
    assert found.pid is None
    assert "no visible process" in found.message


def test_residual_when_blind_judges_device_totals() -> None:
    tl = residual_timeline(700, [parent(None)], attribution="blind-namespace")
    found = one(verdict.residual(tl, CONFIG))
    assert found.severity == "leak"
    assert "PID namespace" in found.message


def test_residual_with_unknown_process_bytes_is_only_advice() -> None:
    p = proc(ROOT_PID, "parent", persistent=True, unknown=True)
    found = one(verdict.residual(residual_timeline(700, [p]), CONFIG))
    assert found.severity == "info"
    assert "unknown" in found.message


def test_residual_needs_a_final_state() -> None:
    tl = timeline([epoch(0, [parent(600)], [device(0, 9000)])])
    assert verdict.residual(tl, CONFIG) == ()


# --------------------------------------------------------------------------- blind


def test_blind_finding_and_never_clean() -> None:
    tl = timeline([epoch(0, [parent(None)])], attribution="blind-namespace", reason="pid ns 4026")
    found = one(verdict.blind(tl, CONFIG))
    assert (found.rule, found.severity) == ("blind", "info")
    assert "another PID namespace" in found.message
    assert "pid ns 4026" in found.message
    assert "--pid=host" in found.remedy
    assert verdict.blind(clean_timeline(), CONFIG) == ()


# --------------------------------------------------------------------------- descriptor-holder


def test_descriptor_holder_found_once_per_identity() -> None:
    holder = proc(1500, "descendant", gpu_mib=0, fds=31, persistent=True)
    epochs = [epoch(i, [parent(600), holder]) for i in range(3)]
    found = one(verdict.descriptor_holder(timeline(epochs), CONFIG))
    assert (found.rule, found.severity, found.pid, found.nvidia_fds) == (
        "descriptor-holder",
        "info",
        1500,
        31,
    )
    assert found.epoch == 0
    assert "/dev/nvidia* fds but no GPU memory at the end of epoch 0" in found.message
    assert "spawn" in found.remedy


def test_healthy_fork_workers_are_no_descriptor_holders_until_they_outlive_the_work() -> None:
    """Persistent workers forked from a CUDA parent hold its descriptors while they work: said
    only of those still alive once tracking closed, one line for all of them."""
    workers = [
        proc(pid, gpu_mib=0, fds=31 + pid % 2, persistent=True, cmdline="python train.py")
        for pid in (1500, 1501)
    ]
    epochs = [epoch(i, [parent(600), *workers]) for i in range(3)]
    assert verdict.descriptor_holder(timeline(epochs), CONFIG) == ()
    final = final_state([parent(600), *workers], after_last_epoch=epochs)
    found = verdict.descriptor_holder(timeline(epochs, final=final), CONFIG)
    assert [(f.pid, f.epoch) for f in found] == [(1500, None), (1501, None)]
    lines = finding_lines(found)
    assert len(lines) == 2, lines
    assert lines[0].startswith(
        "info descriptor-holder  2 \u00d7 worker of train.py (PIDs 1500, 1501) holds /dev/nvidia*"
    )


@pytest.mark.parametrize(
    "worker",
    [
        proc(1500, gpu_mib=500, fds=31),  # has its own context: fds are its own
        proc(1500, gpu_mib=0, fds=31, alive=False),  # gone
        proc(1500, gpu_mib=0, fds=0),  # no descriptors
        proc(1500, gpu_mib=None, fds=31, unknown=True),  # bytes unknown: cannot tell
    ],
)
def test_descriptor_holder_near_misses(worker: object) -> None:
    tl = timeline([epoch(0, [parent(600), worker])])  # type: ignore[list-item]
    assert verdict.descriptor_holder(tl, CONFIG) == ()


# --------------------------------------------------------------------------- context-kept


def context_timeline(allocated: int | None, parent_mib: float = 612) -> Timeline:
    epochs = [epoch(0, [parent(600)])]
    final = final_state(
        [parent(parent_mib)],
        [device(0, 662)],
        after_last_epoch=epochs,
        parent_allocated_gpu_bytes=allocated,
    )
    return timeline(epochs, final=final, baseline=[device(0, 50)])


def test_context_kept_found() -> None:
    found = one(verdict.context_kept(context_timeline(0), CONFIG))
    assert (found.rule, found.severity, found.pid) == ("context-kept", "info", ROOT_PID)
    assert found.gpu_bytes == mib(612)
    assert "612 MiB" in found.message
    assert "release_device" in found.remedy


@pytest.mark.parametrize(("allocated", "parent_mib"), [(None, 612), (mib(100), 612), (0, 0)])
def test_context_kept_near_misses(allocated: int | None, parent_mib: float) -> None:
    assert verdict.context_kept(context_timeline(allocated, parent_mib), CONFIG) == ()


# --------------------------------------------------------------------------- high-clocks


def clocks_timeline(sm_mhz: int | None, sm_max_mhz: int | None, parent_mib: float) -> Timeline:
    epochs = [epoch(0, [parent(600)])]
    dev = device(0, 50 + parent_mib, sm_mhz=sm_mhz, sm_max_mhz=sm_max_mhz, temp_c=64, power_w=120)
    final = final_state([parent(parent_mib)], [dev], after_last_epoch=epochs)
    return timeline(epochs, final=final, baseline=[device(0, 50)])


def test_high_clocks_found() -> None:
    found = one(verdict.high_clocks(clocks_timeline(1980, 1980, 0), CONFIG))
    assert (found.rule, found.severity, found.device_index) == ("high-clocks", "info", 0)
    assert "GPU0 SM clock stays at 1980 of 1980 MHz after work ended" in found.message
    assert "--cooldown-temp" in found.remedy


@pytest.mark.parametrize(
    ("sm_mhz", "sm_max_mhz", "parent_mib"),
    [(1980, 1980, 600), (345, 1980, 0), (1980, None, 0), (None, 1980, 0)],
)
def test_high_clocks_near_misses(
    sm_mhz: int | None, sm_max_mhz: int | None, parent_mib: float
) -> None:
    assert verdict.high_clocks(clocks_timeline(sm_mhz, sm_max_mhz, parent_mib), CONFIG) == ()


# --------------------------------------------------------------------------- failures


def test_tracker_failures_reported_one_each() -> None:
    tl = timeline(
        [epoch(0, [parent()])], failures=["NVMLError: Unknown", "psutil: AccessDenied\n(pid 7)"]
    )
    found = verdict.tracker_failure(tl, CONFIG)
    assert rules_of(found) == ["tracker-failure", "tracker-failure"]
    assert "NVMLError: Unknown" in found[0].message
    assert all(f.severity == "info" for f in found)


# --------------------------------------------------------------------------- judge


def leaky_timeline(attribution: str = "ok") -> Timeline:
    """A survivor, a growing parent, unexplained device memory and high clocks."""
    epochs = [
        epoch(
            i,
            [parent(600 + 64 * i), proc(1234 + i, born=True, gpu_mib=500, last_seen_after_s=3.0)],
            [device(0, 2000)],
        )
        for i in range(5)
    ]
    final = final_state(
        [parent(0)],  # the parent released its context; something else holds the device
        [device(0, 5000, sm_mhz=1980, sm_max_mhz=1980)],
        after_last_epoch=epochs,
    )
    return timeline(
        epochs,
        final=final,
        attribution=attribution,  # type: ignore[arg-type]
        failures=["sampler hiccup"],
    )


def test_clean_timeline_has_no_findings() -> None:
    assert verdict.judge(clean_timeline(), CONFIG) == ()


def test_judge_orders_leaks_first_then_epoch_then_pid() -> None:
    findings = verdict.judge(leaky_timeline(), CONFIG)
    severities = [f.severity for f in findings]
    assert severities == sorted(severities, key=lambda s: s != "leak")
    assert {"survivor", "growth", "residual", "high-clocks", "tracker-failure"} <= set(
        rules_of(findings)
    )
    survivors = [f for f in findings if f.rule == "survivor"]
    assert [f.epoch for f in survivors] == [0, 1, 2, 3, 4]
    leaks = [f for f in findings if f.severity == "leak"]
    epochs = [f.epoch if f.epoch is not None else 10**9 for f in leaks]
    assert epochs == sorted(epochs)


def test_every_finding_is_one_line() -> None:
    findings = verdict.judge(leaky_timeline(), CONFIG)
    assert findings
    for f in findings:
        assert f.message and "\n" not in f.message
        assert f.remedy and "\n" not in f.remedy


def test_nvml_unavailable_skips_gpu_rules_but_survivor_still_works() -> None:
    for attribution in ("nvml-unavailable", "no-gpu"):
        findings = verdict.judge(leaky_timeline(attribution), CONFIG)
        assert set(rules_of(findings)) == {"survivor", "tracker-failure"}
        survivor = findings[0]
        assert survivor.gpu_bytes is None
        assert "MiB" not in survivor.message


def test_rules_registry_names_every_rule() -> None:
    assert set(verdict.RULES) == {
        "shm",
        "survivor",
        "orphan",
        "growth",
        "residual",
        "blind",
        "descriptor-holder",
        "context-kept",
        "high-clocks",
        "tracker-failure",
        "host-growth",
        "device-mismatch",
        "copy-on-read",
        "died",
        "fd-pressure",
        "hang",
        "pinned-growth",
        "shutdown-hang",
    }


# --------------------------------------------------------------------------- host growth


def host_timeline(
    series: Sequence[tuple[float | None, float | None]], *, role: Role = "worker", pid: int = 2001
) -> Timeline:
    """One persistent process whose (USS, RSS) MiB at each epoch end follow ``series``."""
    epochs = []
    for i, (uss, rss) in enumerate(series):
        processes = [proc(pid, role, persistent=True, uss_mib=uss, rss_mib=rss)]
        if role != "parent":
            processes.insert(0, parent())
        epochs.append(epoch(i, processes))
    return timeline(epochs, attribution="nvml-unavailable")


def host_findings(tl: Timeline, **config: Any) -> list[Finding]:
    return [f for f in verdict.judge(tl, RuleConfig(**config)) if f.rule == "host-growth"]


def test_copy_on_read_worker_is_found_per_worker_with_mib_per_epoch() -> None:
    # USS climbs 28 MiB an epoch while RSS, which counted the shared pages all along, is flat.
    series = [(38 + 28 * i, 374) for i in range(5)]
    tl = timeline(
        [
            epoch(
                i,
                [
                    parent(uss_mib=40, rss_mib=431),
                    proc(2001, persistent=True, uss_mib=uss, rss_mib=rss),
                    proc(2002, persistent=True, uss_mib=uss + 1, rss_mib=rss),
                ],
            )
            for i, (uss, rss) in enumerate(series)
        ],
        attribution="nvml-unavailable",
    )
    found = host_findings(tl)
    assert [f.pid for f in found] == [2001, 2002]
    first = found[0]
    assert first.severity == "leak" and first.role == "worker"
    assert first.bytes_per_epoch == pytest.approx(mib(28))
    assert first.host_bytes == mib(28 * 3)
    assert "host memory (USS) grows 28 MiB/epoch over epochs 1-4: 66 -> 150 MiB" in (first.message)
    assert "copy-on-read" in first.remedy and "numpy" in first.remedy
    assert "num_workers" not in first.message
    assert verdict_of(tl) == "leak"


def test_a_worker_whose_resident_memory_grows_too_is_told_to_bound_what_it_keeps() -> None:
    # A dataset that appends 50 MiB an epoch to a list in each persistent worker: new memory,
    # resident too, not the parent's pages turned private.
    for uss_read in (True, False):
        tl = host_timeline(
            [(100 + 50 * i if uss_read else None, 300 + 50 * i) for i in range(5)], role="worker"
        )
        (found,) = host_findings(tl)
        assert "bound what the worker keeps across epochs" in found.remedy, found.message
        assert "copy-on-read" not in found.remedy


def verdict_of(tl: Timeline) -> str:
    from leakcheck.judge.report import build_report

    return build_report(tl, RuleConfig()).verdict


def test_parent_uss_returning_after_fork_is_not_growth() -> None:
    # The parent's USS fell when its workers forked and climbs back as they copy the pages
    # they read (linearly here, so the late-rise test alone would not save it); its RSS is
    # flat: no new memory.
    tl = host_timeline([(38 + 28 * i, 431) for i in range(6)], role="parent", pid=ROOT_PID)
    assert host_findings(tl) == []


def test_parent_that_really_grows_is_found_with_its_rss() -> None:
    tl = host_timeline(
        [(100 + 40 * i, 400 + 30 * i) for i in range(6)], role="parent", pid=ROOT_PID
    )
    (found,) = host_findings(tl)
    assert found.role == "parent" and found.pid == ROOT_PID
    # The smaller of the two slopes: the RSS one is the new memory.
    assert found.bytes_per_epoch == pytest.approx(mib(30))
    assert "(RSS 430 -> 550 MiB)" in found.message
    assert "what the loop keeps" in found.remedy


def test_growth_after_the_paced_uss_reads_is_judged_on_rssanon_at_every_end() -> None:
    # The first three judged ends read USS (NOTE [host pacing]), 63 MiB apart: within the
    # tolerance. RssAnon, read at every end, grows 32 MiB/epoch to the last (a parent keeping
    # 32 MiB an epoch; found or not by a 1 MiB difference in USS).
    def kept(role: Role, uss_ends: int, uss_mib_per_epoch: float = 31.5) -> Timeline:
        epochs = []
        for i in range(7):
            uss = 183 + uss_mib_per_epoch * i if i <= uss_ends else None
            kept = proc(2001, role, persistent=True, uss_mib=uss, rss_mib=262 + 32 * i,
                        anon_mib=181 + 32 * i)  # fmt: skip
            epochs.append(epoch(i, [kept] if role == "parent" else [parent(), kept]))
        return timeline(epochs, attribution="nvml-unavailable")

    cases: list[tuple[Role, str]] = [("parent", "drop what the loop"), ("worker", "bound what")]
    for role, fix in cases:
        (found,) = host_findings(kept(role, uss_ends=3))
        assert "host memory (RssAnon) grows 32 MiB/epoch over epochs 1-6" in found.message
        assert "(USS read at 3 of these ends)" in found.message
        assert found.remedy.startswith(fix)  # not copy-on-read: resident memory grew
    # USS read at every end says what the process itself holds: flat, no growth.
    assert host_findings(kept("worker", uss_ends=6, uss_mib_per_epoch=0)) == []


def test_a_parents_uss_rise_without_any_resident_reading_is_not_growth() -> None:
    # NOTE [return of shared pages]: a parent's USS rise needs a resident rise; none was read.
    series = [(100 + 50 * i, None) for i in range(5)]
    assert host_findings(host_timeline(series, role="parent")) == []


def test_paced_uss_reads_give_a_slope_per_epoch_not_per_read() -> None:
    # USS read at epoch ends 0, 3, 6, 9 only (the others paced out: RSS); 10 MiB/epoch.
    series = [(100 + 10 * i if i % 3 == 0 else None, 300) for i in range(10)]
    (found,) = host_findings(host_timeline(series), warmup_epochs=0)
    assert found.bytes_per_epoch == pytest.approx(mib(10))
    assert "over epochs 0-9" in found.message


def test_without_uss_growth_is_judged_on_rss_and_says_so() -> None:
    (found,) = host_findings(host_timeline([(None, 200 + 50 * i) for i in range(5)]))
    assert "host memory (RSS) grows 50 MiB/epoch" in found.message
    assert "(USS read at 0 of these ends)" in found.message


def test_rss_is_used_when_uss_was_read_too_rarely() -> None:
    series = [(100.0 if i == 1 else None, 200 + 50 * i) for i in range(5)]
    (found,) = host_findings(host_timeline(series))
    assert "(RSS)" in found.message and "USS read at 1 of these ends" in found.message


@pytest.mark.parametrize(
    "series",
    [
        [(100 + 60 * min(i, 1), 300) for i in range(6)],  # warm-up, then flat
        [(100 + (5 if i % 2 else 0), 300) for i in range(8)],  # jitter
        [(100 + 15 * i, 300) for i in range(5)],  # 45 MiB over epochs 1-4: under 64 MiB
        [(100 + 80 * min(i, 2), 300) for i in range(8)],  # rise, then plateau
    ],
)
def test_host_noise_warmup_and_plateaus_are_not_growth(
    series: list[tuple[float, float]],
) -> None:
    assert host_findings(host_timeline(series)) == []


def test_host_tolerance_is_its_own() -> None:
    series = [(100 + 20 * i, 300) for i in range(5)]  # 60 MiB over epochs 1-4
    assert host_findings(host_timeline(series)) == []  # default 64 MiB
    assert len(host_findings(host_timeline(series), host_tolerance_bytes=mib(32))) == 1
    # The GPU tolerance does not move it.
    assert host_findings(host_timeline(series), tolerance_bytes=mib(1)) == []


def test_host_growth_ignores_workers_that_live_one_epoch() -> None:
    epochs = [
        epoch(i, [parent(uss_mib=50, rss_mib=300), proc(3000 + i, born=True, uss_mib=100 + 50 * i)])
        for i in range(6)
    ]
    assert host_findings(timeline(epochs)) == []


# --------------------------------------------------------------------------- shm


def shm_of(tl: Timeline, **config: Any) -> list[Finding]:
    return [f for f in verdict.judge(tl, RuleConfig(**config)) if f.rule == "shm"]


def test_shm_file_causes_and_remedies() -> None:
    files = (
        ShmFile("cuda.shm.3e9.52f2.1", 80 * 1024),
        ShmFile("torch_1234_5678_0", 4 * MIB),
        ShmFile("psm_1a2b3c", 1000),
        ShmFile("nccl-abc", 1000),
        ShmFile("mine", 10, holder_pid=ROOT_PID, holder_role="parent"),
    )
    found = shm_of(replace(timeline([]), shm_files=files))
    by_name = {f.shm_name: f for f in found}
    assert "CUDA IPC: workers returned CUDA tensors" in by_name["cuda.shm.3e9.52f2.1"].message
    assert "return CPU tensors" in by_name["cuda.shm.3e9.52f2.1"].remedy
    assert "(80 KiB)" in by_name["cuda.shm.3e9.52f2.1"].message
    assert "torch shared tensor" in by_name["torch_1234_5678_0"].message
    assert "SharedMemory" in by_name["psm_1a2b3c"].message
    assert "unlink()" in by_name["psm_1a2b3c"].remedy
    assert "destroy_process_group" in by_name["nccl-abc"].remedy
    assert "still held by the parent" in by_name["mine"].message
    assert all(f.severity == "leak" for f in found)


def test_an_empty_torch_segment_is_named_a_failed_reservation_not_a_shared_tensor() -> None:
    files = (
        ShmFile("torch_1_2_0", 7 * MIB, allocated_bytes=0),  # made, never reserved: shm full
        ShmFile("torch_1_2_1", 7 * MIB, allocated_bytes=7 * MIB),
        ShmFile("torch_1_2_2", 7 * MIB),  # not read: the cause its name gives
    )
    by_name = {f.shm_name: f for f in shm_of(replace(timeline([]), shm_files=files))}
    failed = by_name["torch_1_2_0"]
    assert "reservation failed: /dev/shm was full" in failed.message
    assert "--shm-size" in failed.remedy and failed.severity == "leak"
    for name in ("torch_1_2_1", "torch_1_2_2"):
        assert "torch shared tensor" in by_name[name].message


def test_shm_in_use_and_unattributable_files_are_said_not_blamed() -> None:
    files = (
        ShmFile("held", 10, holder_pid=7, holder_role="worker", in_use=True),
        ShmFile("stranger", 10, attributable=False),
    )
    found = {f.shm_name: f for f in shm_of(replace(timeline([]), shm_files=files))}
    assert found["held"].severity == "info" and "held by PID 7" in found["held"].message
    assert found["stranger"].severity == "info"
    assert "nothing ties it to the work" in found["stranger"].message
    # Not blamed, so not said to be the work's own either, nor its fix the work's to make.
    assert "the work created itself" not in found["stranger"].message
    assert found["stranger"].message.endswith(": its name does not say who made it")
    assert found["stranger"].remedy.startswith("nothing to do if another job made it")


def test_a_file_an_older_process_made_is_left_to_it() -> None:
    files = (ShmFile("torch_42_1_0", 64, attributable=False, made_by_older=42),)
    (found,) = shm_of(replace(timeline([]), shm_files=files))
    assert found.severity == "info" and "made by PID 42, older than the work" in found.message
    assert found.remedy.startswith("nothing to do for this work: PID 42 (or its job) removes it")


def test_shm_capacity_pressure_is_information_about_the_worst_epoch() -> None:
    epochs = [
        replace(
            epoch(i, [parent()]),
            shm_total_bytes=mib(64),
            shm_used_peak_bytes=mib(used),
            shm_bytes=mib(job),
        )
        for i, (used, job) in enumerate([(10, 0), (60, 4), (55, 4)])
    ]
    (found,) = shm_of(timeline(epochs))
    assert (found.severity, found.epoch, found.size_bytes) == ("info", 1, mib(60))
    assert "/dev/shm was 94% full during epoch 1 (60 MiB of 64 MiB," in found.message
    assert "the job's files 4.0 MiB" in found.message
    assert "bus error" in found.message and "--shm-size" in found.remedy
    # Below the fraction: nothing; no size known: nothing.
    assert shm_of(timeline(epochs), shm_pressure_fraction=0.95) == []
    assert shm_of(timeline([epoch(0, [parent()])])) == []


def test_survivor_freed_by_garbage_collection_names_the_reference_cycle() -> None:
    from dataclasses import replace as set_fields

    worker = set_fields(
        proc(1234, "descendant", born=True, last_seen_after_s=3.0, exited_after_s=3.1),
        freed_by_gc=True,
    )
    found = one(verdict.survivor(timeline([epoch(0, [parent(), worker])]), CONFIG))
    assert found.message.endswith("; kept by a reference cycle")
    assert found.remedy.startswith("break the reference cycle that keeps the loader's iterator")


def test_a_clean_host_verdict_with_uss_at_every_end_says_nothing_more() -> None:
    epochs = [
        epoch(i, [parent(), proc(2001, persistent=True, uss_mib=100, rss_mib=300)])
        for i in range(6)
    ]
    assert host_findings(timeline(epochs)) == []
    # Three USS ends, the later ones resident only: said once, as information.
    mixed = [
        epoch(i, [parent(), proc(2001, persistent=True, uss_mib=100 if i < 4 else None,
                                  rss_mib=300)])
        for i in range(8)
    ]  # fmt: skip
    (info,) = host_findings(timeline(mixed))
    assert info.message.startswith("host memory was read as USS at 3 of the 7 epoch ends")


def _parent_paced(index: int, anon_mib: float) -> ProcessEpoch:
    """The parent at an epoch end: USS read at the first three judged ends only (paced)."""
    return proc(
        ROOT_PID, "parent", persistent=True, uss_mib=200 if index <= 3 else None,
        rss_mib=anon_mib + 100, anon_mib=anon_mib,
    )  # fmt: skip


def test_a_parents_growth_after_its_uss_was_paced_out_is_judged_resident() -> None:
    """Epochs 4-8 have RssAnon only: a loop that keeps memory from epoch 4 on still leaks."""
    late = [epoch(i, [_parent_paced(i, 150 + 50 * max(0, i - 3))]) for i in range(9)]
    (found,) = host_findings(timeline(late))
    assert (found.severity, found.role) == ("leak", "parent")
    assert "host memory (RssAnon) grows" in found.message and "150 -> 400 MiB" in found.message
    assert found.message.endswith("(USS read at 3 of these ends)")
    # Flat: clean, and nothing said (every end of the parent was read, resident).
    assert host_findings(timeline([epoch(i, [_parent_paced(i, 150)]) for i in range(9)])) == []


def test_a_parent_read_as_resident_at_some_ends_gets_no_information_line() -> None:
    # The parent's verdict needs its resident memory to grow (NOTE [return of shared pages]) and
    # copies nobody's pages: an end read as RSS hides nothing (Lightning's validation loader,
    # non-persistent workers, 5 epochs under `leakcheck run`).
    epochs = [
        epoch(i, [parent(uss_mib=200 if i < 4 else None, rss_mib=400), proc(2000 + i, born=True)])
        for i in range(5)
    ]
    assert host_findings(timeline(epochs)) == []


def test_ends_without_uss_are_said_only_of_workers_that_can_copy_on_read() -> None:
    # USS at the first 4 of 8 ends, resident memory after: said of a forked worker only. The
    # parent's USS counts only with its resident memory, and a spawned worker shares nothing.
    def judged(*worker_forked: bool) -> list[Finding]:
        def uss(i: int) -> float | None:
            return 100 if i < 4 else None

        def worker(i: int, forked: bool) -> ProcessEpoch:
            return replace(proc(2001, persistent=True, uss_mib=uss(i), rss_mib=300),
                           forked=forked)  # fmt: skip

        return host_findings(
            timeline([epoch(i, [parent(uss_mib=uss(i), rss_mib=300)]
                            + [worker(i, f) for f in worker_forked]) for i in range(8)])
        )  # fmt: skip

    assert judged() == []  # the parent alone: num_workers=0, or workers of one epoch each
    assert judged(False) == []
    (info,) = judged(True)
    assert info.message.startswith("host memory was read as USS at 3 of the 7 epoch ends")


def test_resident_growth_is_judged_on_its_anonymous_part_where_known() -> None:
    def worker_epochs(rss: list[float], anon: list[float]) -> Timeline:
        return timeline(
            [
                epoch(i, [parent(), proc(2001, persistent=True, rss_mib=r, anon_mib=a)])
                for i, (r, a) in enumerate(zip(rss, anon, strict=True))
            ]
        )

    # Libraries paged in from their files raise RSS, not RssAnon: nothing kept. A clean
    # verdict on resident memory alone says what it could not see.
    (info,) = host_findings(worker_epochs([300 + 40 * i for i in range(6)], [200] * 6))
    assert info.severity == "info"
    assert info.message.startswith("host memory was read as USS at 0 of the 5 epoch ends judged")
    assert "rollup_share=1.0" in info.remedy
    # What the process allocates and keeps is anonymous.
    (found,) = host_findings(
        worker_epochs([300 + 40 * i for i in range(6)], [200 + 40 * i for i in range(6)])
    )
    assert "host memory (RssAnon) grows 40 MiB/epoch" in found.message
    assert "(USS read at 0 of these ends)" in found.message


# --------------------------------------------------------------------------- copy-on-read


def copy_findings(tl: Timeline, **config: Any) -> list[Finding]:
    return [f for f in verdict.judge(tl, RuleConfig(**config)) if f.rule == "copy-on-read"]


def test_persistent_workers_that_copied_in_epoch_0_are_found_there_though_flat_after() -> None:
    # The classic shape: 195 MiB copied by 3.2 s into epoch 0, not a byte more afterwards.
    epochs = [
        epoch(i, [parent(uss_mib=110), copier(2001, 195, over_after_s=3.2 if i == 0 else 0.0),
                  copier(2002, 195, over_after_s=3.2 if i == 0 else 0.0)])
        for i in range(4)
    ]  # fmt: skip
    tl = timeline(epochs, attribution="nvml-unavailable")
    (found,) = copy_findings(tl)
    assert found.severity == "leak" and found.epoch == 0 and found.role == "worker"
    assert found.message == (
        f"2 forked workers of PID {ROOT_PID} each copied 195 MiB of their parent's memory "
        "(390 MiB in all), 3.2 s into epoch 0"
    )
    assert found.host_bytes == mib(390)
    assert "numpy" in found.remedy and "gc.freeze()" in found.remedy
    assert len(found.message) <= 160 and len(found.remedy) <= 120
    # The host-growth rule sees nothing to judge here: the USS is flat from epoch 0 on.
    assert host_findings(tl) == []
    assert verdict_of(tl) == "leak"


def test_per_epoch_workers_are_found_with_the_copy_repeating_every_epoch() -> None:
    epochs = [
        epoch(i, [parent(uss_mib=110),
                  copier(3000 + 2 * i, 195, persistent=False, alive=False, over_after_s=1.5),
                  copier(3001 + 2 * i, 190, persistent=False, alive=False, over_after_s=1.7)])
        for i in range(4)
    ]  # fmt: skip
    (found,) = copy_findings(timeline(epochs, attribution="nvml-unavailable"))
    assert found.epoch == 0
    assert found.message == (
        f"2 forked workers of PID {ROOT_PID} each copied 192 MiB of their parent's memory "
        "(385 MiB in all), 1.5 s into epoch 0 and again in epochs 1-3"
    )
    assert found.host_bytes == mib(385)  # one epoch's workers, not the run's
    assert len(found.message) <= 160
    # One epoch's per-epoch workers: the finding still says the copy comes back.
    (one,) = copy_findings(timeline(epochs[:1], attribution="nvml-unavailable"))
    assert "again each epoch" in one.message


def test_copies_within_the_tolerance_and_unknown_ones_are_not_findings() -> None:
    # Workers reading numpy arrays, a tensor, an mmap'd file copy a few MiB: the
    # interpreter's own objects. Workers without a birth report have no copy figure.
    tl = timeline(
        [epoch(i, [parent(), copier(2001, 3), copier(2002, None), copier(2003, 500, forked=None)])
         for i in range(3)],
        attribution="nvml-unavailable",
    )  # fmt: skip
    assert copy_findings(tl) == []
    # The tolerance is the copy tolerance, not the GPU's nor the host-growth rule's.
    (found,) = copy_findings(tl, copy_tolerance_bytes=mib(2))
    assert found.message.startswith(f"1 forked worker of PID {ROOT_PID} copied 3.0 MiB")
    assert copy_findings(tl, tolerance_bytes=mib(1), host_tolerance_bytes=mib(1)) == []


def test_a_worker_is_named_in_the_epoch_its_copy_first_exceeded_the_tolerance() -> None:
    # It copies 40 MiB in epoch 0, then 100 MiB by epoch 2 (a grower): found in epoch 1.
    copies = [(40, None), (80, 7.5), (100, 0.0)]
    epochs = [
        epoch(i, [parent(), copier(2001, copied, over_after_s=over)])
        for i, (copied, over) in enumerate(copies)
    ]
    (found,) = copy_findings(timeline(epochs, attribution="nvml-unavailable"))
    assert found.epoch == 1 and "copied 100 MiB" in found.message
    assert found.message.endswith("7.5 s into epoch 1")


def test_workers_of_each_loader_are_judged_apart() -> None:
    tl = timeline(
        [epoch(0, [parent(), copier(2001, 195, ppid=ROOT_PID), copier(2101, 80, ppid=2100),
                   copier(2201, 10, ppid=2200)])],
        attribution="nvml-unavailable",
    )  # fmt: skip
    found = copy_findings(tl)
    assert [f.pid for f in found] == [2001, 2101]
    assert "of PID 2100 copied 80 MiB" in found[1].message
    assert found[1].message.endswith("in epoch 0")  # no reading said when


def test_spawned_workers_say_copy_on_read_cannot_be_told_never_a_copy_leak() -> None:
    tl = timeline(
        [epoch(i, [parent(), copier(2001, None, forked=False, uss_mib=177),
                   copier(2002, None, forked=False, uss_mib=179)]) for i in range(3)],
        attribution="nvml-unavailable",
    )  # fmt: skip
    (found,) = copy_findings(tl, copy_tolerance_bytes=1)
    assert found.severity == "info"
    assert found.message == (
        "copy-on-read cannot be told for 2 workers started by spawn or forkserver: they share "
        "no memory with the training process; each holds 178 MiB of its own"
    )
    # Their USS unread (a warm-up end): what they held at birth.
    births = [replace(p, host_source="rss") for p in tl.epochs[0].processes]
    (at_birth,) = copy_findings(timeline([epoch(0, births)], attribution="nvml-unavailable"))
    assert at_birth.message.endswith("each holds 9.0 MiB of its own")
    assert len(found.message) <= 160 and len(found.remedy) <= 120
    assert verdict_of(tl) == "clean"


def test_a_report_in_the_middle_of_an_epoch_names_it_and_the_time_into_it() -> None:
    done = [epoch(0, [parent(), copier(2001, 20)])]
    final = final_state(
        [parent(), copier(2001, 150, over_after_s=41.0)], after_last_epoch=done, open_epoch=1
    )
    (found,) = copy_findings(timeline(done, final=final, attribution="nvml-unavailable"))
    assert found.epoch == 1 and found.message.endswith(
        "copied 150 MiB of its parent's memory, 41.0 s into epoch 1"
    )
    # Once closed, the final state is not an epoch: its readings are the epochs' already.
    closed = replace(final, open_epoch=None, closed=True)
    assert copy_findings(timeline(done, final=closed, attribution="nvml-unavailable")) == []
