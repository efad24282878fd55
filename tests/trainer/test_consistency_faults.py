"""The consistency check names each planted fault within one step, on a real tiny model: an actor and
an HF rollout engine colocated in this process (the hybrid engine), the actor's real update, the
engine's real sampling and weight checksums. Faults: (a) the engine not synced after an update, (b) a
bf16 engine where the config says fp32, (c) top-p sampling scored without the filter, (d) a chat template
that re-rendered earlier turns, (e) a NaN reward, (f) a weight bucket skipped in a bucketed sync.
The clean setup stays inside every band."""

import asyncio
import io
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engines"))
from engine_fixtures import make_prompts  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from rlcore.agentic.episode import Trajectory, to_dataproto  # noqa: E402
from rlcore.engines import RolloutConfig  # noqa: E402
from rlcore.engines.async_hf import AsyncHFEngine  # noqa: E402
from rlcore.engines.weights import layer_of, pack_buckets  # noqa: E402
from rlcore.models.config import ModelConfig  # noqa: E402
from rlcore.models.tiny import build_tiny_model  # noqa: E402
from rlcore.protocol import DataProto  # noqa: E402
from rlcore.rewards.manager import RewardError, RuleRewardManager  # noqa: E402
from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup, create_colocated_worker_cls  # noqa: E402
from rlcore.trainer.consistency import ConsistencyCheck, ConsistencyError, check_rewards, out_of_band  # noqa: E402
from rlcore.workers.actor import ActorWorker  # noqa: E402
from rlcore.workers.mismatch import CheckConfig  # noqa: E402
from rlcore.workers.rollout import RolloutWorker  # noqa: E402

MAX_NEW = 10


class Hybrid:
    """Actor + rollout in this process, and a ConsistencyCheck watching them (defaults unless given)."""

    def __init__(self, model_dir, rollout=None, actor=None, expected=(None, None), **check):
        actor = ClassWithInitArgs(ActorWorker, {"model": {"path": model_dir, "mixed_precision": None},
                                                "actor": {"lr": 1e-2, **(actor or {})}})
        engine = ClassWithInitArgs(RolloutWorker, {"model": {"path": model_dir},
                                                   "rollout": {"max_new_tokens": MAX_NEW, **(rollout or {})}})
        self.wg = LocalWorkerGroup(create_colocated_worker_cls({"actor": actor, "rollout": engine}))
        self.wg.actor_init_model()
        self.wg.rollout_init_model()
        self.out = io.StringIO()
        self.check = ConsistencyCheck(CheckConfig(**check), SimpleNamespace(weight_checksums=self.wg.actor_weight_checksums),
                                      self.wg.rollout_weight_checksums, out=self.out, expected=expected)

    def generate(self, tok, **meta):
        return self.wg.rollout_generate_sequences(make_prompts(tok, meta_info={"n": 4, "seed": 3, **meta}))

    def update(self, batch, step):
        sign = torch.where(torch.arange(len(batch)) % 2 == 0, 1.0, -1.0).unsqueeze(1)
        batch.batch["advantages"] = sign * batch.batch["response_mask"]
        metrics = self.wg.actor_update_policy(batch)
        return metrics[0] if isinstance(metrics, list) else metrics

    def step(self, tok, step, sync=True, plant=None, **meta):
        batch = self.generate(tok, **meta)
        if plant is not None:
            plant(batch)
        metrics = self.update(batch, step)
        if sync:
            self.wg.rollout_sync_weights()
        return {**metrics, **self.check.after_step(step, metrics)}


@pytest.mark.parametrize("actor", [{}, {"lora": {"rank": 4}}], ids=["full", "lora"])
def test_clean_run_stays_inside_every_band(model_dir, tok, actor):
    """A LoRA actor hands engines its merged weights: those are what its checksums describe."""
    h = Hybrid(model_dir, actor=actor, weight_checksum_freq=1)
    for step in (1, 2):
        m = h.step(tok, step)
        assert m["check/tokens"] > 20
        assert m["check/logprob_abs_diff_mean"] < 1e-5 and m["check/ratio_out_of_band"] == 0.0
        assert m["check/weights_mismatch"] == 0 and m["check/weights_checked"] > 10
    assert h.check.warned == {} and h.out.getvalue() == ""


def test_a_engine_not_synced_after_an_update(model_dir, tok):
    """Step 1 syncs; step 2 forgets to. Step 3's samples come from the stale engine: the mismatch
    leaves its band and the checksums it triggers (weight_checksum_freq is 10) name the cause."""
    h = Hybrid(model_dir)
    h.step(tok, 1)
    h.step(tok, 2, sync=False)
    assert h.check.warned == {}
    m = h.step(tok, 3, sync=False)
    assert m["check/weights_mismatch"] == m["check/weights_checked"]
    assert list(h.check.warned) == ["weights_not_synced"]
    assert "weights not synced" in h.out.getvalue()


FP32_CONFIG = ("float32", "float32")  # what the run's config says (a bf16 engine on purpose is silent: test_check_bands)


def test_b_bf16_engine_with_fp32_trainer(model_dir, tok):
    """The config says fp32 on both sides; the engine is in bf16."""
    h = Hybrid(model_dir, rollout={"dtype": "bfloat16"}, expected=FP32_CONFIG)
    m = h.step(tok, 1)
    assert m["check/logprob_abs_diff_mean"] > 1e-4
    assert m["check/weights_mismatch"] == 0  # the engine holds the trainer's weights, rounded to bf16
    assert list(h.check.warned) == ["dtype"]
    assert "engine bfloat16, trainer float32" in h.check.warned["dtype"]
    h.step(tok, 2)
    assert h.out.getvalue().count("WARNING") == 1  # once per cause


def test_c_top_p_sampling_scored_without_the_filter(model_dir, tok):
    def unfiltered(batch):  # the trainer is not told the sampler's top_p
        batch.meta_info.pop("top_p")

    h = Hybrid(model_dir, rollout={"top_p": 0.7})
    m = h.step(tok, 1, plant=unfiltered)
    assert m["check/ratio_out_of_band"] > 0.5 and m["check/logprob_diff_mean"] < 0
    assert list(h.check.warned) == ["top_p_top_k"]
    assert "sampler's log-probs are above the trainer's" in h.check.warned["top_p_top_k"]
    clean = Hybrid(model_dir, rollout={"top_p": 0.7})
    assert clean.step(tok, 1)["check/logprob_abs_diff_mean"] < 1e-5 and clean.check.warned == {}


def _two_turn_rows(h, tok, render_env):
    """Episodes of two policy turns: the engine samples turn 1, the env says ``env_text``, the engine
    samples turn 2 after it. The trainer's rows hold the env text as ``render_env`` renders it."""
    env_text = " try again: 7+8="
    first = h.generate(tok, n=1)
    trajectories = []
    for row in range(len(first)):
        k = int(first.batch["response_mask"][row].sum())
        prompt = first.batch["prompts"][row][first.batch["attention_mask"][row, :first.batch["prompts"].shape[1]].bool()]
        turn1, lp1 = first.batch["responses"][row, :k].tolist(), first.batch["rollout_log_probs"][row, :k].tolist()
        sampled_env = tok(env_text, add_special_tokens=False)["input_ids"]
        context = torch.tensor([prompt.tolist() + turn1 + sampled_env])
        second = h.wg.rollout_generate_sequences(DataProto.from_dict(
            {"input_ids": context, "attention_mask": torch.ones_like(context),
             "position_ids": torch.arange(context.shape[1])[None]}, meta_info={"n": 1, "seed": row}))
        k2 = int(second.batch["response_mask"][0].sum())
        turn2, lp2 = second.batch["responses"][0, :k2].tolist(), second.batch["rollout_log_probs"][0, :k2].tolist()
        env = tok(render_env(env_text), add_special_tokens=False)["input_ids"]
        t = Trajectory(prompt_ids=prompt.tolist())
        t.token_ids, t.log_probs = turn1 + env + turn2, lp1 + [0.0] * len(env) + lp2
        t.policy_mask = [1] * len(turn1) + [0] * len(env) + [1] * len(turn2)
        t.versions = [0] * len(t.token_ids)
        trajectories.append(t)
    batch = to_dataproto(trajectories, tok.pad_token_id, 1.0)
    batch.meta_info["policy_version"] = 0
    return batch


def test_d_template_that_drops_earlier_turns_content(model_dir, tok):
    h = Hybrid(model_dir)
    faithful = _two_turn_rows(h, tok, lambda text: text)
    m = h.update(faithful, 1)
    assert m["check/logprob_abs_diff_mean/turn_later"] < 1e-5
    h.wg.rollout_sync_weights()
    h.check.after_step(1, m)
    assert h.check.warned == {}
    # the template re-renders the earlier turn without its content: the trainer scores turn 2 after other text
    dropped = _two_turn_rows(h, tok, lambda text: text.split(":")[0] + ":")
    m = h.update(dropped, 2)
    assert m["check/logprob_abs_diff_mean/turn_first"] < 1e-5 < m["check/logprob_abs_diff_mean/turn_later"]
    h.wg.rollout_sync_weights()
    h.check.after_step(2, m)
    assert list(h.check.warned) == ["template"]


def test_e_nan_reward_is_refused_by_name(tok):
    good, bad = Trajectory(prompt_ids=[5, 6]), Trajectory(prompt_ids=[5, 7])
    for t, reward in ((good, 1.0), (bad, math.nan)):
        t.token_ids, t.log_probs, t.policy_mask, t.versions, t.reward = [8, 9], [-1.0, -1.0], [1, 1], [0, 0], reward
    batch = to_dataproto([good, bad], 0, 1.0, {"data_source": np.array(["math", "retry_env"], dtype=object)})
    with pytest.raises(ConsistencyError, match=r"1 non-finite reward.*row 1 \(nan, data_source='retry_env'"):
        check_rewards(batch)
    batch.batch["token_level_scores"][1] = 0.0
    assert check_rewards(batch) == {"check/nan_rewards": 0.0}


def nan_reward(response, ground_truth, **kwargs):
    return math.nan


def test_e_nan_from_a_reward_function_is_refused_before_any_number(model_dir, tok):
    h = Hybrid(model_dir)
    batch = h.generate(tok)
    batch.non_tensor_batch["ground_truth"] = np.array(["1"] * len(batch), dtype=object)
    batch.non_tensor_batch["data_source"] = np.array(["arith"] * len(batch), dtype=object)
    manager = RuleRewardManager(tok, nan_reward, num_workers=0)
    with pytest.raises(RewardError, match=r"'nan_reward' raised ValueError: the reward function returned nan.*"
                                          r"on sample 0 \(data_source='arith'\)"):
        manager(batch)


def test_f_weight_bucket_skipped(model_dir, tok):
    """A bucketed sync (engine servers' path) that skips one bucket: the checksum names its tensors."""
    h = Hybrid(model_dir)
    h.update(h.generate(tok), 1)
    engine = AsyncHFEngine(ModelConfig(path=model_dir), RolloutConfig(max_new_tokens=MAX_NEW))
    buckets = list(pack_buckets(h.wg.actor_get_full_state_dict().items(), bucket_bytes=64 << 10))
    assert len(buckets) >= 3
    skipped = buckets[1].names()

    async def push():
        await engine.begin_update(1)
        for i, bucket in enumerate(buckets):
            if i != 1:
                await engine.load_bucket(bucket)
        await engine.finish_update()

    asyncio.run(push())
    check = ConsistencyCheck(CheckConfig(), SimpleNamespace(weight_checksums=h.wg.actor_weight_checksums),
                             lambda: [asyncio.run(engine.weight_checksums())], out=io.StringIO())
    m = check.after_step(1, {"check/tokens": 10.0, "check/logprob_abs_diff_mean": 0.0, "check/ratio_out_of_band": 0.0})
    assert m["check/weights_mismatch"] == len(skipped)
    assert list(check.warned) == ["weights_partial"]
    assert min(skipped) in check.warned["weights_partial"]
    assert all(f"{layer_of(name)}.*" in check.warned["weights_partial"] for name in skipped if "layers" in name)
    asyncio.run(engine.close())


def test_strict_stops_the_run(model_dir, tok):
    h = Hybrid(model_dir, rollout={"dtype": "bfloat16"}, expected=FP32_CONFIG, strict=True)
    with pytest.raises(ConsistencyError, match=r"dtype differs.*strict=true"):
        h.step(tok, 1)


def test_engines_without_checksums_keep_the_log_prob_measures():
    """An engine that cannot report its weights (None) turns the weight comparison off, once, said so."""
    out = io.StringIO()
    check = ConsistencyCheck(CheckConfig(weight_checksum_freq=1), SimpleNamespace(weight_checksums=None),
                             lambda: [None], out=out)
    inside = {"check/tokens": 10.0, "check/logprob_abs_diff_mean": 0.0, "check/ratio_out_of_band": 0.0}
    assert check.after_step(1, inside) == {} and check.after_step(2, inside) == {}
    assert out.getvalue().count("weight checksums off") == 1
    with pytest.raises(ConsistencyError, match="not one-sided"):
        ConsistencyCheck(CheckConfig(strict=True), None, None).after_step(
            1, {**inside, "check/logprob_abs_diff_mean": 0.2, "check/logprob_diff_mean": 0.01})


def test_stale_tokens_are_reported_by_lag_not_judged():
    """Tokens sampled by older weights differ by the policy's own change: only lag 0 is judged."""
    cfg = CheckConfig()
    stale = {"check/tokens": 10.0, "check/logprob_abs_diff_mean": 0.3, "check/ratio_out_of_band": 0.5,
             "check/tokens/lag_1": 10.0, "check/logprob_abs_diff_mean/lag_1": 0.3, "check/ratio_out_of_band/lag_1": 0.5}
    assert out_of_band(stale, cfg) == []
    mixed = {**stale, "check/tokens/lag_0": 4.0, "check/logprob_abs_diff_mean/lag_0": 1e-7,
             "check/ratio_out_of_band/lag_0": 0.0}
    assert out_of_band(mixed, cfg) == []
    mixed["check/logprob_abs_diff_mean/lag_0"] = 0.01
    assert out_of_band(mixed, cfg) == ["mean |trainer - sampler| log-prob 0.01 > 0.0001"]
