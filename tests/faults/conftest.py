"""The fault suite's summary: every fault test records one line,

    FAULT <name> | <outcome> | <seconds>s

printed when recorded, appended to the file named by $RLCORE_FAULT_SUMMARY (when set), and printed
again, all together, at the end of the session (so ``pytest -q`` shows them even with output captured).
A fault test that fails before recording gets a line saying so.

Also the suite's one tiny model (built once per session: every fault module runs on it).
"""

from __future__ import annotations

import os
import time

import pytest

from rlcore.models.tiny import build_tiny_model

LINES: list[str] = []


def record_line(name: str, outcome: str, seconds: float) -> str:
    line = f"FAULT {name} | {' '.join(outcome.split())} | {seconds:.1f}s"
    LINES.append(line)
    print(line, flush=True)
    path = os.environ.get("RLCORE_FAULT_SUMMARY")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")
    return line


class Fault:
    """One fault's summary line: ``fault.done("what happened")`` records it with the time since the test began."""

    def __init__(self, name: str) -> None:
        self.name, self.start, self.recorded = name, time.monotonic(), False

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def done(self, outcome: str) -> None:
        record_line(self.name, outcome, self.elapsed())
        self.recorded = True


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.fault_call_report = report


@pytest.fixture
def fault(request):
    """The test's summary line, named after the test (its name without "test_") unless renamed."""
    name = request.node.name.removeprefix("test_")
    f = Fault(name)
    yield f
    report = getattr(request.node, "fault_call_report", None)
    if f.recorded or report is None:
        return
    if report.failed:
        message = str(getattr(report.longrepr, "reprcrash", None) and report.longrepr.reprcrash.message or "")
        record_line(f.name, f"TEST FAILED: {message[:300]}", f.elapsed())
    elif report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        record_line(f.name, f"SKIPPED: {reason.removeprefix('Skipped: ')[:300]}", f.elapsed())


def pytest_terminal_summary(terminalreporter):
    if LINES:
        terminalreporter.section("fault summary")
        for line in LINES:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def fault_model(tmp_path_factory) -> str:
    """The suite's tiny model: small enough that a step takes well under a second on one core."""
    return build_tiny_model(tmp_path_factory.mktemp("fault_model"), hidden_size=32, num_heads=2, num_kv_heads=1)
