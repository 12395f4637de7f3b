"""Option resolution: command line > environment > ini > default, errors naming the source."""

from __future__ import annotations

import pytest

from leakcheck.core.errors import UsageError
from leakcheck.core.options import (
    COPY_TOLERANCE,
    ENABLED,
    GRACE,
    MIN_INTERVAL_S,
    MODE,
    SPECS,
    TOLERANCE,
    CheckOptions,
    OptionSpec,
    apply_marker,
    command_line_value,
    parse_bool,
    parse_interval_option,
    parse_mode,
    parse_share_option,
    resolve,
    resolve_check_options,
)

MIB = 1024 * 1024


def test_defaults_when_nothing_is_set() -> None:
    options = resolve_check_options({}, {}, {})
    assert options == CheckOptions(
        enabled=False,
        tolerance_bytes=16 * MIB,
        mode="fail",
        grace_s=1.0,
        copy_tolerance_bytes=64 * MIB,
        sources=dict.fromkeys(
            ("enabled", "tolerance", "mode", "grace", "copy_tolerance"), "default"
        ),
    )


def test_command_line_beats_environment_beats_ini() -> None:
    environ = {"LEAKCHECK_TOLERANCE": "2GB", "LEAKCHECK_MODE": "warn"}
    ini = {"tolerance": "3GB", "mode": "fail", "grace": "250ms", "enabled": "true"}
    options = resolve_check_options({"tolerance": "1GB"}, environ, ini, ini_path="/x/tox.ini")
    assert options.tolerance_bytes == 1_000_000_000
    assert options.sources["tolerance"] == "--gpu-leak-tolerance (command line)"
    assert options.mode == "warn"
    assert options.sources["mode"] == "LEAKCHECK_MODE (environment)"
    assert options.grace_s == 0.25
    assert options.sources["grace"] == "gpu_leak_grace (ini file /x/tox.ini)"
    assert options.enabled is True
    assert options.sources["enabled"] == "gpu_leak_check (ini file /x/tox.ini)"


def test_unset_values_fall_through() -> None:
    # An absent ini key reads as "", an unset flag as None, an exported-empty variable as "".
    options = resolve_check_options(
        {"tolerance": None}, {"LEAKCHECK_TOLERANCE": "  "}, {"tolerance": ""}
    )
    assert options.tolerance_bytes == TOLERANCE.default
    assert options.sources["tolerance"] == "default"


def test_flag_false_overrides_environment() -> None:
    options = resolve_check_options({"enabled": False}, {"LEAKCHECK_GPU_LEAK_CHECK": "1"}, {})
    assert options.enabled is False
    assert options.sources["enabled"] == "--gpu-leak-check (command line)"


@pytest.mark.parametrize(
    ("text", "expected"),
    [("16MiB", 16 * MIB), ("1GB", 10**9), ("4096", 4096), ("0.5GiB", 512 * MIB), ("0", 0)],
)
def test_sizes(text: str, expected: int) -> None:
    assert resolve(TOLERANCE, cli=text).value == expected


@pytest.mark.parametrize(
    ("text", "expected"), [("1", True), ("TRUE", True), ("on", True), ("no", False), ("0", False)]
)
def test_switches(text: str, expected: bool) -> None:
    assert parse_bool(text, "here") is expected


@pytest.mark.parametrize(
    ("spec", "where", "raw", "source"),
    [
        (TOLERANCE, "cli", "lots", "--gpu-leak-tolerance (command line)"),
        (TOLERANCE, "env", "-1MiB", "LEAKCHECK_TOLERANCE (environment)"),
        (TOLERANCE, "ini", "7 furlongs", "gpu_leak_tolerance (ini file pytest.ini)"),
        (GRACE, "cli", "soon", "--gpu-leak-grace (command line)"),
        (GRACE, "env", "-3", "LEAKCHECK_GRACE (environment)"),
        (GRACE, "cli", "inf", "--gpu-leak-grace (command line)"),
        (GRACE, "ini", "1e300", "gpu_leak_grace (ini file pytest.ini)"),
        (MODE, "ini", "explode", "gpu_leak_mode (ini file pytest.ini)"),
        (ENABLED, "env", "perhaps", "LEAKCHECK_GPU_LEAK_CHECK (environment)"),
    ],
)
def test_bad_values_name_value_and_source(
    spec: OptionSpec[object], where: str, raw: str, source: str
) -> None:
    kwargs: dict[str, object] = {"ini_path": "pytest.ini"}
    if where == "cli":
        kwargs["cli"] = raw
    elif where == "env":
        kwargs["environ"] = {spec.env_var or "": raw}
    else:
        kwargs["ini"] = raw
    with pytest.raises(UsageError) as info:
        resolve(spec, **kwargs)  # type: ignore[arg-type]
    message = str(info.value)
    assert message.startswith(source + ":")
    assert repr(raw) in message


def test_lower_sources_are_not_validated_when_a_higher_one_wins() -> None:
    # A stale bad ini value must not break a run whose command line sets the option.
    options = resolve_check_options({"tolerance": "1MiB"}, {}, {"tolerance": "junk"})
    assert options.tolerance_bytes == MIB


def test_ini_list_value_of_one_item_is_accepted() -> None:
    assert resolve(TOLERANCE, ini=["32MiB"]).value == 32 * MIB


def test_mode_accepts_only_fail_and_warn() -> None:
    assert parse_mode(" Warn ", "x") == "warn"
    with pytest.raises(UsageError, match="expected one of fail, warn"):
        parse_mode("ignore", "x")


def test_every_spec_has_all_three_sources() -> None:
    names = [spec.name for spec in SPECS]
    assert names == ["enabled", "tolerance", "mode", "grace", "copy_tolerance"]
    for spec in SPECS:
        assert spec.cli_flag is not None and spec.cli_flag.startswith("--gpu-leak-")
        assert spec.env_var is not None and spec.env_var.startswith("LEAKCHECK_")
        assert spec.ini_key is not None and spec.ini_key.startswith("gpu_leak_")
        assert spec.help


# --- markers ------------------------------------------------------------------------------

WHERE = "gpu_leak_check marker on t.py::t"


def test_marker_overrides_and_records_its_source() -> None:
    base = resolve_check_options({"enabled": True}, {}, {})
    options = apply_marker(base, (), {"tolerance": "1GiB", "grace": 0}, where=WHERE)
    assert options.tolerance_bytes == 1024 * MIB
    assert options.grace_s == 0.0
    assert options.enabled is True
    assert options.sources["tolerance"] == f"tolerance= of {WHERE}"
    assert options.sources["enabled"] == "--gpu-leak-check (command line)"


def test_copy_tolerance_from_every_source_and_a_marker() -> None:
    assert resolve_check_options({}, {}, {}).copy_tolerance_bytes == 64 * MIB
    from_env = resolve_check_options({}, {"LEAKCHECK_COPY_TOLERANCE": "8MiB"}, {})
    assert from_env.copy_tolerance_bytes == 8 * MIB
    assert from_env.sources["copy_tolerance"] == "LEAKCHECK_COPY_TOLERANCE (environment)"
    from_ini = resolve_check_options({}, {}, {"copy_tolerance": "1GiB"}, ini_path="setup.cfg")
    assert from_ini.copy_tolerance_bytes == 1024 * MIB
    with pytest.raises(UsageError, match=r"--gpu-leak-copy-tolerance \(command line\)"):
        resolve_check_options({"copy_tolerance": "lots"}, {}, {})
    marked = apply_marker(from_env, (), {"copy_tolerance": "2MiB"}, where=WHERE)
    assert marked.copy_tolerance_bytes == 2 * MIB
    assert marked.sources["copy_tolerance"] == f"copy_tolerance= of {WHERE}"
    # A command's --copy-tolerance, then the environment.
    env = {"LEAKCHECK_COPY_TOLERANCE": "8MiB"}
    flag = "--copy-tolerance"
    assert command_line_value(COPY_TOLERANCE, flag, None, env) == 8 * MIB
    assert command_line_value(COPY_TOLERANCE, flag, "32MiB", env) == 32 * MIB
    with pytest.raises(UsageError, match=r"--copy-tolerance \(command line\)"):
        command_line_value(COPY_TOLERANCE, flag, "", env)


def test_a_marker_that_does_not_say_enabled_checks_its_test_unless_chosen_before() -> None:
    tuning = {"tolerance": "64MiB"}
    unset = resolve_check_options({}, {}, {})
    assert apply_marker(unset, (), tuning, where=WHERE).enabled is True
    refused = resolve_check_options({"enabled": False}, {}, {})  # --no-gpu-leak-check
    assert apply_marker(refused, (), tuning, where=WHERE).enabled is False
    farther = apply_marker(unset, (), {"enabled": False}, where=WHERE)  # a module's marker
    assert apply_marker(farther, (), tuning, where=WHERE).enabled is False


def test_marker_positional_is_enabled() -> None:
    base = resolve_check_options({"enabled": True}, {}, {})
    assert apply_marker(base, (False,), {}, where=WHERE).enabled is False
    assert apply_marker(CheckOptions(), (), {"enabled": True}, where=WHERE).enabled is True


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((), {"tolerence": "1GB"}, "unknown argument"),
        ((True, False), {}, "at most one positional"),
        ((True,), {"enabled": True}, "enabled given twice"),
        ((), {"tolerance": "big"}, "tolerance= of gpu_leak_check marker on t.py::t"),
        ((), {"enabled": "sometimes"}, "enabled= of gpu_leak_check marker"),
    ],
)
def test_bad_markers(args: tuple[object, ...], kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(UsageError, match=match):
        apply_marker(CheckOptions(), args, kwargs, where=WHERE)


# --- values given empty on the command line ---------------------------------------------


@pytest.mark.parametrize(
    ("spec", "raw", "needle"),
    [
        (TOLERANCE, "", "--gpu-leak-tolerance (command line): expected a size"),
        (TOLERANCE, "  ", "--gpu-leak-tolerance (command line): expected a size"),
        (GRACE, "", "--gpu-leak-grace (command line): expected seconds"),
        (MODE, "", "--gpu-leak-mode (command line): expected one of fail, warn, got ''"),
    ],
)
def test_empty_command_line_value_is_an_error(
    spec: OptionSpec[object], raw: str, needle: str
) -> None:
    """``--gpu-leak-tolerance=`` was taken as "not given": the default won, silently."""
    with pytest.raises(UsageError) as info:
        resolve(spec, cli=raw, environ={spec.env_var or "": "1"}, ini="1")
    assert needle in str(info.value)
    assert repr(raw) in str(info.value)
    with pytest.raises(UsageError):
        resolve_check_options({spec.name: raw}, {}, {})


def test_empty_environment_and_ini_still_mean_unset() -> None:
    options = resolve_check_options(
        {"tolerance": None, "grace": None, "mode": None},
        {"LEAKCHECK_TOLERANCE": "", "LEAKCHECK_GRACE": " ", "LEAKCHECK_MODE": ""},
        {"tolerance": "", "grace": [], "mode": None},
    )
    assert (options.tolerance_bytes, options.grace_s, options.mode) == (
        TOLERANCE.default,
        GRACE.default,
        MODE.default,
    )


# --- the sampling interval's floor --------------------------------------------------------


def test_interval_floor() -> None:
    assert MIN_INTERVAL_S == 0.001
    assert parse_interval_option("1ms", "--interval") == 0.001
    assert parse_interval_option(0.05, "interval") == 0.05
    for raw in ("1e-9", "0", 0.0005, "999us", "-1", -0.5):
        with pytest.raises(UsageError) as info:
            parse_interval_option(raw, "--interval")
        message = str(info.value)
        assert message.startswith("--interval: expected")
        assert repr(raw) in message
    with pytest.raises(UsageError, match=r"^--interval: expected 1ms or more .*spin.*got '1e-9'$"):
        parse_interval_option("1e-9", "--interval")


@pytest.mark.parametrize(
    ("raw", "expected"), [("0.1%", 0.001), ("1", 1.0), (" 0.25 ", 0.25), (0.5, 0.5), (1, 1.0)]
)
def test_shares(raw: object, expected: float) -> None:
    assert parse_share_option(raw, "--rollup-share") == pytest.approx(expected)


@pytest.mark.parametrize("raw", ["0", "-0.1", "1.5", "101%", "nan", "inf", "", "lots", True, None])
def test_bad_shares_name_the_value(raw: object) -> None:
    with pytest.raises(UsageError) as info:
        parse_share_option(raw, "--rollup-share")
    assert str(info.value) == (
        f"--rollup-share: expected a share of time in (0, 1] such as 0.001, 0.1% or 1, got {raw!r}"
    )


# --- --gpu-leak-warn with --gpu-leak-mode -------------------------------------------------


def test_warn_flag_alone_sets_warn_and_names_itself() -> None:
    options = resolve_check_options({"warn": True, "mode": None}, {"LEAKCHECK_MODE": "fail"}, {})
    assert options.mode == "warn"
    assert options.sources["mode"] == "--gpu-leak-warn (command line)"
    for warn in (None, False):  # not given: the environment's mode stands
        options = resolve_check_options({"warn": warn, "mode": None}, {"LEAKCHECK_MODE": "fail"})
        assert options.sources["mode"] == "LEAKCHECK_MODE (environment)"


def test_warn_flag_agrees_with_mode_warn() -> None:
    options = resolve_check_options({"warn": True, "mode": "warn"}, {}, {})
    assert options.mode == "warn"
    assert options.sources["mode"] == "--gpu-leak-mode (command line)"


def test_warn_flag_contradicts_mode_fail() -> None:
    with pytest.raises(UsageError) as info:
        resolve_check_options({"warn": True, "mode": "fail"}, {}, {})
    message = str(info.value)
    assert message == (
        "--gpu-leak-warn (command line): contradicts --gpu-leak-mode 'fail'; pass one of them"
    )
    with pytest.raises(UsageError, match="contradicts --gpu-leak-mode 'FAIL'"):
        resolve_check_options({"warn": True, "mode": "FAIL"})
    # A bad mode is named as such first.
    with pytest.raises(UsageError, match="--gpu-leak-mode \\(command line\\): expected one of"):
        resolve_check_options({"warn": True, "mode": "explode"})


def test_a_bare_marker_enables_its_test() -> None:
    options = apply_marker(CheckOptions(), (), {}, where="gpu_leak_check marker on t.py::t")
    assert options.enabled is True
    assert options.sources["enabled"].startswith("enabled= of gpu_leak_check marker")
