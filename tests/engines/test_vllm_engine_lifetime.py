"""In-process vLLM engines one after the other in one process (a notebook's runs, a run resumed in
the same process, the test suite): the end of one must not break the next.

vLLM's in-process ``EngineCore.shutdown`` destroys the process's parallel groups, which the next
engine reuses. Left to a finalizer, it ran whenever the garbage collector reached the dropped engine
(vLLM freezes the collector's objects while an engine lives, so that could be much later), and broke
the engine then in use. An in-process group's shutdown now closes its engines at once.
"""

import gc

import pytest
from engine_fixtures import make_prompts

from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup
from rlcore.workers import RolloutWorker

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def vllm_rollout(model_dir: str) -> LocalWorkerGroup:
    config = {"model": {"path": model_dir}, "rollout": {"backend": "vllm", "dtype": "float32", "max_new_tokens": 4,
                                                        "kv_cache_tokens": 2048, "max_model_len": 64, "do_sample": False}}
    group = LocalWorkerGroup(ClassWithInitArgs(RolloutWorker, config))
    group.init_model()
    return group


def test_a_shut_down_groups_engine_is_closed_at_once_and_leaves_the_next_working(model_dir, tok):
    first = vllm_rollout(model_dir)
    client = first.worker().engine.llm.llm_engine.engine_core
    first.shutdown()
    assert not client._finalizer.alive  # vLLM's teardown ran now, not at a collection to come
    second = vllm_rollout(model_dir)
    gc.unfreeze()  # as another engine's shutdown does: whatever was dropped is collectable
    gc.collect()
    out = second.generate_sequences(make_prompts(tok))
    assert out.batch["responses"].shape[1] == 4
    second.shutdown()
