"""pytest plugin: ``pytest --gpu-leak-check`` fails the test that leaked.

A test fails (or warns) when, after its teardown, it left a process it started still running,
a ``/dev/shm`` file it created, or GPU memory held by the test process beyond the tolerance.
``plugin_observe.Checker`` observes each test as one short epoch and ``verdict.judge`` decides,
with ``watch()``'s rules and words. Under pytest-xdist each worker judges its own tests and the
findings travel to the controller on the reports. Registered through the ``pytest11`` entry
point ``leakcheck``; ``-p no:leakcheck`` disables it.

NOTE [off means off]: with the check off, loading the plugin costs options parsing and nothing
else (no NVML, no /proc reads, no threads, no torch). The environment and the ini file are read
and validated only when some test is checked (the flag, the environment or ini switch, a
marker, or the ``gpu_leak_tracker`` fixture); then a bad value is a usage error naming its
source. The switch and the command line are always read.

NOTE [where the verdict goes]: the check runs in a wrapper of ``pytest_runtest_makereport`` for
the teardown phase: the function-scoped fixtures are finalized by then, and the report it fails
is the test's own, so terminals, ``--junitxml``, ``--lf``, ``-x`` and xdist all name the test.

NOTE [said once]: a finding is written once, in its test's ``gpu-leak-check`` section; the
failure's message is one sentence (``the test left 1 process (PID 7)``; a wide-scope fixture
that ended with the test is named instead) and the ``LEAK REPORT``
counts per test. Where no failure shows the section (a warning, a skip, an xfail or xpass,
information only), the findings go under the test's line of the ``LEAK REPORT``.

NOTE [counted once]: a checked test that passed its call is counted at its teardown, as
``passed`` or ``failed`` (``LEAKED``): N tests with one leak read "1 failed, N-1 passed". A test
that failed, errored, was skipped, xfailed or xpassed before keeps that outcome; a leak adds its
section and a summary line. A test skipped before its call that left nothing is not counted.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import warnings
from collections import Counter
from collections.abc import Generator, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import pytest

from leakcheck.core.errors import LeakError, LeakWarning, UsageError, one_line
from leakcheck.core.options import (
    ENABLED,
    MODE,
    SPECS,
    WARN_FLAG,
    CheckOptions,
    apply_marker,
    resolve,
    resolve_check_options,
)
from leakcheck.core.records import record_from_dict, to_jsonable
from leakcheck.core.units import format_mib, plural

if TYPE_CHECKING:
    from leakcheck.adapters.plugin_observe import Checker, Window
    from leakcheck.core.model import Finding
    from leakcheck.track.tracker import Tracker

__all__ = ["MARKER", "SECTION", "LeakCheckPlugin", "gpu_leak_tracker", "headline"]

MARKER = "gpu_leak_check"
"""Name of the marker that enables, disables or tunes the check per test."""

SECTION = "gpu-leak-check"
"""Name of the report section that lists a test's findings."""

CHECKER_NAME = "leakcheck-checker"  # the active part of the plugin, once registered
REPORT_ATTR = "leakcheck"  # teardown reports: the JSON verdict (to xdist's controller)
COUNT_ATTR = "leakcheck_count"  # NOTE [counted once]: ``deferred`` or (teardown) ``leaked``
COUNTED = ("counted", "skipped")  # a test's outcome before its teardown, when pytest counted it

_WARN_DEST = "gpu_leak_warn"
_METAVARS = {"tolerance": "SIZE", "mode": "fail|warn", "grace": "SECONDS", "copy_tolerance": "SIZE"}

OPTIONS_KEY = pytest.StashKey[CheckOptions]()
ITEM_OPTIONS_KEY = pytest.StashKey[CheckOptions]()
WINDOW_KEY = pytest.StashKey["Window"]()
EARLIER_KEY = pytest.StashKey[str]()  # "deferred", one of COUNTED, or "": NOTE [counted once]


# --- options ------------------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add the ``leakcheck`` option group and ini keys (``SPECS``; dest: the ini key)."""
    group = parser.getgroup("leakcheck", "leakcheck: processes, /dev/shm and GPU memory leaks")
    for spec in SPECS:
        if spec is MODE:
            group.addoption(
                WARN_FLAG,
                action="store_true",
                dest=_WARN_DEST,
                help="warn about leaks instead of failing the test (--gpu-leak-mode=warn)",
            )
        kind = {"action": "store_true"} if spec is ENABLED else {"metavar": _METAVARS[spec.name]}
        group.addoption(
            str(spec.cli_flag),
            dest=spec.ini_key,
            default=None,
            help=f"{spec.help} (env {spec.env_var}, ini {spec.ini_key})",
            **kind,
        )
        if spec is ENABLED:
            group.addoption(
                "--no-gpu-leak-check",
                action="store_false",
                dest=spec.ini_key,
                help="do not check, whatever the environment or the ini file say",
            )
        parser.addini(str(spec.ini_key), help=f"leakcheck: {spec.help}", type="string", default="")


def resolve_options(config: pytest.Config, *, full: bool = False) -> CheckOptions:
    """The session's options (command line > environment > ini > default).

    Every source is read where ``full`` or the check is on (NOTE [off means off]); a bad value
    is a ``pytest.UsageError`` naming its source.
    """
    ini = {spec.name: config.getini(str(spec.ini_key)) for spec in SPECS}
    ini_path = str(config.inipath) if config.inipath else None
    cli = {spec.name: config.getoption(str(spec.ini_key), None) for spec in SPECS}
    cli["warn"] = True if config.getoption(_WARN_DEST, False) else None
    try:
        enabled = resolve(
            ENABLED, cli=cli["enabled"], environ=os.environ, ini=ini["enabled"], ini_path=ini_path
        )
        if enabled.value or full:
            return resolve_check_options(cli, os.environ, ini, ini_path=ini_path)
        resolve_check_options(cli)  # the command line alone
    except UsageError as exc:
        raise pytest.UsageError(str(exc)) from None
    return CheckOptions(enabled=False, sources={"enabled": enabled.source})


def _activate(config: pytest.Config, options: CheckOptions) -> None:
    plugin = config.pluginmanager.get_plugin(CHECKER_NAME)
    if plugin is None:
        config.pluginmanager.register(LeakCheckPlugin(config, options), CHECKER_NAME)
    elif isinstance(plugin, LeakCheckPlugin):
        plugin.options = options


def pytest_configure(config: pytest.Config) -> None:
    """Register the marker, resolve the options, and activate the check if asked."""
    config.addinivalue_line(
        "markers",
        f"{MARKER}(enabled=True, tolerance='16MiB', mode='fail', grace=1.0, "
        "copy_tolerance='64MiB'): check this test "
        "for processes, /dev/shm files and GPU memory it leaves behind, or not "
        "(enabled=False); overrides --gpu-leak-check/--gpu-leak-tolerance for it",
    )
    try:
        options = resolve_options(config)
    except pytest.UsageError:
        if config.option.help:
            return  # --help must work even with a bad LEAKCHECK_* value around
        raise
    config.stash[OPTIONS_KEY] = options
    # The controller of xdist runs no test; it gathers the workers' verdicts.
    controller = not hasattr(config, "workerinput") and getattr(config.option, "dist", "no") != "no"
    if options.enabled or controller:
        _activate(config, options)


def _marked_options(options: CheckOptions, item: pytest.Item) -> CheckOptions:
    where = f"{MARKER} marker on {item.nodeid}"
    try:
        for marker in reversed(list(item.iter_markers(MARKER))):  # farthest (module) first
            options = apply_marker(options, marker.args, marker.kwargs, where=where)
    except UsageError as exc:
        raise pytest.UsageError(str(exc)) from None
    return options


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    """Validate markers and resolve per-test options; a marker may enable a single test."""
    base = config.stash.get(OPTIONS_KEY, None)
    if base is None:
        return
    marked = {item: _marked_options(base, item) for item in items}
    if not base.enabled and any(
        options.enabled or "gpu_leak_tracker" in getattr(item, "fixturenames", ())
        for item, options in marked.items()
    ):
        # Some test is checked after all: every source counts now (NOTE [off means off]).
        base = config.stash[OPTIONS_KEY] = resolve_options(config, full=True)
        marked = {item: _marked_options(base, item) for item in items}
    for item, options in marked.items():
        item.stash[ITEM_OPTIONS_KEY] = options
    if base.enabled or any(options.enabled for options in marked.values()):
        _activate(config, base)


def _options_for(item: pytest.Item) -> CheckOptions:
    return item.stash.get(ITEM_OPTIONS_KEY, item.config.stash.get(OPTIONS_KEY, CheckOptions()))


# --- the fixture --------------------------------------------------------------------------


@pytest.fixture
def gpu_leak_tracker(request: pytest.FixtureRequest) -> Iterator[Tracker]:
    """A started ``leakcheck.Tracker`` bound to this test; use ``.epoch()`` inside it.

    Where the check is on, its findings join the test's; elsewhere its teardown fails (or
    warns) on a leak, unless a ``gpu_leak_check(enabled=False)`` marker says not.
    """
    from leakcheck.track.tracker import Tracker

    item = request.node
    options = _options_for(item)
    tracker = Tracker(
        tolerance=options.tolerance_bytes,
        grace=options.grace_s,
        copy_tolerance=options.copy_tolerance_bytes,
    )
    tracker.start()
    window = item.stash.get(WINDOW_KEY, None)
    if window is not None:
        window.tags.add(tracker.session_id)
    try:
        yield tracker
    finally:
        tracker.close()
    report = tracker.report()
    if window is not None:
        window.extra.extend(report.findings)
        return
    by_marker = options.sources.get("enabled", "").startswith("enabled=")
    if not report.leaks or (by_marker and not options.enabled):
        return
    if options.mode == "warn":
        warnings.warn(LeakWarning(report.format()), stacklevel=1)
    else:
        raise LeakError(report.format(), report)


# --- words --------------------------------------------------------------------------------

TEST_LABEL = "the test"  # NOTE [one short epoch] in plugin_observe.py

_PROCESS_RULES = ("survivor", "orphan")


def headline(findings: Sequence[Finding]) -> str:
    """What findings are about, counted: ``1 process (612 MiB GPU), 1 /dev/shm file``."""
    processes = [f for f in findings if f.rule in _PROCESS_RULES]
    others = Counter(f.rule for f in findings if f.rule not in _PROCESS_RULES)
    parts: list[str] = []
    if processes:
        held = sum(f.gpu_bytes or 0 for f in processes)
        gpu = f" ({format_mib(held)} MiB GPU)" if held else ""
        parts.append(plural(len(processes), "process", "processes") + gpu)
    if "shm" in others:
        parts.append(plural(others.pop("shm"), "/dev/shm file"))
    if others.pop("residual", 0):
        memory = sum(f.gpu_bytes or 0 for f in findings if f.rule == "residual")
        parts.append(f"{format_mib(memory)} MiB of GPU memory")
    parts.extend(plural(num, f"{rule} finding") for rule, num in others.items())
    return ", ".join(parts) or "nothing"


def owners(leaks: Sequence[Finding]) -> str:
    """Who left ``leaks``: the test, the wide-scope fixtures that ended with it, or both."""
    scopes = sorted({f.scope for f in leaks if f.scope is not None})
    test = [TEST_LABEL] if any(f.scope is None for f in leaks) or not scopes else []
    return " and ".join(test + scopes)


def failure_text(leaks: Sequence[Finding]) -> str:
    """The failure's message, one sentence: ``leakcheck: the test left 1 process (PID 7)``."""
    pids = sorted({f.pid for f in leaks if f.pid is not None and f.rule in _PROCESS_RULES})
    shown = ", ".join(str(pid) for pid in pids[:3]) + (", ..." if len(pids) > 3 else "")
    named = f" (PID{'s' if len(pids) > 1 else ''} {shown})" if pids else ""
    return f"leakcheck: {owners(leaks)} left {headline(leaks)}{named}"


def _worst_first(result: tuple[str, tuple[list[Finding], str, bool]]) -> tuple[int, int, int, str]:
    """More GPU memory first, then more leaks, then more infos, then by node ID."""
    nodeid, (findings, _, _) = result
    leaks = [f for f in findings if f.severity == "leak"]
    return (-sum(f.gpu_bytes or 0 for f in leaks), -len(leaks), -len(findings), nodeid)


def _unattributed(f: Finding) -> bool:
    """A /dev/shm file nobody held that others may have made (not capacity pressure)."""
    return f.rule == "shm" and f.severity == "info" and f.pid is None and f.shm_name is not None


def judge_test(
    checker: Checker, window: Window, label: str, options: CheckOptions, end_s: float
) -> list[Finding]:
    """Observe the test as a timeline and judge it with ``verdict.judge``, leaks first.

    The ``gpu_leak_tracker`` fixture's findings join, but for those the test's own check made
    too (a process and rule already found; /dev/shm files, seen in the same window).
    """
    from leakcheck.core.model import RuleConfig
    from leakcheck.judge.verdict import judge

    tolerance_bytes, grace_s = options.tolerance_bytes, options.grace_s
    timeline = checker.observe(
        window, label=label, end_s=end_s, grace_s=grace_s, tolerance_bytes=tolerance_bytes
    )
    config = RuleConfig(
        tolerance_bytes=tolerance_bytes,
        grace_s=grace_s,
        warmup_epochs=0,
        copy_tolerance_bytes=options.copy_tolerance_bytes,
    )
    # "Attribution is blind" is said once, in the session summary, not for every test.
    findings = [f for f in judge(timeline, config) if f.rule != "blind"]

    # The tracker and the plugin may see one process at different moments: still in the
    # tree for one (survivor), reparented for the other (orphan). Either names it.
    def process_key(f: Finding) -> tuple[int | None, str]:
        return f.pid, "process" if f.rule in _PROCESS_RULES else f.rule

    named = {process_key(f) for f in findings if f.pid is not None}
    # The test's own /dev/shm check covers the fixture's window: its files once, one verdict.
    findings.extend(
        f for f in window.extra if f.rule not in ("blind", "shm") and process_key(f) not in named
    )
    return sorted(findings, key=lambda f: f.severity != "leak")


_XUNIT_SETUPS = {  # pytest's names for the fixtures it makes of xunit-style setups
    "_unittest_setUpClass_fixture_": "setUpClass",
    "_xunit_setup_class_fixture_": "setup_class",
    "_xunit_setup_module_fixture_": "setup_module",
}


def _scope_label(fixturedef: pytest.FixtureDef[Any]) -> str:
    """``module-scoped fixture 'pool'``, or ``setUpClass of Loaders`` (not pytest's name)."""
    for prefix, setup in _XUNIT_SETUPS.items():
        if fixturedef.argname.startswith(prefix):
            return f"{setup} of {fixturedef.argname[len(prefix) :]}"
    return f"{fixturedef.scope}-scoped fixture '{fixturedef.argname}'"


# --- the active part ----------------------------------------------------------------------


class LeakCheckPlugin:
    """Hooks that check each enabled test and gather the verdicts for the summary."""

    def __init__(self, config: pytest.Config, options: CheckOptions) -> None:
        self.config = config
        self.options = options
        self._checker: Checker | None = None
        self._window: Window | None = None
        self._checked = 0
        # Per test: its findings, its status, and whether a failure shows its section.
        self._results: dict[str, tuple[list[Finding], str, bool]] = {}
        self._unattributed: set[str] = set()  # /dev/shm files of no test
        self._gpu_notes: set[str] = set()

    # -- per test ------------------------------------------------------------------------

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, None, None]:
        """Snapshot before any fixture of the test is set up."""
        if _options_for(item).enabled:
            try:
                if self._checker is None:
                    from leakcheck.adapters.plugin_observe import Checker

                    self._checker = Checker()
                window = self._checker.begin()
            except Exception as exc:  # never break a run for leakcheck's sake
                self._gpu_notes.add(f"a test went unchecked: {one_line(exc)}")
            else:
                item.stash[WINDOW_KEY] = self._window = window
        return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(
        self, fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest
    ) -> Generator[None, object, object]:
        """Record what a class/module/package/session fixture starts as that fixture's own."""
        window = self._window
        if window is None or fixturedef.scope == "function" or self._checker is None:
            return (yield)
        with self._checker.fixture_scope(fixturedef, _scope_label(fixturedef), window):
            return (yield)

    def pytest_fixture_post_finalizer(
        self, fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest
    ) -> None:
        """A wide-scope fixture ended: what it owned is judged with the current test."""
        if self._checker is not None and fixturedef.scope != "function":
            # Outside a checked test (its last user was not checked) nobody is judged.
            self._checker.fixture_finished(fixturedef, judge=self._window is not None)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        """After the teardown phase: judge the test and fail (or warn) its teardown report."""
        report = yield
        earlier = "" if call.when == "setup" else item.stash.get(EARLIER_KEY, "")
        if call.when != "teardown":
            if report.failed or report.skipped or hasattr(report, "wasxfail"):
                # Counted already, as a failure, a skip, an xfail or an xpass (NOTE
                # [counted once]): a leak adds its section, not a second outcome.
                earlier = "skipped" if report.skipped and call.when == "setup" else "counted"
            elif call.when == "call" and WINDOW_KEY in item.stash and report.passed:
                earlier = "deferred"
            item.stash[EARLIER_KEY] = earlier
        if earlier == "deferred":
            setattr(report, COUNT_ATTR, "deferred")
        window = item.stash.get(WINDOW_KEY, None)
        checker = self._checker
        if call.when != "teardown" or window is None or checker is None:
            return report
        # pytest lets go of the test's fixture values only after this hook: what they alone
        # keep (a loader's persistent workers) would outlive the test here, never after it.
        if isinstance(getattr(item, "funcargs", None), dict):
            item.funcargs = {}  # type: ignore[attr-defined]
        if earlier == "counted":
            # Nor of a failure's traceback before the next test's call; it sits in a reference
            # cycle of pytest's frames. What only the failure keeps (a local iterator) is no leak.
            for name in ("last_type", "last_value", "last_traceback", "last_exc"):
                sys.__dict__.pop(name, None)
            gc.collect()
        end_s = time.monotonic()
        del item.stash[WINDOW_KEY]
        self._window = None
        options = _options_for(item)
        try:
            findings = judge_test(checker, window, TEST_LABEL, options, end_s)
        except Exception as exc:  # leakcheck's own failure must never break a test run
            from leakcheck.core.model import Finding

            message = f"leakcheck could not check this test: {one_line(exc)}"
            remedy = "report it to leakcheck with the message above"
            findings = [Finding("tracker-failure", "info", message, remedy)]
        finally:
            checker.end_environment(window)
        try:
            status = self._verdict(item, report, findings, options.mode, earlier)
            payload = {"status": status, "gpu": checker.gpu_note, "earlier": earlier}
            setattr(report, REPORT_ATTR, json.dumps(payload | {"findings": to_jsonable(findings)}))
        except Exception as exc:  # an exception here would be pytest's INTERNALERROR
            self._gpu_notes.add(f"a test went unreported: {one_line(exc)}")
        return report

    def _verdict(
        self,
        item: pytest.Item,
        report: pytest.TestReport,
        findings: list[Finding],
        mode: str,
        earlier: str,
    ) -> str:
        """Add the section; warn about leaks, or fail the teardown report. Returns the status."""
        from leakcheck.judge.report import finding_lines

        leaks = [f for f in findings if f.severity == "leak"]
        # Under xdist, a file no test can be tied to is said once, in the summary: its
        # time window is not this test's alone.
        alone = os.environ.get("PYTEST_XDIST_WORKER") is None
        shown = [f for f in findings if alone or not _unattributed(f)]
        if shown:
            report.sections.append((SECTION, "\n".join(finding_lines(shown))))
        if not leaks:
            return ""
        # For tools that read JUnit: each leak's line, as the section words it.
        lines = "\n".join(finding_lines(leaks)).splitlines()
        said = "; ".join(line for line in lines if not line.lstrip().startswith("fix: "))
        report.user_properties.append(("gpu_leak_check", said))
        if mode == "warn":
            try:
                warnings.warn(LeakWarning(failure_text(leaks)), stacklevel=1)
                return "warned"
            except LeakWarning:  # -W error: the user asked for warnings to fail
                pass
        if earlier in COUNTED or report.failed:
            return "reported"  # the test or a fixture's teardown failed already: add our section
        # A report built the way pytest builds one for `pytest.fail(..., pytrace=False)`:
        # a short message (no plugin traceback) that xdist and JUnit carry as usual.
        text = failure_text(leaks)
        failure = pytest.TestReport.from_item_and_call(
            item, pytest.CallInfo.from_call(lambda: pytest.fail(text, pytrace=False), "teardown")
        )
        report.outcome = "failed"
        report.longrepr = failure.longrepr
        setattr(report, COUNT_ATTR, "leaked")
        return "leaked"

    @pytest.hookimpl(tryfirst=True)
    def pytest_report_teststatus(
        self, report: pytest.TestReport | pytest.CollectReport, config: pytest.Config
    ) -> tuple[str, str, str | tuple[str, dict[str, bool]]] | None:
        """Count a checked test once, at its teardown (NOTE [counted once])."""
        count = getattr(report, COUNT_ATTR, None)
        if count == "leaked" and report.failed:
            return "failed", "L", ("LEAKED", {"red": True})
        if count != "deferred":
            return None
        if report.when == "call":
            return "", "", ""
        if report.when == "teardown" and report.passed:
            return "passed", ".", ("PASSED", {"green": True})
        return None  # a fixture's teardown failed: pytest counts the error

    # -- the summary ---------------------------------------------------------------------

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Gather verdicts (here, or from xdist workers on the controller)."""
        payload = getattr(report, REPORT_ATTR, None)
        if report.when != "teardown" or not isinstance(payload, str):
            return
        from leakcheck.core.model import Finding

        try:
            data = json.loads(payload)
            findings = [record_from_dict(Finding, entry) for entry in data.get("findings", [])]
        except (ValueError, TypeError, AttributeError):
            return
        if data.get("earlier") == "skipped" and not findings:
            return  # NOTE [counted once]: nothing of it ran
        self._checked += 1
        if data.get("gpu"):
            self._gpu_notes.add(str(data["gpu"]))
        if not findings:
            return
        shown = report.failed  # pytest shows a failed report's sections
        if data.get("earlier") in COUNTED:
            shown = self._attach_to_failure(report) or shown
        # Files nothing ties to a test are nobody's to blame (NOTE [job shm]): one line for
        # all of them in the summary, not one entry per test.
        self._unattributed.update(str(f.shm_name) for f in findings if _unattributed(f))
        kept = [f for f in findings if not _unattributed(f)]
        if kept:
            self._results[report.nodeid] = (kept, str(data.get("status") or ""), shown)

    def _attach_to_failure(self, report: pytest.TestReport) -> bool:
        """Show a test's section with its earlier failure; False: none shows it (a skip)."""
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        stats = getattr(reporter, "stats", None)
        sections = [(name, text) for name, text in report.sections if name == SECTION]
        if hasattr(self.config, "workerinput") or not isinstance(stats, dict) or not sections:
            return False
        for failure in (*stats.get("failed", []), *stats.get("error", [])):
            when = getattr(failure, "when", None)
            if getattr(failure, "nodeid", None) == report.nodeid and when in ("setup", "call"):
                failure.sections.extend(sections)
                return True
        return False

    def pytest_terminal_summary(
        self, terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config
    ) -> None:
        """Print the ``LEAK REPORT``: a line per test that left something, worst first.

        NOTE [said once]; ``GPU LEAK REPORT`` where some finding is about GPU memory.
        """
        from leakcheck.judge.report import about_gpu, finding_lines, gpu_unchecked

        if hasattr(config, "workerinput") or (not self._checked and not self.options.enabled):
            return
        tr = terminalreporter
        notes = {
            "GPU: checked (NVML)" if n == "NVML" else gpu_unchecked(n) for n in self._gpu_notes
        }
        gpu = "; ".join(sorted(notes)) or "no test checked"
        checked = plural(self._checked, "checked test")
        results = sorted(self._results.items(), key=_worst_first)
        leaky = sum(any(f.severity == "leak" for f in entry[0]) for _, entry in results)
        title = (
            "GPU LEAK REPORT" if about_gpu(f for _, e in results for f in e[0]) else "LEAK REPORT"
        )
        if not results:
            tr.write_sep("=", f"{title}: no leaks in {checked}; {gpu}", green=True)
        else:
            tr.write_sep("=", title, red=bool(leaky), yellow=not leaky)
            tr.write_line(f"{leaky} of {checked} left something behind; {gpu}")
        for nodeid, (findings, status, shown) in results:
            leaks = [f for f in findings if f.severity == "leak"]
            word = "WARNED" if status == "warned" else "LEAKED" if leaks else "INFO"
            by = owners(leaks) if leaks else TEST_LABEL
            left_by = f", left by {by}" if by != TEST_LABEL else ""
            tr.write_line(f"{word} {nodeid}: {headline(leaks or findings)}{left_by}", bold=True)
            if not shown:
                for line in finding_lines(findings, "    "):
                    tr.write_line(line)
        # Under xdist, a file one test is blamed for appeared in its neighbours' windows too.
        blamed = {f.shm_name for findings, _, _ in self._results.values() for f in findings}
        unattributed = self._unattributed - blamed
        if unattributed:
            files = plural(len(unattributed), "/dev/shm file")
            tr.write_line(
                f"{files} appeared while tests ran, and nothing tied them to a test (held by "
                "none of its processes, named after none, not made by the test process): "
                "not attributed"
            )
