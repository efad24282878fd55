"""pytest plugin of the device check: `python -m pytest -p scripts.device_pytest_plugin ...`.

- installs the import guard (no Ray, no vLLM; vendored packages from the vendor folder), before any
  conftest imports rlcore;
- gives rlcore's two Ray modules stand-ins whose classes fail on use: test modules import
  ``RayWorkerGroup`` / ``RayResourcePool`` at the top, and without this they would not even collect;
  their Ray tests still skip, through the ``ray_cluster`` fixture's ``importorskip("ray")``;
- ``--device-default DIR=DEVICE`` makes ``DEVICE`` torch's default device while the tests under DIR
  run: the algos tests build plain tensors, so that is what puts their math on the GPU (the worker
  tests need nothing: their ``trainer.device`` is ``auto``);
- ``--results-json FILE`` writes each test's outcome, and the first line of each failure.
"""

from __future__ import annotations

import json
import sys
import time
import types
from pathlib import Path

from scripts import device_guard

device_guard.install()

# after the guard, like everything the tests import
import pytest
import torch

RAY_MODULES = {"rlcore.single_controller.ray_group": ("RayWorkerGroup",),
               "rlcore.single_controller.resource_pool": ("RayResourcePool", "ResourceError")}


def _ray_stand_in(name: str) -> type:
    def refuse(self, *args, **kwargs):
        raise ModuleNotFoundError(f"{name} needs ray, which the device check runs without")
    return type(name, (Exception,) if name.endswith("Error") else (), {"__init__": refuse})


for _module, _names in RAY_MODULES.items():
    sys.modules[_module] = types.ModuleType(_module, "stand-in: ray is not available (scripts/device_pytest_plugin.py)")
    for _name in _names:
        setattr(sys.modules[_module], _name, _ray_stand_in(_name))

_results: dict = {"passed": [], "failed": [], "skipped": [], "errors": []}
_defaults: list[tuple[Path, str]] = []


def pytest_addoption(parser) -> None:
    group = parser.getgroup("device check")
    group.addoption("--device-default", action="append", default=[], metavar="DIR=DEVICE",
                    help="torch's default device for the tests under DIR")
    group.addoption("--results-json", default=None, help="write the outcomes here")


def pytest_configure(config) -> None:
    for spec in config.getoption("--device-default"):
        folder, _, device = spec.rpartition("=")
        _defaults.append((Path(folder).resolve(), device))
    _results["started"] = time.time()


@pytest.hookimpl(tryfirst=True)  # before the fixtures are set up
def pytest_runtest_setup(item) -> None:
    path = Path(str(item.fspath)).resolve()
    device = next((d for folder, d in _defaults if path.is_relative_to(folder)), None)
    torch.set_default_device(device)  # None: back to CPU for the next test


def pytest_runtest_logreport(report) -> None:
    if report.when == "call" or report.outcome != "passed":
        key = {"passed": "passed", "skipped": "skipped"}.get(report.outcome, "failed" if report.when == "call" else "errors")
        entry = report.nodeid
        if report.outcome == "failed":
            lines = str(report.longrepr).strip().splitlines()
            errors = [ln for ln in lines if ln.startswith("E ")]
            entry = {"test": report.nodeid, "when": report.when, "error": (errors or lines or ["?"])[0][:300]}
        _results[key].append(entry)


def pytest_collectreport(report) -> None:
    """A module that skips as a whole (importorskip("vllm")) or fails to import (on the device: a
    dependency the image lacks)."""
    if report.skipped:
        _results["skipped"].append(report.nodeid)
    elif report.failed:
        lines = str(report.longrepr).strip().splitlines()
        _results["errors"].append({"test": report.nodeid, "when": "collect", "error": (lines or ["?"])[-1][:300]})


def pytest_sessionfinish(session, exitstatus) -> None:
    path = session.config.getoption("--results-json")
    if path:
        summary = {k: len(v) for k, v in _results.items() if isinstance(v, list)}
        out = {"counts": summary, "exitstatus": int(exitstatus), "seconds": time.time() - _results["started"],
               "failures": _results["failed"] + _results["errors"], "skipped": _results["skipped"],
               "imports": device_guard.audit()}
        Path(path).write_text(json.dumps(out, indent=1))
