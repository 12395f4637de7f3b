from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import leakcheck
from leakcheck.core.errors import UsageError
from leakcheck.core.model import (
    MIB,
    Finding,
    ProcessEpoch,
    RuleConfig,
    ShmFile,
    TeardownRecord,
    Timeline,
)
from leakcheck.judge.report import (
    SCHEMA_VERSION,
    Report,
    build_report,
    leak_short,
    report_from_dict,
)
from leakcheck.observe import procs
from tests.timelines import (
    BOOT_UNIX_S,
    ROOT_PID,
    clean_timeline,
    copier,
    device,
    epoch,
    final_state,
    parent,
    proc,
    timeline,
)

CONFIG = RuleConfig()


def survivor_report(attribution: str = "ok") -> Report:
    """Worker 1234 outlives epoch 1 holding 612 MiB; a foreign job holds 700 MiB at the end."""
    epochs = [
        epoch(
            0,
            [parent(600), proc(1201, born=True, gpu_mib=0, exited_after_s=0.1)],
            [device(0, 650, temp_c=41, sm_mhz=1980, power_w=310.4)],
        ),
        epoch(
            1,
            [parent(600), proc(1234, born=True, gpu_mib=612, fds=31, last_seen_after_s=3.0)],
            [device(0, 1262)],
        ),
        epoch(2, [parent(600)], [device(0, 1262)]),
    ]
    final = final_state(
        [parent(600), proc(1234, gpu_mib=612), proc(999, "foreign", gpu_mib=700)],
        [device(0, 1962)],
        after_last_epoch=epochs,
        parent_allocated_gpu_bytes=1024,
    )
    tl = timeline(epochs, final=final, attribution=attribution, baseline=[device(0, 50)])  # type: ignore[arg-type]
    return build_report(tl, CONFIG)


def blind_report() -> Report:
    epochs = [
        epoch(i, [proc(ROOT_PID, "parent", persistent=True)], [device(0, 650)]) for i in range(3)
    ]
    final = final_state(
        [proc(ROOT_PID, "parent", persistent=True)], [device(0, 650)], after_last_epoch=epochs
    )
    tl = timeline(
        epochs,
        final=final,
        attribution="blind-namespace",
        reason="NVML PIDs not found in /proc",
        baseline=[device(0, 640)],
    )
    return build_report(tl, CONFIG)


# --------------------------------------------------------------------------- views


def test_build_report_judges_the_timeline() -> None:
    report = survivor_report()
    assert [f.rule for f in report.leaks] == ["survivor", "residual"]
    assert all(f.severity == "info" for f in report.infos)
    assert report.epochs == report.timeline.epochs
    assert report.verdict == "leak"
    assert not report.clean


def test_clean_report() -> None:
    report = build_report(clean_timeline(), CONFIG)
    assert report.verdict == "clean"
    assert report.clean
    assert report.leaks == [] and report.infos == []


def test_blind_report_is_never_clean() -> None:
    report = blind_report()
    assert report.leaks == []
    assert [f.rule for f in report.infos] == ["blind"]
    assert report.verdict == "blind"
    assert not report.clean


# --------------------------------------------------------------------------- to_dict


def test_to_dict_round_trips_through_json() -> None:
    report = survivor_report()
    data = report.to_dict()
    again = json.loads(json.dumps(data))
    assert again == data
    assert again["schema_version"] == SCHEMA_VERSION == 3
    assert again["session"] == "test-session"
    assert again["root"]["pid"] == ROOT_PID
    assert again["attribution"] == "ok"
    assert again["verdict"] == "leak"
    assert again["summary"]["leaks"] == 2
    assert again["config"]["tolerance_bytes"] == CONFIG.tolerance_bytes
    assert [f["rule"] for f in again["findings"]] == [f.rule for f in report.findings]
    assert len(again["epochs"]) == 3
    assert again["final"]["devices"][0]["used_bytes"] == report.timeline.final.devices[0].used_bytes  # type: ignore[union-attr]


def test_to_dict_has_every_process_field_per_epoch() -> None:
    data = json.loads(json.dumps(survivor_report().to_dict()))
    worker = next(p for p in data["epochs"][1]["processes"] if p["key"]["pid"] == 1234)
    for field in dataclasses.fields(ProcessEpoch):
        assert field.name in worker
    assert worker["gpu_bytes_end"] == {"0": 612 * 1024 * 1024}
    assert worker["nvidia_fds"] == 31
    assert worker["total_gpu_bytes_end"] == 612 * 1024 * 1024
    first = data["epochs"][0]
    assert first["devices"][0]["temperature_c"] == 41
    assert first["duration_s"] == pytest.approx(1.0)


def test_report_from_dict_reads_back_the_same_report() -> None:
    report = survivor_report()
    teardown = TeardownRecord(key=report.timeline.root, worker_id=0, cuda_initialized=True)
    tl = dataclasses.replace(report.timeline, teardowns=(teardown,))
    report = build_report(tl, CONFIG)
    again = report_from_dict(json.loads(json.dumps(report.to_dict())))
    assert again == report
    assert again.timeline.epochs[1].processes[1].gpu_bytes_end == {0: 612 * 1024 * 1024}


def test_a_shm_file_made_by_an_older_process_reads_back_with_its_maker() -> None:
    """Its maker is part of the record: read back, it is judged with the same words; a report
    written before the field existed reads back with none (the generic words)."""
    files = (
        ShmFile("torch_42_1_0", 64, attributable=False, made_by_older=42),
        ShmFile("x", 64, attributable=False),
    )
    report = build_report(dataclasses.replace(survivor_report().timeline, shm_files=files), CONFIG)
    data = json.loads(json.dumps(report.to_dict()))
    again = report_from_dict(data)
    assert again == report
    words = [f.message for f in again.findings if f.rule == "shm"]
    assert any("made by PID 42, older than the work" in message for message in words)
    for item in data["shm_files"]:
        del item["made_by_older"]
    older = report_from_dict(data)
    assert [f.made_by_older for f in older.timeline.shm_files] == [None, None]


def test_processes_are_named_by_start_ticks_and_shown_with_a_create_time_never_read_back() -> None:
    """NOTE [process identity]: ``create_time`` is derived for people from the boot time the
    tracker read; another value there (a boot time read later) changes nothing read back."""
    report = survivor_report()
    data = json.loads(json.dumps(report.to_dict()))
    ticks = report.timeline.root.start_ticks
    shown = BOOT_UNIX_S + ticks / procs.clock_ticks()
    assert data["root"] == {"pid": ROOT_PID, "start_ticks": ticks, "create_time": shown}
    assert data["boot_unix_s"] == BOOT_UNIX_S
    survivor = next(f for f in data["findings"] if f["rule"] == "survivor")
    assert survivor["start_ticks"] == 100_000 + 1234 and survivor["create_time"] is not None
    for rec in data["epochs"]:
        for process in rec["processes"]:
            process["key"]["create_time"] += 1.0
    data["root"]["create_time"] = None
    assert report_from_dict(data) == report


@pytest.mark.parametrize("version", [1, 2])
def test_a_report_that_names_processes_by_create_times_is_refused(version: int) -> None:
    data = json.loads(json.dumps(survivor_report().to_dict()))
    data["schema_version"] = version
    with pytest.raises(UsageError, match="expected schema_version 3, got"):
        report_from_dict(data)


def test_ranks_round_trip_and_name_the_culprit() -> None:
    report = survivor_report()
    epochs = tuple(
        dataclasses.replace(
            rec,
            processes=tuple(dataclasses.replace(p, rank=1, rank_device=1) for p in rec.processes),
        )
        for rec in report.timeline.epochs
    )
    tl = dataclasses.replace(report.timeline, epochs=epochs, rank_devices={1: 1})
    ranked = build_report(tl, CONFIG)
    again = report_from_dict(json.loads(json.dumps(ranked.to_dict())))
    assert again == ranked
    assert again.timeline.rank_devices == {1: 1}
    survivor = next(f for f in again.findings if f.rule == "survivor")
    assert survivor.rank == 1
    assert "rank 1 worker of worker_1234.py (PID 1234)" in survivor.message
    assert "rank 1 worker PID 1234" in again.summary()


@pytest.mark.parametrize(
    "data", [{}, {"schema_version": 99}, {"schema_version": 3, "epochs": [{}]}]
)
def test_report_from_dict_rejects_foreign_data(data: dict[str, object]) -> None:
    with pytest.raises(UsageError, match="report data"):
        report_from_dict(data)


# --------------------------------------------------------------------------- text


def test_text_names_the_culprit_with_pid_and_mib() -> None:
    text = survivor_report().format()
    assert "LEAK survivor  worker of worker_1234.py (PID 1234)" in text
    assert "612 MiB" in text
    assert "  fix: " in text
    assert "LEAK residual" in text and "PID 999" in text
    lines = text.splitlines()
    assert lines[0].startswith("leakcheck report: session test-session, root PID 100")
    # The finding lines name the culprits: the last line counts them; a warning names them.
    assert lines[-1] == "leakcheck: 2 leaks in 3 epochs (3 processes)"
    summary = survivor_report().summary()
    assert summary.startswith("leakcheck: 2 leaks found: survivor worker PID 1234 (612 MiB)")


def test_text_table_has_one_row_per_epoch_and_dashes_for_unknowns() -> None:
    lines = survivor_report().format().splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("epoch  label"))
    rows = lines[head + 1 : head + 4]
    assert [row.split()[0] for row in rows] == ["0", "1", "2"]
    # No host memory read in any epoch: those columns are left out (only data shows).
    assert "host" not in lines[head]
    assert rows[0].split() == [
        *("0", "epoch", "0", "1.0", "600", "1", "0", "0", "0", "0"),
        *("GPU0", "650/81559", "41", "1980", "310"),
    ]
    # epoch 1: parent 600 MiB, one worker holding 612 MiB and alive after the epoch;
    # temperature, SM clock and power unknown there.
    assert rows[1].split() == [
        *("1", "epoch", "1", "1.0", "600", "1", "612", "612", "1", "0"),
        *("GPU0", "1262/81559", "-", "-", "-"),
    ]


def test_text_table_has_a_row_per_extra_device() -> None:
    epochs = [epoch(0, [parent({0: 600, 1: 10})], [device(0, 650), device(1, 60)])]
    report = build_report(timeline(epochs, attribution="blind-namespace"), CONFIG)
    text = report.format()
    assert "GPU0" in text and "GPU1" in text
    assert any(line.split()[:2] == ["GPU1", "60/81559"] for line in text.splitlines())


def test_clean_report_is_short_and_says_no_leaks() -> None:
    report = build_report(clean_timeline(), CONFIG)
    text = report.format()
    assert text == "leakcheck: no leaks in 5 epochs (11 processes, peak 650 MiB on GPU0)"
    assert str(report) == text
    verbose = report.format(verbose=True)
    assert len(verbose.splitlines()) > 10
    assert "epoch  label" in verbose
    assert "thresholds: tolerance 16 MiB" in verbose
    assert verbose.splitlines()[-1] == text


def test_clean_report_keeps_its_advice() -> None:
    epochs = [epoch(0, [parent(600)])]
    final = final_state(
        [parent(612)], [device(0, 662)], after_last_epoch=epochs, parent_allocated_gpu_bytes=0
    )
    report = build_report(timeline(epochs, final=final, baseline=[device(0, 50)]), CONFIG)
    assert report.clean
    lines = report.format().splitlines()
    assert lines[0].startswith("info context-kept  parent train.py --epochs 5 (PID 100)")
    assert lines[1].startswith("  fix: ")
    assert lines[-1].startswith("leakcheck: no leaks in 1 epoch (")
    assert lines[-1].endswith("; growth not judged (needs 4 epochs)")
    assert len(lines) == 3


@pytest.mark.parametrize("epochs", [3, 4])
def test_a_clean_verdict_says_where_too_few_epochs_were_seen_to_judge_growth(epochs: int) -> None:
    # 80 MiB a epoch kept by the parent: the growth rule needs warm-up 1 + 3 judged ends.
    grown = [
        proc(
            ROOT_PID,
            "parent",
            persistent=True,
            uss_mib=200 + 80 * i,
            rss_mib=300 + 80 * i,
            anon_mib=150 + 80 * i,
        )
        for i in range(epochs)
    ]
    history = [epoch(i, [p]) for i, p in enumerate(grown)]
    report = build_report(timeline(history), CONFIG)
    unjudged = "; growth not judged (needs 4 epochs)"
    assert report.clean is (epochs == 3)
    assert report.summary().endswith(unjudged) is (epochs == 3)
    assert report.growth_unjudged() == (unjudged if epochs == 3 else "")


def test_blind_report_text_never_says_clean() -> None:
    text = blind_report().format()
    lines = text.splitlines()
    assert any(
        line.startswith("attribution blind: NVML's PIDs are from another PID namespace")
        for line in lines
    )
    assert "NVML PIDs not found in /proc" in text
    assert "info blind  " in text
    assert lines[-1].startswith("leakcheck: cannot confirm no leaks in 3 epochs")


def test_nvml_unavailable_text_says_why_and_shows_dashes() -> None:
    report = survivor_report("nvml-unavailable")
    assert [f.rule for f in report.leaks] == ["survivor"]
    text = report.format()
    assert "GPU: not checked (" in text
    lines = text.splitlines()
    head = next(line for line in lines if line.startswith("epoch  label"))
    row = next(line for line in lines if line.split()[:3] == ["1", "epoch", "1"])
    # Without NVML no column of processes' GPU memory shows (no dash of one); one worker seen.
    assert not {"parent MiB", "wk end MiB", "wk peak MiB"} & set(head.split("  ")), head
    columns = [cell.strip() for cell in head.split("  ") if cell.strip()]
    assert columns[:4] == ["epoch", "label", "time s", "workers"], head
    assert row.split()[4] == "1"


def test_nvml_unavailable_clean_summary() -> None:
    tl = dataclasses.replace(clean_timeline(), attribution="nvml-unavailable")
    report = build_report(tl, CONFIG)
    assert report.clean
    assert report.format() == ("leakcheck: no leaks in 5 epochs (11 processes; GPU not checked)")


def test_many_leaks_are_summarised() -> None:
    workers = [proc(2000 + i, born=True, gpu_mib=100, last_seen_after_s=5.0) for i in range(5)]
    report = build_report(timeline([epoch(0, [parent(600), *workers])]), CONFIG)
    assert len(report.leaks) == 5
    last = report.summary()
    assert last.startswith("leakcheck: 5 leaks found: survivor worker PID 2000 (100 MiB)")
    assert last.endswith("; and 2 more")


def test_a_shm_leak_is_named_by_its_file_in_the_verdict_line() -> None:
    files = (ShmFile("leakcheck_demo_segment", 2 * 1024 * 1024),)
    tl = dataclasses.replace(timeline([epoch(0, [parent(600)])]), shm_files=files)
    report = build_report(tl, CONFIG)
    (finding,) = report.leaks
    assert report.summary() == (
        "leakcheck: 1 leak found: shm /dev/shm/leakcheck_demo_segment (2.0 MiB)"
    )
    assert leak_short(finding) == "shm /dev/shm/leakcheck_demo_segment (2.0 MiB)"


def test_two_files_held_by_one_process_are_two_leaks_named_by_file() -> None:
    from leakcheck.judge.job import finding_identity

    files = tuple(ShmFile(name, 1024, holder_pid=7, holder_role="worker") for name in "ab")
    tl = dataclasses.replace(timeline([epoch(0, [parent(600)])]), shm_files=files)
    leaks = build_report(tl, CONFIG).leaks
    assert [leak_short(f) for f in leaks] == [
        "shm /dev/shm/a (1.0 KiB)",
        "shm /dev/shm/b (1.0 KiB)",
    ]
    assert len({finding_identity(f) for f in leaks}) == 2


def test_a_report_before_close_does_not_call_a_named_leak_not_judged_yet() -> None:
    orphan = proc(4321, "orphan")
    rec = epoch(0, [parent(600), orphan])
    final = final_state([parent(600), orphan, proc(4322, "descendant")], after_last_epoch=[rec])
    pending = dataclasses.replace(final, closed=False, pending_pids=(4321, 4322))
    report = build_report(timeline([rec], final=pending), CONFIG)
    assert [f.pid for f in report.leaks] == [4321]
    assert report.summary().endswith(
        "; 1 process of recent epochs not judged yet (alive, not yet seen more than the grace "
        "of 2 s after the end of the epoch it was born in)"
    ), report.summary()


def test_json_gpu_totals_are_null_where_nvml_gave_no_count() -> None:
    unknown = dataclasses.replace(proc(4321, gpu_mib=0), gpu_bytes_unknown=True)
    report = build_report(timeline([epoch(0, [parent(600), unknown])]), CONFIG)
    (record,) = report.to_dict()["epochs"]
    by_pid = {p["key"]["pid"]: p for p in record["processes"]}
    assert by_pid[4321]["total_gpu_bytes_end"] is None
    assert by_pid[ROOT_PID]["total_gpu_bytes_end"] == 600 * MIB


def test_verbose_lists_processes_and_teardowns() -> None:
    report = survivor_report()
    teardown = TeardownRecord(
        key=report.timeline.root,
        worker_id=3,
        cuda_initialized=True,
        context_released=True,
        left_nvml=True,
    )
    tl: Timeline = dataclasses.replace(report.timeline, teardowns=(teardown,))
    text = build_report(tl, CONFIG).format(verbose=True)
    assert "epoch 1 (completed):" in text
    assert "after the work:" in text
    assert any(
        "1234" in line and "GPU0:612" in line and "seen+3.0s" in line for line in text.splitlines()
    )
    assert "(worker 3): freed cache 0 MiB, context released, left NVML" in text


def test_report_is_the_public_name() -> None:
    assert leakcheck.Report is Report


# --------------------------------------------------------------------------- one line each

# A checkout deep enough that the interpreter's path alone is longer than any line allowed.
_LONG_PYTHON = "/tmp/" + "a-rather-long-checkout-folder/" * 10 + ".venv/bin/python3"
_LONG_CODE = f"{_LONG_PYTHON} -c " + "import os, sys, time; " * 20
_LONG_LABEL = "tests/test_a_module_with_a_long_name.py::test_a_case_with_a_long_name[param-1-2]"


def _long(p: ProcessEpoch, **changes: object) -> ProcessEpoch:
    return dataclasses.replace(p, cmdline=_LONG_CODE, **changes)  # type: ignore[arg-type]


def _findings_of_every_rule() -> list[Finding]:
    """Findings of every rule, with the longest names and labels a report may meet."""
    from leakcheck.core.model import Death, ParentMemory, ProcessKey, Stall
    from leakcheck.judge import verdict

    config = RuleConfig()
    long_epoch = epoch(
        0,
        [
            parent(600),
            _long(proc(1234, "descendant", born=True, gpu_mib=612, fds=31, last_seen_after_s=3.0)),
            _long(
                proc(1235, "descendant", born=True, last_seen_after_s=3.0),
                freed_by_gc=True,
                scope="session-scoped fixture 'a_fixture_with_a_rather_long_name_indeed'",
            ),
            _long(proc(1236, "descendant", gpu_mib=0, fds=31, persistent=True)),
            _long(proc(1237, gpu_mib={0: 520}), rank=1, rank_device=1),
            _long(proc(1238, persistent=True), open_fds=1_000_000, fd_limit=1_048_576),
        ],
        [device(0, 2000), device(1, 700)],
        label=_LONG_LABEL,
    )
    orphan = _long(proc(4321, "orphan", gpu_mib=600, fds=31), rank=12)
    foreign = [_long(proc(900 + i, "foreign", gpu_mib=700)) for i in range(3)]
    final = final_state(
        [parent(612), orphan, *foreign],
        [device(0, 5000), device(1, 0, sm_mhz=1980, sm_max_mhz=1980, temp_c=80, power_w=300)],
        after_last_epoch=[long_epoch],
        parent_allocated_gpu_bytes=0,
    )
    shm = (
        ShmFile("cuda.shm." + "x" * 200, 80 * 1024),
        ShmFile("torch_1234_" + "5" * 100, 4 * MIB, holder_pid=1234, holder_role="worker"),
        ShmFile("psm_1a2b3c", 1000, scope="module-scoped fixture 'a_long_fixture_name'"),
        ShmFile("nccl-abc", 1000, holder_pid=7, holder_role="worker", in_use=True),
        ShmFile("mine", 10, attributable=False),
        ShmFile("torch_42_1_0", 64, attributable=False, made_by_older=42),
    )
    tl = dataclasses.replace(
        timeline(
            [
                dataclasses.replace(
                    long_epoch, shm_total_bytes=64 * MIB, shm_used_peak_bytes=60 * MIB
                )
            ],
            final=final,
            baseline=[device(0, 50), device(1, 0)],
            failures=["a sampler failure: " + "something went wrong in a long way; " * 10],
        ),
        shm_files=shm,
        parent_memory=ParentMemory(
            kept_tensor_bytes={0: 256 * MIB}, driver_bytes={0: 64 * MIB}, scopes=("x" * 100,)
        ),
        stalls=(Stall(0, 125.0, 130.0, ""), Stall(0, 5.0, 131.0, "", 1234567)),
        deaths=tuple(
            Death(ProcessKey(1234, 1234), number, 1.0, 0, **evidence)  # type: ignore[arg-type]
            for number, evidence in (
                (9, {"oom_kills": 12, "rss_bytes_birth": 10**8, "rss_bytes_last": 10**13}),
                (9, {"memory_total_bytes": 10**13, "memory_available_bytes": 10**9}),
                (9, {}),
                (7, {"shm_total_bytes": 64 * MIB, "shm_used_peak_bytes": 64 * MIB}),
                (11, {}),
            )
        ),
    )
    growing = [
        epoch(i, [_long(proc(2001, persistent=True, gpu_mib=100 + 64 * i, uss_mib=100 + 40 * i))])
        for i in range(6)
    ]
    resident_only = [
        epoch(i, [_long(proc(2002, persistent=True, rss_mib=300, anon_mib=200))]) for i in range(6)
    ]
    blind = timeline(
        [epoch(i, [parent(None)], [device(0, 100 + 64 * i)]) for i in range(6)],
        attribution="blind-namespace",
        reason="NVML PIDs not found in /proc: " + "1234, " * 40,
    )
    copying = [
        epoch(i, [parent(), *(_long(copier(3000 + w, 195, ppid=ROOT_PID)) for w in range(8)),
                  _long(copier(3100, None, forked=False, uss_mib=400))])
        for i in range(2)
    ]  # fmt: skip
    pinned = [
        dataclasses.replace(epoch(i, [parent()]), pinned_reserved_bytes=(100 + 64 * i) * MIB)
        for i in range(6)
    ]
    found = [
        *verdict.judge(timeline(pinned), config),
        *verdict.judge(tl, config),
        *verdict.judge(timeline(copying, attribution="nvml-unavailable"), config),
        *verdict.judge(timeline(growing), config),
        *verdict.judge(timeline(resident_only, attribution="nvml-unavailable"), config),
        *verdict.judge(blind, config),
    ]
    assert {f.rule for f in found} == set(verdict.RULES), {f.rule for f in found}
    return found


def test_every_finding_is_one_line_of_160_and_its_fix_one_of_120() -> None:
    """NOTE [one line per finding]: however long the command lines, labels and names."""
    from leakcheck.judge.report import FINDING_WIDTH, FIX_WIDTH, finding_lines

    findings = _findings_of_every_rule()
    for finding in findings:
        assert len(finding.remedy) <= FIX_WIDTH, finding.remedy
        lines = finding_lines([finding], "  ", loader="a/long/path/to/train_script.py:42")
        assert len(lines) == 2, lines
        assert len(lines[0]) <= FINDING_WIDTH, lines[0]
        assert lines[1].startswith("    fix: ") and len(lines[1]) <= len("    fix: ") + FIX_WIDTH
        assert _LONG_PYTHON not in lines[0] and ".venv" not in lines[0], lines[0]
    text = build_report(timeline([epoch(0, [parent()])]), RuleConfig()).format()
    for line in [*finding_lines(findings), *text.splitlines()]:
        assert len(line) <= FINDING_WIDTH, line


def test_orphans_of_one_cause_are_one_line_under_one_fix() -> None:
    epochs = [epoch(0, [parent()])]
    orphans = [proc(11 + i, "orphan", cmdline="sleep 60", born=True) for i in range(6)]
    orphans = [dataclasses.replace(p, born_epoch=0) for p in orphans]
    final = final_state([parent(), *orphans], after_last_epoch=epochs)
    report = build_report(timeline(epochs, final=final), RuleConfig())
    assert len(report.leaks) == 6
    lines = report.finding_lines()
    assert lines == [
        "LEAK orphan  6 \u00d7 sleep 60 (PIDs 11, 12, 13, \u2026) outlived its parent since "
        "epoch 0, alive after the job",
        "  fix: leakcheck.worker_init_fn(terminate_children=True), or kill 11 12 13 14 15 16",
    ]


def test_a_file_nothing_ties_to_the_work_is_kept_in_the_json_not_in_the_text() -> None:
    """Another job's /dev/shm file is no one's to act on here: the JSON has it, the text of a
    clean report stays its one line; a file the work's process holds is still said."""
    files = (
        ShmFile("torch_42_1_0", 64, attributable=False, made_by_older=42),
        ShmFile("stranger", 64, attributable=False),
    )
    report = build_report(dataclasses.replace(clean_timeline(), shm_files=files), CONFIG)
    assert report.clean and [f.rule for f in report.findings] == ["shm", "shm"]
    assert report.format() == report.summary()
    assert len(report.to_dict()["findings"]) == 2
    held = (ShmFile("mine", 64, holder_pid=ROOT_PID, holder_role="parent", in_use=True),)
    report = build_report(dataclasses.replace(clean_timeline(), shm_files=held), CONFIG)
    assert report.format().splitlines()[0].startswith("info shm  /dev/shm/mine (64 B) still")


# --------------------------------------------------------------------------- picture


def _pictured(attribution: str) -> leakcheck.Report:
    """Three epochs: the parent's USS not read in epoch 1 (its RSS is), a worker per epoch
    growing 50, 100, 150 MiB of USS, and a host-growth leak of the workers in epoch 2."""
    from leakcheck.core.model import Finding, RuleConfig
    from leakcheck.judge.report import Report
    from tests import timelines as tl

    def parent(uss: float | None) -> ProcessEpoch:
        return tl.parent(600, uss_mib=uss, rss_mib=500)

    epochs = [
        tl.epoch(n, [parent(uss), tl.proc(1001 + n, born=True, gpu_mib=10, uss_mib=host,
                                          rss_mib=host + 100)], label=f"train epoch {n}")
        for n, (uss, host) in enumerate([(300, 50), (None, 100), (320, 150)])
    ]  # fmt: skip
    leak = Finding(
        rule="host-growth", severity="leak", message="grows", remedy="fix it", role="worker",
        epoch=2, host_bytes=100 * MIB,
    )  # fmt: skip
    timeline = tl.timeline(epochs, attribution=attribution)  # type: ignore[arg-type]
    return Report(timeline=timeline, findings=(leak,), config=RuleConfig())


def test_a_report_series_keeps_one_measure_per_line_and_a_gap_where_not_read() -> None:
    from leakcheck.judge.plot import report_series

    series = report_series(_pictured("nvml-unavailable"))
    assert set(series) == {"parent", "workers"}
    assert series["parent"]["rss"] == [500.0, 500.0, 500.0]
    uss = series["parent"]["uss"]
    assert uss[0] == 300.0 and uss[1] != uss[1] and uss[2] == 320.0  # NaN: a gap, not RSS
    assert series["workers"]["uss"] == [50.0, 100.0, 150.0]
    assert "gpu" not in series["parent"]  # not read: no line, never a line of 0
    assert report_series(_pictured("ok"))["workers"]["gpu"] == [10.0, 10.0, 10.0]


@pytest.mark.parametrize("attribution", ["nvml-unavailable", "ok"])
def test_a_report_picture_names_its_epochs_and_marks_each_leak_on_its_process(
    attribution: str, tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib")
    from leakcheck.judge.plot import render_reports

    report = _pictured(attribution)
    figure = render_reports([("train.py:12", report)])
    by_label = {axes.get_ylabel(): axes for axes in figure.axes}
    assert ("GPU memory (MiB)" in by_label) == (attribution == "ok")
    host = by_label["host memory (MiB)"]
    assert [t.get_text() for t in host.get_xticklabels()] == [e.label for e in report.epochs]
    (mark,) = [line for line in host.get_lines() if line.get_label() == "leak"]
    assert list(mark.get_xydata()[0]) == [2.0, 150.0]  # epoch 2, on the workers' USS
    assert [t.get_text() for t in host.texts] == ["host-growth"]
    assert "train.py:12" in figure.axes[0].get_title()  # the column's top panel
    path = tmp_path / "report.png"
    assert report.plot(str(path), label="train.py:12") == str(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", ["leaks.svg", "leaks.pdf", "leaks", "leaks.png.txt"])
def test_a_picture_under_a_name_other_than_png_is_refused_in_one_line(
    name: str, tmp_path: Path
) -> None:
    """Its bytes are PNG whatever the name: a leaks.svg of PNG bytes opens nowhere."""
    path = tmp_path / name
    with pytest.raises(UsageError) as info:
        _pictured("ok").plot(str(path))
    assert str(info.value) == f"plot: expected a file name ending in .png, got {str(path)!r}"
    assert not path.exists()


def test_a_stack_under_a_long_checkout_path_keeps_its_lines_and_functions() -> None:
    """A stack row is cut in its folders, never in its line and function: the checkout's
    path must not decide what the report shows (CI soaks clone under 160 characters)."""
    from leakcheck.judge.report import FINDING_WIDTH, finding_lines

    folder = "/tmp/" + "a-long-checkout-path-" * 10
    stack = "\n".join(
        [
            "Current thread 0x00007f (most recent call first):",
            f'  File "{folder}/tests/test_deaths.py", line 56 in __getitem__',
            f'  File "{folder}/torch/utils/data/_utils/fetch.py", line 52, in fetch',
        ]
    )
    died = next(f for f in _findings_of_every_rule() if f.rule == "died")
    lines = finding_lines([dataclasses.replace(died, stack=stack)], "  ")
    assert any(line.endswith('tests/test_deaths.py", line 56 in __getitem__') for line in lines)
    assert any(line.endswith('…/_utils/fetch.py", line 52, in fetch') for line in lines)
    assert all(len(line) <= FINDING_WIDTH for line in lines), lines
