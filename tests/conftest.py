"""Shared fixtures: one local Ray instance for the whole session (fractional CPUs per actor), and the
seed-0 tiny model (directory, tokenizer, HF reference model) that engine and rollout tests compare against,
built once per module that asks for it (a module may define its own instead).

Run in parallel (``pytest -n 2``, the README's command), each xdist worker takes whole groups: a test
file, or a whole folder where its files share an expensive session fixture (a model trained once, the
SmolLM2 conversion), so no set-up is built twice and a module's fixtures once."""

import os
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlcore.models.tiny import build_tiny_model
from preloaded_python import PreloadedPython

REPO = Path(__file__).resolve().parent.parent


def ray_worker_pythonpath() -> str:
    """Ray workers import worker classes by module name: give them the test folders pytest put on sys.path."""
    inside = [p for p in sys.path if p and Path(p).resolve().is_relative_to(REPO)]
    return os.pathsep.join(dict.fromkeys([str(REPO), *inside, os.environ.get("PYTHONPATH", "")]))


# folders whose files share a session fixture too costly to build on both workers
SHARED_SET_UP = {"agentic": "tool_model_dir", "agents": "framework_model_dir", "real_model": "smollm2_dir"}
GROUP = pytest.StashKey[str]()
# files of independent commands (no fixture worth sharing): each test a group, so both workers share them
ONE_GROUP_PER_TEST = {"test_benchmarks.py"}


def pytest_collection_modifyitems(config, items):
    """``--dist loadgroup`` sends each xdist_group to one worker whole: a file, or one of SHARED_SET_UP.
    Groups with end-to-end tests (marked slow or vllm) go first, so that the last ones handed out are
    short and the two workers finish together."""
    heavy = set()
    for item in items:
        path = Path(item.fspath).resolve()
        if not path.is_relative_to(REPO / "tests"):
            continue
        path = path.relative_to(REPO / "tests")
        folder = path.parts[0] if len(path.parts) > 1 else ""
        group = item.nodeid if str(path) in ONE_GROUP_PER_TEST else folder if folder in SHARED_SET_UP else str(path)
        item.add_marker(pytest.mark.xdist_group(group))
        item.stash[GROUP] = group
        if item.get_closest_marker("slow") or item.get_closest_marker("vllm"):
            heavy.add(group)
    items.sort(key=lambda item: item.stash.get(GROUP, "") not in heavy)  # stable: each group's order kept


@pytest.fixture(scope="session")
def ray_cluster():
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        os.environ["PYTHONPATH"] = ray_worker_pythonpath()
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray


@pytest.fixture(scope="session")
def preloaded_python(tmp_path_factory):
    """Runs ``python -m MODULE ARGS`` in children of one interpreter that imported torch, Ray & co. once
    (tests/preloaded_python.py): for tests of what a command does, not of how Python starts."""
    runner = PreloadedPython(tmp_path_factory.mktemp("preloaded_python"))
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def ref_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir).eval()
