"""Shared fixtures: one local Ray instance for the whole session (fractional CPUs per actor), and the
seed-0 tiny model (directory, tokenizer, HF reference model) that engine and rollout tests compare against,
built once per module that asks for it (a module may define its own instead).

Run in parallel (``pytest -n 2``, the README's command), each xdist worker takes whole groups
(``test_group``): a test file, or a whole folder where its files share an expensive session fixture (a
model trained once, the SmolLM2 conversion), so no set-up is built twice and a module's fixtures once."""

import os
import sys
from collections import Counter
from pathlib import Path

# Before torch loads (its OpenMP runtime reads this once): threads that finish a parallel region sleep instead of
# spinning for the next one. Tests run small ops between Python lines, and two workers (-n 2) on 2 cores each
# with 2 torch threads: spinning threads took the CPU the other worker needed (tests/workers/test_actor.py and
# tests/algos, one at a time: 27-30 s of CPU spinning, 11 s sleeping). Subprocesses and Ray workers inherit it;
# hence the imports after it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Every Ray instance a test starts (benchmarks and examples call ray.init themselves) runs its workers at the
# driver's priority, as a recipe's does (rlcore.trainer.builder.worker_priority): at Ray's nice 15 they waited
# whenever the other xdist worker computed, and a Ray test's deadlines measured the other test.
os.environ.setdefault("RAY_worker_niceness", "0")

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlcore.models.tiny import build_tiny_model
from preloaded_python import PreloadedPython

REPO = Path(__file__).resolve().parent.parent


def ray_worker_pythonpath() -> str:
    """Ray workers import worker classes by module name: give them the test folders pytest put on sys.path."""
    inside = [p for p in sys.path if p and Path(p).resolve().is_relative_to(REPO)]
    return os.pathsep.join(dict.fromkeys([str(REPO), *inside, os.environ.get("PYTHONPATH", "")]))


# folders whose files share a session fixture too costly to build on both workers (agentic: tool_model_dir,
# agents: framework_model_dir, real_model: smollm2_dir)
SHARED_SET_UP = {"agentic", "agents", "real_model"}
# files of independent commands (no fixture worth sharing): each test a group, so both workers share them
ONE_GROUP_PER_TEST = {"test_benchmarks.py"}


def test_group(nodeid: str) -> str:
    """The unit a parallel run (``pytest -n 2``) hands a worker whole: a test file, so its module fixtures
    are built once; a folder of SHARED_SET_UP, so its session fixture is; a test of ONE_GROUP_PER_TEST."""
    path = nodeid.split("::")[0].removeprefix("tests/")
    folder = path.split("/")[0] if "/" in path else ""
    if path in ONE_GROUP_PER_TEST:
        return nodeid
    return folder if folder in SHARED_SET_UP else path


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: the suite still runs without it, one test at a time
def pytest_xdist_make_scheduler(config, log):
    """xdist's scheduler by scope, the scope being ``test_group`` (its own ``loadgroup`` marks do not reach
    the scheduler under pytest 9, whose node ids it can no longer suffix), handing the groups out in the
    order ``pytest_collection_modifyitems`` gives them: xdist's own reorder (on unless
    ``--no-loadscope-reorder``) sorts them by their number of tests, which left the one-test groups (a
    benchmark's quick run, half a minute each) for last and the heavy few-test files (a Ray + vLLM stop
    test, the worker-group lifetime check) in the middle of the light ones."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return test_group(nodeid)

    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """Groups with end-to-end tests (marked slow or vllm) first, those with the most of them first (the
    longest first, as far as a count tells), so that the last ones handed out are short and the workers
    finish together (the scheduler hands groups out in this order)."""
    heavy = Counter(test_group(item.nodeid) for item in items
                    if item.get_closest_marker("slow") or item.get_closest_marker("vllm"))
    items.sort(key=lambda item: -heavy[test_group(item.nodeid)])  # stable: each group's order kept


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
