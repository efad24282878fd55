"""Shared fixtures: one local Ray instance for the whole session (fractional CPUs per actor)."""

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def ray_worker_pythonpath() -> str:
    """Ray workers import worker classes by module name: give them the test folders pytest put on sys.path."""
    inside = [p for p in sys.path if p and Path(p).resolve().is_relative_to(REPO)]
    return os.pathsep.join(dict.fromkeys([str(REPO), *inside, os.environ.get("PYTHONPATH", "")]))


@pytest.fixture(scope="session")
def ray_cluster():
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        os.environ["PYTHONPATH"] = ray_worker_pythonpath()
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
