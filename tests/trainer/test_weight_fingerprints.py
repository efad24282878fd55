"""Exact weight fingerprints (``rlcore.algos.consistency.tensor_fingerprint``) and the diagnosis they
allow (``rlcore.trainer.weight_versions``).

- the hash against a pure-Python reference over the bytes (chunks, the tail word, the keys: the
  published SplitMix64 value), a single flipped bit anywhere in a tensor of several chunks, two top
  bits flipped (what a purely linear hash mod 2^64 cannot see), the cast to bf16 and an engine's
  ``copy_`` giving the same bytes, fused parts split at their offsets (aligned or not);
- the verdicts on hand-built fingerprints: an engine on one older version whole (not synced, with
  tensors the update left unchanged), some layers older (partly synced, by layer), weights of no
  version (unknown);
- planted faults on the real tiny model at the learning rates real models use (1e-6, 1e-5): the sync
  left out is "not synced" at step 1 with an fp32 and a bf16 engine (where some tensors come out of
  the step bit-identical after the cast, which counting differing tensors called "partly synced");
  a skipped bucket is named by its layer at step 1; on the HF engine, and on vLLM
  (``rollout.cpu_weight_layout=plain``, weights readable); and through a whole GRPO recipe run.
"""

import asyncio
import io
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engines"))
from engine_fixtures import make_prompts  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from rlcore.algos import consistency  # noqa: E402
from rlcore.algos.consistency import splitmix64, tensor_fingerprint, weight_fingerprints  # noqa: E402
from rlcore.engines import RolloutConfig  # noqa: E402
from rlcore.engines.async_hf import AsyncHFEngine  # noqa: E402
from rlcore.engines.weights import pack_buckets  # noqa: E402
from rlcore.models.config import ModelConfig  # noqa: E402
from rlcore.models.tiny import build_tiny_model  # noqa: E402
from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup, create_colocated_worker_cls  # noqa: E402
from rlcore.trainer.consistency import ConsistencyCheck, compare_weights, diagnose  # noqa: E402
from rlcore.trainer.weight_versions import KnownVersions  # noqa: E402
from rlcore.workers.actor import ActorWorker  # noqa: E402
from rlcore.workers.mismatch import CheckConfig  # noqa: E402
from rlcore.workers.rollout import RolloutWorker  # noqa: E402

MASK = (1 << 64) - 1
MAX_NEW = 8


# ------------------------------------------------------------------ the hash itself
def reference(data: bytes, words_per_chunk: int) -> int:
    """The fingerprint's definition, word by word on Python ints (see ``tensor_fingerprint``)."""
    total = 0
    for index in range(0, len(data), 8):
        w = int.from_bytes(data[index: index + 8].ljust(8, b"\0"), "little")
        chunk, j = divmod(index // 8, words_per_chunk)
        k = splitmix64(j) | 1
        z = (w * k) & MASK
        z = ((z ^ (z >> 32)) * k) & MASK
        total += z * (splitmix64((1 << 63) + chunk) | 1)
    return total & MASK


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 4 words, so that a small tensor spans several."""
    monkeypatch.setattr(consistency, "_WORDS", 4)
    monkeypatch.setattr(consistency, "_keys", {})
    return 4


def test_keys_are_splitmix64():
    assert splitmix64(0) == 0xE220A8397B1DCDAF  # the published first output of SplitMix64 from state 0
    keys = consistency._word_keys(torch.device("cpu"))
    assert [int(k) & MASK for k in keys[:3]] == [splitmix64(j) | 1 for j in range(3)]


@pytest.mark.parametrize("dtype,count", [(torch.float32, 37), (torch.bfloat16, 23), (torch.int64, 9),
                                         (torch.uint8, 5)], ids=["fp32", "bf16-tail", "int64", "bytes"])
def test_hash_equals_the_reference_over_the_bytes(small_chunks, dtype, count):
    g = torch.Generator().manual_seed(count)
    t = torch.randint(-2**62, 2**62, (count,), generator=g).to(dtype) if not dtype.is_floating_point \
        else torch.randn(count, generator=g).to(dtype)
    name, elements, value = tensor_fingerprint(t)
    assert (name, elements) == (str(dtype).removeprefix("torch."), count)
    assert value == reference(t.view(torch.uint8).numpy().tobytes(), small_chunks)
    assert tensor_fingerprint(torch.empty(0)) == ("float32", 0, 0)


def test_a_single_flipped_bit_anywhere_is_seen_and_two_top_bits_too():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(768, 700, generator=g)  # 537600 elements: 2^18 words in the first chunk, the rest in a second
    base = tensor_fingerprint(w)
    bits = w.view(torch.int32).view(-1)
    for index in (0, 530_000, w.numel() - 1):  # first chunk, second chunk, the last element
        for bit in (*range(0, 31, 3), 31):  # mantissa low to high, exponent, sign
            mask = (1 << bit) if bit < 31 else -(1 << 31)
            bits[index] ^= mask
            assert tensor_fingerprint(w)[2] != base[2], (index, bit)
            bits[index] ^= mask
    assert tensor_fingerprint(w) == base
    # bit 63 of two words (the sign of the odd float of each): the same change of each word, which
    # cancels in any sum of words times odd keys mod 2^64; the xor-shift makes it count
    two = w.clone()
    two.view(torch.int32).view(-1)[[1, 3]] ^= -(1 << 31)
    assert torch.equal(two.view(-1)[[1, 3]], -w.view(-1)[[1, 3]])
    assert tensor_fingerprint(two)[2] != base[2]
    # an fp32 step of 1e-6 on the matrix (what float sums missed), and a permutation
    assert tensor_fingerprint(w - 1e-6 * torch.sign(w))[2] != base[2]
    assert tensor_fingerprint(w.flip(0))[2] != base[2]


def test_the_engines_dtype_the_cast_and_a_copy_give_the_same_bytes():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 7, generator=g)
    engine = torch.empty(300, 7, dtype=torch.bfloat16)
    engine.copy_(w)  # what an engine's load does with the trainer's fp32 tensor
    assert tensor_fingerprint(w, torch.bfloat16) == tensor_fingerprint(engine)
    assert tensor_fingerprint(w, torch.bfloat16) != tensor_fingerprint(w)  # other bytes, other dtype
    # fp32 values that differ below bf16's precision (an eighth of its half-ulp) are equal once cast, not before
    exact = engine.float()
    nudged = exact + exact.abs() * 2**-12
    assert tensor_fingerprint(nudged, torch.bfloat16) == tensor_fingerprint(engine)
    assert tensor_fingerprint(nudged) != tensor_fingerprint(exact)
    assert tensor_fingerprint(w.t()) == tensor_fingerprint(w.t().contiguous())  # by logical order


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_parts_split_at_their_offsets_match_the_hf_tensors(dtype):
    """q/k/v in one fused matrix (vLLM's qkv_proj), read back by row offsets; k has an odd row
    count, so in bf16 the v part starts off an 8-byte boundary."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(rows, 5, generator=g).to(dtype) for rows in (8, 3, 3))
    fused = torch.cat([q, k, v])
    parts = [fused[0:8], fused[8:11], fused[11:14]]
    assert [tensor_fingerprint(p) for p in parts] == [tensor_fingerprint(t) for t in (q, k, v)]
    assert len({tensor_fingerprint(p)[2] for p in parts}) == 3


# ------------------------------------------------------------------ verdicts on hand-built fingerprints
def _fps(values: dict[str, float]) -> dict[str, tuple]:
    return weight_fingerprints((name, torch.full((4,), value)) for name, value in values.items())


NAMES = ["model.embed_tokens.weight", "model.layers.0.mlp.w", "model.layers.0.attn.w", "model.layers.1.mlp.w",
         "model.layers.1.attn.w", "model.norm.weight"]


def _verdict(engine_values, known_steps=((0, 0.0),)):
    """The trainer at step 2 holds 2.0 in every tensor but the norm (1.0: unchanged since the start)."""
    trainer = {n: 2.0 for n in NAMES} | {"model.norm.weight": 1.0}
    known = KnownVersions()
    for step, value in known_steps:
        known.remember(step, _fps({n: value for n in NAMES} | {"model.norm.weight": 1.0}), start=step == 0)
    engine = _fps(trainer | engine_values)
    report = compare_weights(2, {"tensors": _fps(trainer), "dtype": "float32"}, [engine], known)
    return report, diagnose({}, report)


def test_an_engine_on_an_older_version_whole_is_not_synced():
    report, (cause, message) = _verdict({n: 0.0 for n in NAMES[:-1]})
    assert cause == "weights_not_synced" and len(report.differ) == 5 < report.tensors
    assert "weights not synced: the engine holds step 0's weights (the run's starting weights)" in message
    # the last check's weights (step 1) are remembered as well
    report, (cause, message) = _verdict({n: 1.5 for n in NAMES[:-1]}, ((0, 0.0), (1, 1.5)))
    assert cause == "weights_not_synced" and "holds step 1's weights:" in message
    assert report.metrics()["check/weights_stale"] == 5


def test_older_weights_in_some_layers_are_a_partial_sync_named_by_layer():
    report, (cause, message) = _verdict({"model.layers.1.mlp.w": 0.0, "model.layers.1.attn.w": 0.0})
    assert cause == "weights_partial" and report.differ == ["model.layers.1.attn.w", "model.layers.1.mlp.w"]
    assert "weights partly synced: 2 of 6 tensors" in message and "model.layers.1.* (2)" in message
    assert "model.layers.0" not in message and "(of step 0)" in message


def test_weights_of_no_known_version_are_named_so():
    _, (cause, message) = _verdict({"model.layers.0.mlp.w": 7.0})
    assert cause == "weights_unknown" and "differ from every version known: 1 of 6" in message
    assert "model.layers.0.mlp.w" in message and "steps 0" in message
    # without any remembered version, counting as before
    _, (cause, _) = _verdict({"model.layers.0.mlp.w": 7.0}, ())
    assert cause == "weights_partial"


def test_an_engine_that_starts_from_other_weights_is_warned_before_step_1():
    """``start``: the first comparison, before any update; remembered as the starting version."""
    trainer = _fps({n: 0.0 for n in NAMES})
    engine = _fps({n: 0.0 for n in NAMES} | {"model.layers.1.mlp.w": 3.0})
    out = io.StringIO()
    actor = SimpleNamespace(weight_checksums=lambda dtypes: {"tensors": trainer})
    check = ConsistencyCheck(CheckConfig(), actor, lambda: [engine], out=out)
    check.start(0)
    assert list(check.warned) == ["weights_start"] and check.known.start == 0
    said = out.getvalue()
    assert "before step 1: 1 of 6 tensors (model.layers.1 - e.g. model.layers.1.mlp.w)" in said
    assert ConsistencyCheck(CheckConfig(weight_checksum_freq=0), None, None).known.start is None


def test_versions_kept_are_the_start_and_the_latest_checks():
    known = KnownVersions()
    for step in range(0, 12):
        known.remember(step, {"w": ("float32", 1, step)}, start=step == 0)
    assert sorted(known.versions) == [0, 8, 9, 10, 11] and known.start == 0
    assert list(known.before(10)) == [9, 8, 0]


# ------------------------------------------------------------------ planted faults on the real tiny model
class Run:
    """An actor and a rollout engine in this process, and a check watching them from before step 1
    (``start(0)``, as ``TrainingRun.steps`` does)."""

    def __init__(self, model_dir, lr, rollout=None):
        actor = ClassWithInitArgs(ActorWorker, {"model": {"path": model_dir, "mixed_precision": None},
                                                "actor": {"lr": lr}})
        engine = ClassWithInitArgs(RolloutWorker, {"model": {"path": model_dir},
                                                   "rollout": {"max_new_tokens": MAX_NEW, **(rollout or {})}})
        self.wg = LocalWorkerGroup(create_colocated_worker_cls({"actor": actor, "rollout": engine}))
        self.wg.actor_init_model()
        self.wg.rollout_init_model()
        self.out = io.StringIO()
        self.check = self.watch(self.wg.rollout_weight_checksums)

    def watch(self, engines):
        check = ConsistencyCheck(CheckConfig(), SimpleNamespace(weight_checksums=self.wg.actor_weight_checksums),
                                 engines, out=self.out)
        check.start(0)
        assert check.last_weights.ok  # engine and trainer start from the same weights
        return check

    def update(self, tok):
        batch = self.wg.rollout_generate_sequences(make_prompts(tok, meta_info={"n": 4, "seed": 3}))
        sign = torch.where(torch.arange(len(batch)) % 2 == 0, 1.0, -1.0).unsqueeze(1)
        batch.batch["advantages"] = sign * batch.batch["response_mask"]
        metrics = self.wg.actor_update_policy(batch)
        return metrics[0] if isinstance(metrics, list) else metrics


@pytest.mark.parametrize("lr,dtype", [(1e-6, "float32"), (1e-6, "bfloat16"), (1e-5, "bfloat16")])
def test_sync_left_out_is_not_synced_at_step_1(model_dir, tok, lr, dtype):
    run = Run(model_dir, lr, {"dtype": dtype})
    metrics = run.update(tok)  # and no sync
    added = run.check.after_step(1, metrics)
    assert list(run.check.warned) == ["weights_not_synced"]
    message = run.check.warned["weights_not_synced"]
    assert "weights not synced: the engine holds step 0's weights (the run's starting weights)" in message
    assert added["check/weights_mismatch"] == added["check/weights_stale"] > 0
    if dtype == "float32":  # exact: every tensor took the step, however small
        assert added["check/weights_mismatch"] == added["check/weights_checked"]
    elif lr == 1e-6:  # some tensors (norms) are bit-identical after the cast: counting would say "partly"
        assert added["check/weights_mismatch"] < added["check/weights_checked"]


@pytest.mark.parametrize("lr,dtype", [(1e-6, "float32"), (1e-6, "bfloat16"), (1e-5, "float32")])
def test_a_skipped_bucket_is_named_by_its_layer_at_step_1(model_dir, tok, lr, dtype):
    """A bucketed sync (engine servers' path), one bucket per decoder layer, layer 1's skipped."""
    run = Run(model_dir, lr)
    engine = AsyncHFEngine(ModelConfig(path=model_dir), RolloutConfig(max_new_tokens=MAX_NEW, dtype=dtype))
    check = run.watch(lambda: [asyncio.run(engine.weight_checksums())])
    metrics = run.update(tok)
    buckets = list(pack_buckets(run.wg.actor_get_full_state_dict().items(), bucket_bytes=1))
    skipped = next(b for b in buckets if b.names()[0].startswith("model.layers.1."))

    async def push():
        await engine.begin_update(1)
        for bucket in buckets:
            if bucket is not skipped:
                await engine.load_bucket(bucket)
        await engine.finish_update()

    asyncio.run(push())
    try:
        added = check.after_step(1, metrics)
    finally:
        asyncio.run(engine.close())
    assert list(check.warned) == ["weights_partial"]
    message = check.warned["weights_partial"]
    assert "weights partly synced" in message and "model.layers.1.*" in message and "(of step 0)" in message
    assert "model.layers.0" not in message and "model.layers.2" not in message
    assert 0 < added["check/weights_mismatch"] <= len(skipped.names())


# ------------------------------------------------------------------ vLLM (plain layout: every weight readable)
@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_sync_left_out_then_a_skipped_bucket_at_step_1(tmp_path_factory):
    """One vLLM engine (the tiny qwen3: fused q/k/v and gate/up) beside an fp32 actor at lr 1e-6:
    left unsynced, it is "not synced" at step 1; then, synced and checked afresh, a sync that
    skips decoder layer 1 is "partly synced", naming that layer."""
    pytest.importorskip("vllm")
    from rlcore.engines.vllm_worker import reload_weights

    model = build_tiny_model(tmp_path_factory.mktemp("fingerprints_vllm"), arch="qwen3", seed=0)
    tok = AutoTokenizer.from_pretrained(model)
    run = Run(model, 1e-6, {"backend": "vllm", "dtype": "float32", "kv_cache_memory_bytes": 1 << 27,
                            "max_model_len": 128, "cpu_weight_layout": "plain"})
    added = run.check.after_step(1, run.update(tok))
    assert list(run.check.warned) == ["weights_not_synced"]
    assert "the engine holds step 0's weights" in run.check.warned["weights_not_synced"]
    assert added["check/weights_mismatch"] == added["check/weights_checked"]  # fp32: every tensor moved

    run.wg.rollout_sync_weights()
    check = run.watch(run.wg.rollout_weight_checksums)
    metrics = run.update(tok)
    bucket = [(n, t) for n, t in run.wg.actor_get_full_state_dict().items() if not n.startswith("model.layers.1.")]
    vllm = run.wg.worker(0, "rollout").engine
    loaded = vllm.llm.collective_rpc(lambda worker: reload_weights(worker.model_runner, bucket, "plain"))
    assert loaded[0] == "in_place"
    added = check.after_step(1, metrics)
    assert list(check.warned) == ["weights_partial"]
    message = check.warned["weights_partial"]
    assert "model.layers.1.*" in message and "model.layers.0" not in message
    layer_1 = [n for n in vllm.weight_checksums() if n.startswith("model.layers.1.")]
    assert added["check/weights_mismatch"] == len(layer_1)


# ------------------------------------------------------------------ through a whole recipe run
@pytest.mark.slow
def test_grpo_run_without_its_sync_says_not_synced_at_step_1(tmp_path, model_dir, monkeypatch, capfd):
    """recipes/grpo.py with the engine's load made a no-op (the sync left out), a bf16 engine beside
    the fp32 trainer, lr 1e-6: ``TrainingRun`` fingerprints the start, and step 1 names the fault,
    though the norms come out of the step bit-identical in bf16. (The untrained model's rewards are
    all 0, so its advantages are; the entropy bonus is what moves the weights.)"""
    from hydra import compose, initialize_config_dir

    import recipes.grpo
    from rlcore.trainer.tracking import read_jsonl_metrics

    monkeypatch.setattr(RolloutWorker, "_load", lambda self, state_dict, start: {})
    overrides = [f"model.path={model_dir}", f"trainer.output_dir={tmp_path}", "trainer.backend=local",
                 "trainer.loggers=[jsonl]", "model.mixed_precision=null", "rollout.dtype=bfloat16", "actor.lr=1e-6",
                 "actor.entropy_coeff=0.01", "trainer.total_steps=1", "trainer.val_freq=0", "trainer.save_freq=0",
                 "trainer.export_hf=false", "data.train_batch_size=4", "data.arithmetic.n_train=8",
                 "data.arithmetic.n_val=2", "rollout.n=4", "rollout.max_new_tokens=4",
                 "actor.ppo_micro_batch_size_per_gpu=8"]
    with initialize_config_dir(config_dir=str(Path(recipes.grpo.__file__).parent / "config"), version_base=None):
        run = recipes.grpo.train(compose("grpo", overrides=overrides))
    row = read_jsonl_metrics(run.dir / "metrics.jsonl")[0]
    assert 0 < row["check/weights_mismatch"] == row["check/weights_stale"] < row["check/weights_checked"]
    err = capfd.readouterr().err
    assert "consistency check, step 1:" in err
    assert "weights not synced: the engine holds step 0's weights (the run's starting weights)" in err
