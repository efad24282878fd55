"""The hybrid engine's weight update into vLLM in place (rlcore.engines.vllm_worker.InPlacePlan):
after loading another model's weights, greedy vLLM output must be that model's HF greedy output,
token for token, with log-probs to 1e-5 (fp32 engine). Two layouts: llama with its own LM head,
and qwen3 (q/k norms) with tied embeddings (the LM head shares the padded embedding matrix, so
both must be packed again). An update the plan cannot place whole (part of a fused layer) goes
through vLLM's own loader and is just as right.
"""

import pytest
import torch
from engine_fixtures import generate, make_prompts, settings
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlcore.engines import RolloutConfig
from rlcore.engines.hf_engine import HFEngine
from rlcore.models.config import ModelConfig
from rlcore.models.tiny import build_tiny_model

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slow, pytest.mark.vllm]

MAX_NEW = 12
GREEDY = settings(do_sample=False, max_new_tokens=MAX_NEW)
PROMPTS = ["12+3=", "7*8=", "100-99=", "".join(f"{i}+{i}={2 * i}, " for i in range(20))]  # the last > one KV block


def _model(path, arch: str, seed: int, tied: bool) -> str:
    out = build_tiny_model(path, arch=arch, seed=seed)
    if tied:  # the same model with its LM head tied to the embedding
        model = AutoModelForCausalLM.from_pretrained(out)
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
        model.save_pretrained(out)
    return out


@pytest.mark.parametrize("arch, tied", [("llama", False), ("qwen3", True)])
def test_in_place_update_gives_the_new_models_greedy_output(tmp_path, arch, tied):
    from rlcore.engines.vllm_engine import VLLMEngine
    from rlcore.engines.vllm_worker import reload_weights

    start, new = _model(tmp_path / "start", arch, 0, tied), _model(tmp_path / "new", arch, 1, tied)
    tok = AutoTokenizer.from_pretrained(start)
    prompts = make_prompts(tok, PROMPTS)
    engine = VLLMEngine(ModelConfig(path=start), RolloutConfig(
        backend="vllm", dtype="float32", max_new_tokens=MAX_NEW, kv_cache_memory_bytes=1 << 28, max_model_len=256))
    before = generate(engine, prompts, GREEDY)
    new_state = AutoModelForCausalLM.from_pretrained(new).state_dict()
    engine.load_weights(new_state)
    assert engine.last_sync_path == "in_place"
    after = generate(engine, prompts, GREEDY)
    expected = generate(HFEngine(ModelConfig(path=new), RolloutConfig(max_new_tokens=MAX_NEW)), prompts, GREEDY)
    # the update changes the output (a random tied model repeats one token, so compare log-probs too)
    assert not torch.allclose(before.batch["rollout_log_probs"], expected.batch["rollout_log_probs"], atol=1e-3)
    assert torch.equal(after.batch["responses"], expected.batch["responses"])
    assert torch.allclose(after.batch["rollout_log_probs"], expected.batch["rollout_log_probs"], atol=1e-5)

    # Part of a fused layer (q without k and v): vLLM's loader, which leaves the rest as it is.
    start_state = AutoModelForCausalLM.from_pretrained(start).state_dict()
    partial = [(n, t) for n, t in start_state.items() if ".q_proj." in n]
    paths = engine.llm.collective_rpc(lambda worker: reload_weights(worker.model_runner, partial))
    assert paths == ["loader"]
    engine.load_weights(start_state)  # and back to the start, in place
    assert engine.last_sync_path == "in_place"
    engine.llm.reset_prefix_cache()
    back = generate(engine, prompts, GREEDY)
    assert torch.equal(back.batch["responses"], before.batch["responses"])
    assert torch.allclose(back.batch["rollout_log_probs"], before.batch["rollout_log_probs"], atol=1e-5)
