"""Actor -> vLLM rollout weight sync: after one real optimizer step of the FSDP actor, the rollout's
greedy output must equal a hand greedy loop over an HF model holding the actor's new weights.

Three paths: the hybrid engine in one process (LocalWorkerGroup, in-memory ``sync_weights``), the
hybrid engine over two Ray ranks (FSDP full state dict lands on rank 0, then is broadcast), and
separate Ray pools (``update_weights`` fed the actor group's non-blocking RANK_ZERO future, handed
to the rollout rank as an object ref). One prompt is longer than vLLM's CPU KV block (128 tokens),
so a prefix cache left stale by a sync would show up as a mismatch.
"""

import pytest
import torch
from rollout_fixtures import PROMPTS, hand_greedy, make_prompts, unpadded
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlcore.models.tiny import build_tiny_model
from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup, create_colocated_worker_cls
from rlcore.workers.actor import ActorWorker
from rlcore.workers.rollout import RolloutWorker

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slow, pytest.mark.vllm]

MAX_NEW = 12
LONG_PROMPT = "".join(f"{i}+{i}={2 * i}, " for i in range(20))  # 150 characters = 150 tokens
SYNC_PROMPTS = [*PROMPTS[:3], LONG_PROMPT]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_sync"), seed=0)


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def _classes(model_dir):
    actor = ClassWithInitArgs(ActorWorker, {"model": {"path": model_dir}, "actor": {"lr": 1e-3}})
    rollout = ClassWithInitArgs(RolloutWorker, {"model": {"path": model_dir}, "rollout": {
        "backend": "vllm", "dtype": "float32", "max_new_tokens": MAX_NEW,
        "kv_cache_memory_bytes": 1 << 28, "max_model_len": 256}})
    return actor, rollout


def _train_one_step(generate, compute_log_prob, update_policy, tok) -> None:
    """One PPO step on sampled responses: +1 advantage for even rows, -1 for odd rows.

    On the way, the actor's old_log_probs (it reads the temperature from the rollout's meta_info)
    must equal the fp32 engine's rollout_log_probs: the premise of rollout importance sampling.
    """
    batch = generate(make_prompts(tok, meta_info={"n": 2, "temperature": 0.7}))
    batch.union(compute_log_prob(batch))
    mask = batch.batch["response_mask"].bool()
    torch.testing.assert_close(batch.batch["old_log_probs"][mask], batch.batch["rollout_log_probs"][mask],
                               atol=1e-4, rtol=0)
    sign = torch.where(torch.arange(len(batch)) % 2 == 0, 1.0, -1.0).unsqueeze(1)
    batch.batch["advantages"] = sign * batch.batch["response_mask"]
    update_policy(batch)


def _validate(generate, tok):
    return generate(make_prompts(tok, SYNC_PROMPTS, {"validate": True}))


def _assert_hf_greedy(out, model_dir, state_dict, tok) -> None:
    """Token for token equal to greedy decoding of an HF model loaded with ``state_dict``."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    model.load_state_dict(state_dict)
    prompts = make_prompts(tok, SYNC_PROMPTS)
    for row in range(len(SYNC_PROMPTS)):
        prompt = unpadded(prompts.batch["input_ids"][row], prompts.batch["attention_mask"][row])
        expected = hand_greedy(model, prompt, MAX_NEW, {tok.eos_token_id})
        length = int(out.batch["response_mask"][row].sum())
        assert out.batch["responses"][row, :length].tolist() == expected, f"row {row}"


def _check_sync(before, stale, after, new_state, model_dir, tok) -> None:
    assert torch.equal(stale.batch["responses"], before.batch["responses"])  # nothing changes without a sync
    assert not torch.equal(after.batch["responses"], before.batch["responses"])
    _assert_hf_greedy(after, model_dir, new_state, tok)


def test_hybrid_engine_syncs_in_memory(model_dir, tok):
    actor, rollout = _classes(model_dir)
    wg = LocalWorkerGroup(create_colocated_worker_cls({"actor": actor, "rollout": rollout}))
    wg.actor_init_model()  # the actor first: it sets up torch.distributed, which vLLM then reuses
    wg.rollout_init_model()
    before = _validate(wg.rollout_generate_sequences, tok)
    _assert_hf_greedy(before, model_dir, AutoModelForCausalLM.from_pretrained(model_dir).state_dict(), tok)
    _train_one_step(wg.rollout_generate_sequences, wg.actor_compute_log_prob, wg.actor_update_policy, tok)
    stale = _validate(wg.rollout_generate_sequences, tok)
    [metrics] = wg.rollout_sync_weights()
    assert metrics["rollout/weight_sync_s"] > 0
    after = _validate(wg.rollout_generate_sequences, tok)
    _check_sync(before, stale, after, wg.actor_get_full_state_dict(), model_dir, tok)
    # what the sync handed the engine: the actor's own tensors (no second copy), equal to the snapshot
    actor_worker = wg.worker(0, "actor")
    handed, snapshot = actor_worker.full_weights_uncopied(), wg.actor_get_full_state_dict()
    assert handed.keys() == snapshot.keys() and all(torch.equal(handed[k], snapshot[k]) for k in handed)
    params = {(p.to_local() if hasattr(p, "to_local") else p).data_ptr() for p in actor_worker.module.parameters()}
    assert {t.data_ptr() for t in handed.values()} <= params
    assert not {t.data_ptr() for t in snapshot.values()} & params


def test_hybrid_engine_on_two_ray_ranks(model_dir, tok, ray_cluster):
    from rlcore.single_controller import RayResourcePool, RayWorkerGroup

    actor, rollout = _classes(model_dir)
    pool = RayResourcePool([2], num_cpus_per_process=1, name_prefix="sync_hybrid")
    wg = RayWorkerGroup(pool, create_colocated_worker_cls({"actor": actor, "rollout": rollout}))
    try:
        wg.actor_init_model()
        wg.rollout_init_model()
        before = _validate(wg.rollout_generate_sequences, tok)
        _train_one_step(wg.rollout_generate_sequences, wg.actor_compute_log_prob, wg.actor_update_policy, tok)
        stale = _validate(wg.rollout_generate_sequences, tok)
        assert len(wg.rollout_sync_weights()) == 2
        after = _validate(wg.rollout_generate_sequences, tok)  # rows 0-1 from rank 0, rows 2-3 from rank 1
        _check_sync(before, stale, after, wg.actor_get_full_state_dict(), model_dir, tok)
    finally:
        wg.shutdown()
        pool.shutdown()


def test_separate_pools_sync_through_object_store(model_dir, tok, ray_cluster):
    from rlcore.single_controller import RayResourcePool, RayWorkerGroup

    actor, rollout = _classes(model_dir)
    actor_pool = RayResourcePool([1], num_cpus_per_process=1, name_prefix="sync_actor")
    rollout_pool = RayResourcePool([1], num_cpus_per_process=1, name_prefix="sync_rollout")
    actor_wg, rollout_wg = RayWorkerGroup(actor_pool, actor), RayWorkerGroup(rollout_pool, rollout)
    try:
        actor_wg.init_model()
        rollout_wg.init_model()
        assert actor_wg.worker_info[0]["pid"] != rollout_wg.worker_info[0]["pid"]
        before = _validate(rollout_wg.generate_sequences, tok)
        _train_one_step(rollout_wg.generate_sequences, actor_wg.compute_log_prob, actor_wg.update_policy, tok)
        stale = _validate(rollout_wg.generate_sequences, tok)
        future = actor_wg.get_full_state_dict.options(blocking=False)()
        assert future.single_result_ref is not None  # the rollout reads it from the object store
        [metrics] = rollout_wg.update_weights(future)
        assert metrics["rollout/weight_sync_s"] > 0
        after = _validate(rollout_wg.generate_sequences, tok)
        _check_sync(before, stale, after, future.get(), model_dir, tok)
    finally:
        for group in (actor_wg, rollout_wg):
            group.shutdown()
        actor_pool.shutdown()
        rollout_pool.shutdown()
