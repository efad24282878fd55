"""The consistency check's end-to-end probe (``rlcore.trainer.probe_check``) on real tiny models.

- vLLM on CPU with the packed layout (its linear layers only oneDNN handles, not readable back): a
  sync removed and a skipped layer bucket are named at step 1 at actor.lr=1e-5 in fp32; a sync that
  skipped only the packed weights of a layer (read-back blind) is named by the probe alone; an
  engine whose weights cannot be read at all (as MoE experts / tensor parallelism) is still judged
  by the probe; the clean run is silent with check/weights_covered 1.0;
- async GRPO with its sync removed is named at step 1;
- a step that trains no rows still runs the comparison that was due.
"""

import io
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from transformers import AutoTokenizer

import recipes.async_grpo
from rlcore.agentic import AsyncRolloutLoop
from rlcore.models.tiny import build_tiny_model
from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup
from rlcore.trainer.consistency import ConsistencyCheck
from rlcore.trainer.probe_check import CALIBRATION_FACTOR, FP32_FLOOR, ProbeCheck, coverage, model_vocab_size, probe_band, probe_ids
from rlcore.trainer.tracking import read_jsonl_metrics
from rlcore.workers.actor import ActorWorker
from rlcore.workers.mismatch import CheckConfig
from rlcore.workers.rollout import RolloutWorker

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engines"))
from engine_fixtures import make_prompts  # noqa: E402

CONFIG_DIR = Path(recipes.async_grpo.__file__).parent / "config"
LR = 1e-5  # a learning rate real models train with


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("probe"), arch="qwen3", seed=0)


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def rollout_group(model_dir, **rollout):
    group = LocalWorkerGroup(ClassWithInitArgs(RolloutWorker, {"model": {"path": model_dir},
                                                               "rollout": {"max_new_tokens": 8, **rollout}}))
    group.init_model()
    return group


@pytest.fixture(scope="module")
def vllm_rollout(model_dir):
    pytest.importorskip("vllm")
    return rollout_group(model_dir, backend="vllm", dtype="float32", kv_cache_memory_bytes=1 << 27,
                         max_model_len=128, cpu_weight_layout="packed")


class Run:
    """A fresh fp32 actor, the engine synced to it, and a ConsistencyCheck with the probe watching both."""

    def __init__(self, model_dir, engine, weights=None, **actor):
        self.actor = LocalWorkerGroup(ClassWithInitArgs(ActorWorker, {
            "model": {"path": model_dir, "mixed_precision": None}, "actor": {"lr": LR, **actor}}))
        self.actor.init_model()
        self.engine = engine
        self.sync()
        self.out = io.StringIO()
        probe = ProbeCheck(self.actor.probe_log_probs, engine.probe_log_probs, model_vocab_size(model_dir), self.out)
        self.check = ConsistencyCheck(CheckConfig(weight_checksum_freq=2), self.actor, weights or engine.weight_checksums,
                                      self.out, probe=probe)
        self.check.calibrate()  # the same weights on both sides: the probe's own noise

    def state(self) -> dict:
        state = self.actor.get_full_state_dict()
        return state[0] if isinstance(state, list) else state

    def sync(self) -> None:
        self.engine.update_weights(self.state())

    def update(self, tok, zero=False) -> dict:
        batch = self.engine.generate_sequences(make_prompts(tok, meta_info={"n": 4, "seed": 3}))
        sign = torch.where(torch.arange(len(batch)) % 2 == 0, 1.0, -1.0).unsqueeze(1)
        batch.batch["advantages"] = (0.0 if zero else sign) * batch.batch["response_mask"]
        metrics = self.actor.update_policy(batch)
        return metrics[0] if isinstance(metrics, list) else metrics


def skip_in_sync(engine, state: dict, skipped) -> None:
    """A sync that leaves out the tensors ``skipped(name)`` says (a bucket that failed to load)."""
    from rlcore.engines.vllm_worker import reload_weights

    part = [(name, t) for name, t in state.items() if not skipped(name)]
    engine.worker().engine.llm.collective_rpc(lambda worker: reload_weights(worker.model_runner, part, "packed"))


def test_probe_ids_are_fixed_and_bands_know_the_dtypes():
    ids = probe_ids(100)
    assert ids == probe_ids(100) and len(ids) == 48 and min(ids) >= 0 and max(ids) < 100 and len(set(ids)) > 30
    assert probe_band("float32", "float32") == FP32_FLOOR == probe_band("float32", "float32", 1e-7)
    assert probe_band("float32", "float32", 1e-5) == pytest.approx(CALIBRATION_FACTOR * 1e-5)  # SmolLM2 on vLLM
    assert probe_band("bfloat16", "float32") > 1000 * FP32_FLOOR  # bf16 noise, measured 1e-3 on the tiny model
    elements = {"a": 30, "b": 70}
    assert coverage(elements, ["b"], probed=False) == {"check/weights_read_back": 0.3, "check/weights_covered": 0.3}
    assert coverage(elements, ["b"], probed=True) == {"check/weights_read_back": 0.3, "check/weights_covered": 1.0}
    assert coverage(None, [], probed=True)["check/weights_covered"] == 1.0


def test_a_calibration_on_different_weights_is_said():
    """Calibration assumes identical weights; an engine far off at the start widens the band: said."""
    out = io.StringIO()
    trainer = {"log_probs": [-1.0] * 47, "dtype": "float32"}
    probe = ProbeCheck(lambda ids: trainer, lambda ids: [{"log_probs": [-1.01] * 47, "dtype": "float32"}], 100, out)
    assert probe.calibrate() == [pytest.approx(0.01)]
    assert "was the engine synced before the run started" in out.getvalue()
    quiet = io.StringIO()
    ProbeCheck(lambda ids: trainer, lambda ids: [{"log_probs": [-1.0 - 1e-7] * 47, "dtype": "float32"}], 100,
               quiet).calibrate()
    assert quiet.getvalue() == ""


@pytest.mark.slow
@pytest.mark.vllm
class TestPackedVLLM:
    def test_clean_run_is_silent_and_fully_covered(self, model_dir, tok, vllm_rollout):
        run = Run(model_dir, vllm_rollout)
        m = run.update(tok)
        run.sync()
        added = run.check.after_step(1, m)
        assert run.check.warned == {}
        assert added["check/weights_covered"] == 1.0 and added["check/weights_unreadable"] == 14
        assert 0 < added["check/weights_read_back"] < 0.1  # the packed linears hold ~94% of the elements
        assert added["check/probe_abs_diff_mean"] < FP32_FLOOR / 5
        log = run.out.getvalue()
        assert log.count("covered only by the end-to-end probe") == 1 and "WARNING" not in log
        assert "model.layers.0.* (7), model.layers.1.* (7)" in log
        run.sync()
        assert run.check.after_step(2, m)["check/weights_covered"] == 1.0
        assert run.out.getvalue() == log  # said once

    def test_sync_removed_is_named_at_step_1(self, model_dir, tok, vllm_rollout):
        run = Run(model_dir, vllm_rollout)
        added = run.check.after_step(1, run.update(tok))  # the sync after the update is missing
        assert added["check/probe_abs_diff_mean"] > 10 * added["check/probe_band"]
        assert list(run.check.warned) == ["weights_not_synced"]
        assert "probe sequence log-probs" in run.check.warned["weights_not_synced"]

    def test_skipped_layer_bucket_is_named(self, model_dir, tok, vllm_rollout):
        run = Run(model_dir, vllm_rollout)
        m = run.update(tok)
        skip_in_sync(vllm_rollout, run.state(), lambda name: name.startswith("model.layers.1."))
        added = run.check.after_step(1, m)
        assert added["check/probe_abs_diff_mean"] > 10 * added["check/probe_band"]
        assert list(run.check.warned) == ["weights_partial"]  # the layer's norms are read back
        assert "model.layers.1.*" in run.check.warned["weights_partial"]

    @pytest.mark.parametrize("lr", [LR, 1e-6])
    def test_packed_weights_left_stale_are_named_by_the_probe_alone(self, model_dir, tok, vllm_rollout, lr):
        """Only the linear weights of layer 1 skipped: everything the read-back sees matches. At lr 1e-6
        the probe moved 2.6e-5 (measured; 1.2e-7 clean), 13x its band."""
        run = Run(model_dir, vllm_rollout, lr=lr)
        m = run.update(tok)
        skip_in_sync(vllm_rollout, run.state(), lambda name: name.startswith("model.layers.1.") and "proj" in name)
        added = run.check.after_step(1, m)
        assert added["check/weights_mismatch"] == 0 and added["check/probe_abs_diff_mean"] > 10 * added["check/probe_band"]
        assert list(run.check.warned) == ["weights_packed_differ"]
        message = run.check.warned["weights_packed_differ"]
        assert "weights the engine keeps packed differ from the trainer's" in message and "model.layers.1" in message

    def test_engine_whose_weights_cannot_be_read_is_judged_by_the_probe(self, model_dir, tok, vllm_rollout):
        """As MoE experts or tensor-parallel shards: the read-back answers None, the probe still runs."""
        run = Run(model_dir, vllm_rollout, weights=lambda: [None])
        added = run.check.after_step(1, run.update(tok))
        assert added["check/weights_read_back"] == 0.0 and added["check/weights_covered"] == 1.0
        assert list(run.check.warned) == ["probe_differs"]
        assert "weight checksums off" in run.out.getvalue()


def test_a_step_that_trains_no_rows_still_runs_the_due_comparison(model_dir, tok):
    """Step 3 trains but its sync is missing (not a due step: weights not compared, log-probs in band);
    step 4 trains no row (all advantages zero, skipped): no check/tokens, yet the due comparison runs."""
    run = Run(model_dir, rollout_group(model_dir), skip_zero_advantage_rows=True)
    assert run.check.after_step(3, run.update(tok)) == {}
    m = run.update(tok, zero=True)
    assert "check/tokens" not in m
    added = run.check.after_step(4, m)
    assert added["check/weights_mismatch"] > 0 and added["check/probe_abs_diff_mean"] > added["check/probe_band"]
    assert added["check/weights_covered"] == 1.0 == added["check/weights_read_back"]  # the HF engine: all read back
    assert list(run.check.warned) == ["weights_not_synced"]
    m = run.update(tok, zero=True)  # no row trained, yet AdamW's moments still move the weights: then synced
    run.sync()
    clean = run.check.after_step(6, m)
    assert clean["check/weights_mismatch"] == 0 and clean["check/probe_abs_diff_mean"] < FP32_FLOOR / 5


@pytest.mark.slow
def test_async_grpo_with_the_sync_removed_is_named_at_step_1(tmp_path, model_dir, monkeypatch, capfd):
    """The publish says version ``step`` but loads nothing (a sync that silently did not happen)."""

    def publish_nothing(self, state_dict, version):
        with self.paused(), self._cond:
            self.version = version
            self._cond.notify_all()

    monkeypatch.setattr(AsyncRolloutLoop, "publish_weights", publish_nothing)
    overrides = [f"model.path={model_dir}", f"trainer.output_dir={tmp_path}", "trainer.backend=local",
                 "trainer.loggers=[jsonl]", "model.mixed_precision=null", "trainer.total_steps=2", "trainer.val_freq=0",
                 "trainer.export_hf=false", "data.train_batch_size=2", "data.arithmetic.n_train=8",
                 "data.arithmetic.n_val=2", "rollout.n=2", "rollout.max_new_tokens=3",
                 "actor.ppo_micro_batch_size_per_gpu=4", f"actor.lr={LR}",
                 "actor.entropy_coeff=0.01"]  # a gradient whatever the rewards (the tiny model scores none)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose("async_grpo", overrides=overrides)
    rows = read_jsonl_metrics(recipes.async_grpo.train(cfg).dir / "metrics.jsonl")
    assert rows[0]["check/weights_mismatch"] > 0 and rows[0]["check/engine_lag"] == 0
    assert rows[0]["check/probe_abs_diff_mean"] > rows[0]["check/probe_band"] and rows[0]["check/weights_covered"] == 1.0
    err = capfd.readouterr().err
    assert "WARNING consistency check, step 1:" in err and "weights not synced" in err


def test_async_hf_engine_scores_the_probe_as_the_trainer_does(model_dir):
    """The engine servers' HF engine: its probe equals the fp32 actor's to fp32 noise."""
    import asyncio

    from rlcore.engines import RolloutConfig
    from rlcore.engines.async_hf import AsyncHFEngine
    from rlcore.models.config import ModelConfig

    ids = probe_ids(model_vocab_size(model_dir))
    engine = AsyncHFEngine(ModelConfig(path=model_dir), RolloutConfig(max_new_tokens=4))
    try:
        reply = asyncio.run(engine.probe_log_probs(ids))
    finally:
        asyncio.run(engine.close())
    actor = LocalWorkerGroup(ClassWithInitArgs(ActorWorker, {"model": {"path": model_dir, "mixed_precision": None}}))
    actor.init_model()
    trainer = actor.probe_log_probs(ids)[0]
    assert reply["dtype"] == trainer["dtype"] == "float32" and len(reply["log_probs"]) == len(ids) - 1
    assert max(abs(a - b) for a, b in zip(reply["log_probs"], trainer["log_probs"])) < 1e-5
    assert min(reply["log_probs"]) < -1.0  # real log-probs of random tokens, not zeros


def test_moe_actor_with_router_replay_scores_the_probe_by_its_own_routing(tmp_path):
    """No sampled routing exists for the probe: the actor routes it itself, as the engine does."""
    from rlcore.engines import RolloutConfig
    from rlcore.engines.hf_engine import HFEngine
    from rlcore.models.config import ModelConfig
    from rlcore.trainer.probe_check import compare_probe

    moe_dir = build_tiny_model(tmp_path, arch="qwen3_moe", seed=0)
    ids = probe_ids(model_vocab_size(moe_dir))
    actor = LocalWorkerGroup(ClassWithInitArgs(ActorWorker, {"model": {"path": moe_dir, "mixed_precision": None},
                                                             "actor": {"router_replay": True}}))
    actor.init_model()
    report = compare_probe(1, actor.probe_log_probs(ids)[0], [HFEngine(ModelConfig(path=moe_dir), RolloutConfig())
                                                              .probe_log_probs(ids)])
    assert report.ok and report.abs_diff_mean < FP32_FLOOR / 5
    assert actor.worker().moe.replay is not None  # the update's replay is back in place
