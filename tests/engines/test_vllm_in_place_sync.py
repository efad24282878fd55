"""The hybrid engine's weight update into vLLM in place (rlcore.engines.vllm_worker.InPlacePlan):
after loading another model's weights, greedy vLLM output must be that model's HF greedy output,
token for token, with log-probs to 1e-5 (fp32 engine). Two layouts: llama with its own LM head,
and qwen3 (q/k norms) with tied embeddings (the LM head shares the padded embedding matrix, so
both must be packed again). An update the plan cannot place whole (part of a fused layer) goes
through vLLM's own loader and is just as right. Each with the matmul layers packed again on every
update and moved onto their plain weights (``rollout.cpu_weight_layout``), whose later updates are
copies into the very same tensors; and ``auto``, which follows what it measured.
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


def _matmul_weights(engine) -> list[int]:
    """The data pointers of the weights the engine's matmul modules keep: plain linear layers keep
    theirs, packed ones none; the embedding and LM head keep theirs either way."""
    def pointers(worker):
        return [m.weight.data_ptr() for m in worker.model_runner.get_model().modules()
                if hasattr(m, "cpu_linear") and m.weight.numel()]
    return engine.llm.collective_rpc(pointers)[0]


@pytest.mark.parametrize("layout", ["packed", "plain"])
@pytest.mark.parametrize("arch, tied", [("llama", False), ("qwen3", True)])
def test_in_place_update_gives_the_new_models_greedy_output(tmp_path, monkeypatch, arch, tied, layout):
    from rlcore.engines.vllm_engine import VLLMEngine
    from rlcore.engines.vllm_worker import reload_weights

    start, new = _model(tmp_path / "start", arch, 0, tied), _model(tmp_path / "new", arch, 1, tied)
    tok = AutoTokenizer.from_pretrained(start)
    prompts = make_prompts(tok, PROMPTS)
    engine = VLLMEngine(ModelConfig(path=start), RolloutConfig(
        backend="vllm", dtype="float32", max_new_tokens=MAX_NEW, kv_cache_memory_bytes=1 << 28, max_model_len=256,
        cpu_weight_layout=layout))
    before = generate(engine, prompts, GREEDY)
    new_state = AutoModelForCausalLM.from_pretrained(new).state_dict()
    engine.load_weights(new_state)
    assert engine.last_sync_path == "in_place"
    layers = sum(engine.weight_layouts.values())
    expected_layouts = {"packed": layers, "plain": 0} if layout == "packed" else {"packed": 0, "plain": layers}
    assert engine.weight_layouts == expected_layouts
    plain_weights = _matmul_weights(engine)
    after = generate(engine, prompts, GREEDY)
    expected = generate(HFEngine(ModelConfig(path=new), RolloutConfig(max_new_tokens=MAX_NEW)), prompts, GREEDY)
    # the update changes the output (a random tied model repeats one token, so compare log-probs too)
    assert not torch.allclose(before.batch["rollout_log_probs"], expected.batch["rollout_log_probs"], atol=1e-3)
    assert torch.equal(after.batch["responses"], expected.batch["responses"])
    assert torch.allclose(after.batch["rollout_log_probs"], expected.batch["rollout_log_probs"], atol=1e-5)

    start_state = AutoModelForCausalLM.from_pretrained(start).state_dict()
    engine.load_weights(start_state)  # back to the start, in place: plain layers are copied into
    assert engine.last_sync_path == "in_place"
    assert _matmul_weights(engine) == plain_weights  # updated in the very same tensors
    # Part of a fused layer (q without k and v) through vLLM's loader, which leaves the rest as it is
    # and packs the layers it rebuilt again (the plan then places everything afresh).
    partial = [(n, t) for n, t in start_state.items() if ".q_proj." in n]
    if layout == "plain":  # a plain layer would take part of its rows in place: ask for the loader
        monkeypatch.setenv("RLCORE_VLLM_SYNC", "loader")
    paths = engine.llm.collective_rpc(lambda worker: reload_weights(worker.model_runner, partial, layout))
    monkeypatch.delenv("RLCORE_VLLM_SYNC", raising=False)
    assert paths == ["loader"]
    engine.load_weights(start_state)  # and back to the start, in place
    assert engine.last_sync_path == "in_place"
    assert engine.weight_layouts == expected_layouts
    engine.llm.reset_prefix_cache()
    back = generate(engine, prompts, GREEDY)
    assert torch.equal(back.batch["responses"], before.batch["responses"])
    assert torch.allclose(back.batch["rollout_log_probs"], before.batch["rollout_log_probs"], atol=1e-5)


def test_auto_layout_follows_the_measurement_once_per_shape(tmp_path, monkeypatch):
    """``auto``: nothing is measured before the engine has decoded a batch; then each matmul shape
    once, at the batch it decoded, and a layer goes plain where its measured ratio is within the
    tolerance; the output is the new model's either way."""
    from rlcore.engines import vllm_worker
    from rlcore.engines.vllm_engine import VLLMEngine

    start, new = _model(tmp_path / "start", "llama", 0, False), _model(tmp_path / "new", "llama", 1, False)
    tok = AutoTokenizer.from_pretrained(start)
    prompts = make_prompts(tok, PROMPTS)
    probed = []

    def ratio(packed, weight, rows):  # the MLP's gate/up layer "measures" slower on its plain weight
        probed.append((tuple(weight.shape), rows))
        return 1.3 if weight.shape[0] == 2 * intermediate else 1.0

    intermediate = AutoModelForCausalLM.from_pretrained(start).config.intermediate_size
    monkeypatch.setattr(vllm_worker, "plain_vs_packed", ratio)
    engine = VLLMEngine(ModelConfig(path=start), RolloutConfig(
        backend="vllm", dtype="float32", max_new_tokens=MAX_NEW, kv_cache_memory_bytes=1 << 28, max_model_len=256))
    new_state = AutoModelForCausalLM.from_pretrained(new).state_dict()
    engine.load_weights(new_state)  # nothing decoded yet: everything stays packed, nothing measured
    assert probed == [] and engine.weight_layouts["plain"] == 0
    generate(engine, prompts, GREEDY)
    engine.load_weights(new_state)
    shapes = {shape for shape, _ in probed}
    assert len(probed) == len(shapes) and all(rows == len(PROMPTS) for _, rows in probed)
    layers = AutoModelForCausalLM.from_pretrained(start).config.num_hidden_layers
    assert engine.weight_layouts["packed"] == layers  # the gate/up layers
    engine.load_weights(new_state)
    assert len(probed) == len(shapes)  # measured once per shape
    after = generate(engine, prompts, GREEDY)
    expected = generate(HFEngine(ModelConfig(path=new), RolloutConfig(max_new_tokens=MAX_NEW)), prompts, GREEDY)
    assert torch.equal(after.batch["responses"], expected.batch["responses"])
    assert torch.allclose(after.batch["rollout_log_probs"], expected.batch["rollout_log_probs"], atol=1e-5)


def _anon_bytes() -> int:
    """This process's resident anonymous memory (heap, tensors): resident minus file-backed pages."""
    import mmap
    with open("/proc/self/statm") as f:
        resident, shared = (int(v) for v in f.read().split()[1:3])
    return (resident - shared) * mmap.PAGESIZE


@pytest.mark.parametrize("arch, tied, layout, dtype", [
    ("llama", False, "packed", "float32"), ("llama", False, "plain", "bfloat16"), ("llama", False, "auto", "bfloat16"),
    ("qwen3", True, "packed", "float32"), ("qwen3", True, "auto", "float32")])
def test_released_weights_come_back_with_the_sync(tmp_path, arch, tied, layout, dtype):
    """``release_weights`` (before the trainer's update, ``trainer.release_memory``): the matmul layers'
    packed kernels (the LM head's too) are let go and the plain weights' pages handed back, so the
    process's memory drops by about their size; generating refuses until a sync; after it, the
    same weights sample the same greedy tokens with the same log-probs, bit for bit, and stay on the
    layout they had (``auto``: as measured before the release)."""
    from rlcore.engines.host_memory import trim_heap
    from rlcore.engines.vllm_engine import VLLMEngine

    if tied:  # the tiny shape: its LM head is the padded embedding
        start = _model(tmp_path / "m", arch, 0, tied)
    else:  # large enough for the memory given back to show
        start = build_tiny_model(tmp_path / "m", arch=arch, seed=0, hidden_size=512, num_layers=4, num_heads=8,
                                 num_kv_heads=4, head_dim=64)
    tok = AutoTokenizer.from_pretrained(start)
    prompts = make_prompts(tok, PROMPTS)
    engine = VLLMEngine(ModelConfig(path=start), RolloutConfig(
        backend="vllm", dtype=dtype, max_new_tokens=MAX_NEW, kv_cache_memory_bytes=1 << 26, max_model_len=256,
        cpu_weight_layout=layout))
    state = AutoModelForCausalLM.from_pretrained(start).state_dict()
    generate(engine, prompts, GREEDY)  # a batch decoded: auto measures at the first update
    engine.load_weights(state)
    layouts = engine.weight_layouts
    engine.llm.reset_prefix_cache()
    before = generate(engine, prompts, GREEDY)

    trim_heap()
    held = _anon_bytes()
    freed = engine.release_weights()
    trim_heap()
    linears = sum(t.numel() for n, t in state.items() if t.ndim == 2 and ".layers." in n)  # (whole pages only)
    assert freed >= 0.95 * linears * torch.empty((), dtype=getattr(torch, dtype)).element_size()
    if arch == "llama":  # large enough to see: the process gave most of it back
        assert held - _anon_bytes() >= freed // 2
    with pytest.raises(RuntimeError, match="released"):
        generate(engine, prompts, GREEDY)
    from rlcore.engines.vllm_worker import released_linear
    stand_ins = engine.llm.collective_rpc(
        lambda worker: sum(getattr(m, "cpu_linear", None) is released_linear for m in worker.model_runner.get_model().modules()))
    assert (stand_ins[0] > 0) == (layouts["packed"] > 0)  # plain layers: no packed kernels, only pages given back
    engine.load_weights(state)
    assert engine.last_sync_path == "in_place" and engine.weight_layouts == layouts
    after = generate(engine, prompts, GREEDY)
    assert torch.equal(after.batch["responses"], before.batch["responses"])
    assert torch.equal(after.batch["rollout_log_probs"], before.batch["rollout_log_probs"])
