"""The consistency check's weight read-back from a vLLM engine (``rlcore.engines.vllm_checksums``),
on one real in-process CPU engine (fp32, the tiny qwen3: fused q/k/v and gate/up, q/k norms):

- plain layout: after a sync, every HF tensor's fingerprint, the q/k/v and gate/up parts of the fused
  layers included, equals the trainer's (``weight_fingerprints``, as the actor computes it);
- planted faults: a sync that skipped one decoder layer's bucket is found and named by layer, and
  an engine left on the old weights shows every tensor that changed;
- packed layout: the linear layers keep only oneDNN handles; their names come back unreadable, are
  counted and logged, and are neither missing nor differing; the readable rest is still compared.
"""

import io

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlcore.algos.consistency import weight_fingerprints
from rlcore.engines import RolloutConfig
from rlcore.models.config import ModelConfig
from rlcore.models.tiny import build_tiny_model
from rlcore.trainer.consistency import ConsistencyCheck, compare_weights, diagnose
from rlcore.workers.mismatch import CheckConfig

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slow, pytest.mark.vllm]

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def states(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_checksums")
    start = build_tiny_model(root / "start", arch="qwen3", seed=0)
    new = build_tiny_model(root / "new", arch="qwen3", seed=1)
    return start, AutoModelForCausalLM.from_pretrained(start).state_dict(), \
        AutoModelForCausalLM.from_pretrained(new).state_dict()


@pytest.fixture(scope="module")
def engine(states):
    from rlcore.engines.vllm_engine import VLLMEngine

    return VLLMEngine(ModelConfig(path=states[0]), RolloutConfig(
        backend="vllm", dtype="float32", max_new_tokens=4, kv_cache_memory_bytes=1 << 27, max_model_len=128,
        cpu_weight_layout="plain"))


def _trainer(state, engine_sums) -> dict:
    """The actor's ``weight_checksums`` reply for ``state``: each tensor cast to the engine's dtype."""
    dtypes = {name: c[0] for name, c in engine_sums.items() if c is not None}
    return {"tensors": weight_fingerprints(state.items(), dtypes), "dtype": "float32"}


def _changed(start, new, names=None) -> list[str]:
    """The tensors the two models do not share (norms start as ones in both)."""
    return sorted(n for n in (names or new) if not torch.equal(start[n], new[n]))


def _sync(engine, state, layout: str) -> None:
    engine.cpu_weight_layout = layout
    engine.load_weights(state)
    assert engine.last_sync_path == "in_place"


def _packed_again(worker) -> None:
    """Every layer back on vLLM's packed kernel, as after start-up (the other tests put them on plain)."""
    from rlcore.engines.vllm_worker import in_place_plan

    model = worker.model_runner.get_model()
    in_place_plan(model).pack_plain_layers()
    model.__dict__.pop("_rlcore_in_place_plan", None)


def test_plain_layout_checksums_equal_the_trainers_for_every_tensor_fused_parts_included(engine, states):
    _, start, new = states
    _sync(engine, new, "plain")
    assert engine.weight_layouts["packed"] == 0
    sums = engine.weight_checksums()
    assert set(new) <= set(sums) and all(sums[name] is not None for name in new)
    trainer = _trainer(new, sums)
    assert {sums[name][0] for name in new} == {"float32"}
    for name, tensor in new.items():  # exact: the same fp32 bytes on both sides
        assert sums[name][1] == tensor.numel(), name
        assert sums[name] == trainer["tensors"][name], name
    # the parts of one fused layer differ from each other: the split is by the real offsets
    layer = "model.layers.0"
    parts = [sums[f"{layer}.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")]
    parts += [sums[f"{layer}.mlp.{p}.weight"] for p in ("gate_proj", "up_proj")]
    assert len({c[2] for c in parts}) == len(parts)
    report = compare_weights(1, trainer, [sums])
    assert report.ok and report.unreadable == [] and report.tensors == len(new)
    # an engine left on the start model: every tensor the two models do not share is seen
    stale = compare_weights(1, _trainer(start, sums), [sums])
    assert stale.differ == _changed(start, new)


def test_a_skipped_layer_bucket_is_found_and_named(engine, states):
    from rlcore.engines.vllm_worker import reload_weights

    _, start, new = states
    _sync(engine, start, "plain")
    skipped = {name for name in new if name.startswith("model.layers.1.")}
    assert skipped
    bucket = [(name, t) for name, t in new.items() if name not in skipped]  # every bucket but layer 1's

    def load(worker):
        return reload_weights(worker.model_runner, bucket, "plain")

    assert engine.llm.collective_rpc(load)[0] == "in_place"
    sums = engine.weight_checksums()
    report = compare_weights(3, _trainer(new, sums), [sums])
    assert report.differ == _changed(start, new, skipped) and report.missing == [] and not report.ok
    cause, message = diagnose({}, report)
    assert cause == "weights_partial" and "model.layers.1.*" in message and "model.layers.0" not in message


def test_packed_layout_linears_are_unreadable_counted_and_not_missing(engine, states):
    new = states[2]
    engine.llm.collective_rpc(_packed_again)
    _sync(engine, new, "packed")
    assert engine.weight_layouts["plain"] == 0
    sums = engine.weight_checksums()
    linears = {name for name in new if name.rsplit(".", 2)[-2] in LINEARS}
    assert linears and {name for name, c in sums.items() if c is None} == linears
    report = compare_weights(1, _trainer(new, sums), [sums])
    assert report.ok and report.missing == [] and report.differ == []
    assert report.unreadable == sorted(linears) and report.tensors == len(new) - len(linears)
    assert report.metrics()["check/weights_unreadable"] == len(linears)
    # what can be read is still compared: a stale norm is seen
    stale = dict(new)
    stale["model.norm.weight"] = new["model.norm.weight"] + 0.5
    assert compare_weights(1, _trainer(stale, sums), [sums]).differ == ["model.norm.weight"]

    class Actor:  # the trainer's side of the check: checksums of the weights it synced
        def weight_checksums(self, dtypes):
            return {"tensors": weight_fingerprints(new.items(), dtypes), "dtype": "float32"}

    out = io.StringIO()
    check = ConsistencyCheck(CheckConfig(), Actor(), lambda: [engine.weight_checksums()], out)
    assert check.check_weights(1).ok
    assert f"{len(linears)} tensor(s) could not be read back" in out.getvalue()
