"""ActorWorker against hand computations with the plain HF model, in-process and as 2 FSDP2 ranks."""

import copy
import dataclasses
import math

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlcore.algos.losses import PolicyLossConfig, PolicyLossInput, get_policy_loss, register_policy_loss
from rlcore.engines.base import RolloutConfig
from rlcore.engines.layout import crop_padding
from rlcore.models.config import ModelConfig
from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup, RayResourcePool, RayWorkerGroup, WorkerError
from rlcore.typed_config import ConfigError, read_section
from rlcore.workers.actor import ActorWorker
from rlcore.workers.config import ActorConfig, TrainConfig, worker_device
from rlcore.workers.optim import build_lr_scheduler, lr_multiplier

LR = 0.1


def actor_config(path, **actor):
    """Plain SGD, no clipping, one row per micro-batch: an update is exactly -lr * gradient."""
    base = {"optimizer": "sgd", "lr": LR, "weight_decay": 0.0, "grad_clip": None,
            "ppo_micro_batch_size_per_gpu": 1, "shuffle": False}
    return {"model": {"path": path}, "actor": {**base, **actor}}


@pytest.fixture(scope="module")
def local_actor(tiny_model_dir):
    wg = LocalWorkerGroup(ClassWithInitArgs(ActorWorker, actor_config(tiny_model_dir)), world_size=1)
    wg.init_model()
    return wg


@pytest.fixture(scope="module")
def ray_actor(ray_cluster, tiny_model_dir):
    pool = RayResourcePool([2], num_cpus_per_process=0.5, name_prefix="actor_test")
    wg = RayWorkerGroup(pool, ClassWithInitArgs(ActorWorker, actor_config(tiny_model_dir)), default_timeout=300)
    wg.init_model()
    yield wg
    wg.shutdown()
    pool.shutdown()


@pytest.fixture(params=["local", "ray"])
def actor_group(request):
    return request.getfixturevalue(f"{request.param}_actor")


def hf_model(path, state=None):
    model = AutoModelForCausalLM.from_pretrained(path)
    if state is not None:
        model.load_state_dict(state)
    return model


def hand_log_probs(model, data, temperature=1.0):
    """log softmax at the position before each response token, gathered at that token; entropy there.
    Both 0 at response padding: see ``valid``."""
    b = data.batch
    prompt_width, (n, response_width) = b["prompts"].shape[1], b["responses"].shape
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits
    log_probs, entropy = torch.zeros(n, response_width), torch.zeros(n, response_width)
    for t in range(response_width):
        step = torch.log_softmax(logits[:, prompt_width - 1 + t] / temperature, dim=-1)
        log_probs[:, t] = step.gather(1, b["responses"][:, t : t + 1]).squeeze(1)
        entropy[:, t] = -(step.exp() * step).sum(-1)
    return valid(log_probs, data), valid(entropy, data)


def valid(per_token, data):
    """``per_token`` (B, T_r) with 0 at response padding. The worker crops each micro-batch to its
    rows' own width (``crop_padding``): past a micro-batch's longest response it returns 0, and inside
    it a short row's padding columns depend on which rows share the micro-batch; no caller reads
    either, so tests compare valid positions only."""
    return per_token * data.batch["response_mask"]


def with_old_log_probs(wg, data):
    return data.union(wg.compute_log_prob(data))


# ------------------------------------------------------------------------------------ log-probs
def test_compute_log_prob_matches_hand_computation(actor_group, tiny_model_dir, make_batch):
    data = make_batch()
    model = hf_model(tiny_model_dir, actor_group.get_full_state_dict())
    expected_lp, expected_entropy = hand_log_probs(model, data)
    out = actor_group.compute_log_prob(data)
    assert out.batch["old_log_probs"].shape == (4, 6)
    torch.testing.assert_close(valid(out.batch["old_log_probs"], data), expected_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(valid(out.batch["entropys"], data), expected_entropy, atol=1e-5, rtol=1e-5)


def test_temperature_divides_logits(local_actor, tiny_model_dir, make_batch):
    data = make_batch()
    data.meta_info["temperature"] = 0.5
    expected, _ = hand_log_probs(hf_model(tiny_model_dir, local_actor.get_full_state_dict()), data, temperature=0.5)
    torch.testing.assert_close(valid(local_actor.compute_log_prob(data).batch["old_log_probs"], data), expected,
                               atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------ updates
def test_update_is_dp_invariant_and_equals_global_token_mean_gradient(ray_actor, local_actor, tiny_model_dir,
                                                                     make_batch, tmp_path):
    """2 ranks x 2 micro-batches and 1 rank x 4 micro-batches take the same SGD step, the one of the
    global token-mean loss. Rank 0 holds the long responses (6+5 tokens), rank 1 the short (1+2), so
    averaging per-rank means (the naive DP loss) would weigh the short ones' tokens ~4x more."""
    ray_actor.save_checkpoint(str(tmp_path / "start"))  # one starting point, whatever ran before;
    local_actor.load_checkpoint(str(tmp_path / "start"))  # a 2-rank checkpoint resharded onto 1 rank
    before = ray_actor.get_full_state_dict()
    assert all(torch.equal(before[k], v) for k, v in local_actor.get_full_state_dict().items())
    data = with_old_log_probs(local_actor, make_batch())

    model = hf_model(tiny_model_dir, before)
    params = [p for _, p in model.named_parameters()]
    log_prob, _ = hand_log_probs(model, data)
    b, ppo = data.batch, get_policy_loss("ppo")

    settings = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, loss_agg_mode="token-mean")

    def loss_on(rows):
        inp = PolicyLossInput(log_prob[rows], b["old_log_probs"][rows], b["advantages"][rows], b["response_mask"][rows])
        return ppo(inp, settings)[0]

    global_loss = loss_on(slice(None))
    expected_grads = torch.autograd.grad(global_loss, params, retain_graph=True)
    naive_grads = torch.autograd.grad(0.5 * (loss_on(slice(0, 2)) + loss_on(slice(2, 4))), params)
    expected_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in expected_grads])).item()
    naive_gap = torch.linalg.vector_norm(torch.stack([(g - e).norm() for g, e in zip(naive_grads, expected_grads)]))
    assert naive_gap > 0.1 * expected_norm  # the naive per-rank mean is measurably wrong here

    # the plain contiguous split keeps the skew described above (a balanced one: tests/workers/test_balance_dp.py)
    ray_metrics, local_metrics = ray_actor.update_policy.options(balance=False)(data), local_actor.update_policy(data)
    assert len(ray_metrics) == 2 and len(local_metrics) == 1
    for m in ray_metrics + local_metrics:
        assert m["actor/grad_norm"] == pytest.approx(expected_norm, rel=1e-5)
        assert m["actor/loss"] == pytest.approx(global_loss.item(), rel=1e-5, abs=1e-7)
        assert m["actor/lr"] == LR
    expected_after = {n: p.detach() - LR * g for (n, p), g in zip(model.named_parameters(), expected_grads)}
    for wg in (ray_actor, local_actor):
        after = wg.get_full_state_dict()
        for name, value in expected_after.items():
            torch.testing.assert_close(after[name], value, atol=1e-6, rtol=1e-5, msg=name)


def test_micro_batches_cropped_to_their_rows_give_the_full_width_results(tiny_model_dir, make_batch):
    """Skewed rows, one per micro-batch (each cropped to its own length, ``crop_padding``) against
    one micro-batch of all four (the batch's full width, nothing to crop): the same log-probs and
    entropies at valid positions, and one update with the same loss, grad norm and weights. The
    loss is Dr. GRPO's seq-mean-token-sum-norm, which divides by the response width: the
    mini-batch's 6 (LossScale.norm_len), not a cropped micro-batch's own."""
    data = make_batch(prompt_lens=(5, 1, 2, 1), response_lens=(1, 6, 2, 1), seed=3)
    assert crop_padding(data[[3]])[0].batch["input_ids"].shape == (1, 2)  # row 3: 1 prompt + 1 response token
    kw = {"loss_agg_mode": "seq-mean-token-sum-norm", "entropy_coeff": 0.01, "use_kl_loss": True}
    groups = [LocalWorkerGroup(ClassWithInitArgs(ActorWorker, actor_config(tiny_model_dir, ppo_micro_batch_size_per_gpu=n,
                                                                           **kw)), 1) for n in (1, 4)]
    for wg in groups:
        wg.init_model()
    cropped, full = (wg.compute_log_prob(data) for wg in groups)
    for key in ("old_log_probs", "entropys"):
        assert cropped.batch[key].shape == (4, 6)
        torch.testing.assert_close(valid(cropped.batch[key], data), valid(full.batch[key], data), atol=1e-6, rtol=1e-6)
    assert cropped.batch["old_log_probs"][0, 1:].abs().sum() == 0  # row 0's micro-batch ended after 1 token
    data = data.union(full)
    data.batch["ref_log_prob"] = data.batch["old_log_probs"] - 0.1
    metrics = [wg.update_policy(data)[0] for wg in groups]
    for key in ("actor/loss", "actor/grad_norm"):
        assert metrics[0][key] == pytest.approx(metrics[1][key], rel=1e-5), key
    after = [wg.get_full_state_dict() for wg in groups]
    for name, value in after[1].items():
        torch.testing.assert_close(after[0][name], value, atol=1e-6, rtol=1e-5, msg=name)


def test_update_raises_log_probs_of_positive_advantage_tokens(actor_group, make_batch):
    data = make_batch(seed=1)
    sign = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None]
    data.batch["advantages"] = sign * data.batch["response_mask"]
    mask = data.batch["response_mask"].bool()
    positive, negative = mask & (sign > 0), mask & (sign < 0)
    start = actor_group.compute_log_prob(data).batch["old_log_probs"]
    for _ in range(2):
        data_step = with_old_log_probs(actor_group, data.select(batch_keys=list(data.batch.keys())))
        metrics = actor_group.update_policy(data_step)
    end = actor_group.compute_log_prob(data).batch["old_log_probs"]
    assert ((end - start)[positive] > 0.1).all()
    assert ((end - start)[negative] < -0.1).all()
    assert metrics[0]["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)  # one optimizer step per call: on-policy


def test_single_step_update_may_leave_out_old_log_probs(tiny_model_dir, make_batch):
    """One optimizer step per batch: the update's own detached log-probs serve as the old ones, with
    the same parameters and metrics as after compute_log_prob; with two steps they are required."""
    cfg = actor_config(tiny_model_dir, use_rollout_is=True)
    groups = [LocalWorkerGroup(ClassWithInitArgs(ActorWorker, cfg), 1) for _ in range(2)]
    for wg in groups:
        wg.init_model()
    data = make_batch(seed=2)
    data.batch["rollout_log_probs"] = with_old_log_probs(groups[0], make_batch(seed=2)).batch["old_log_probs"] - 0.1
    with_old = with_old_log_probs(groups[0], data.select(batch_keys=list(data.batch.keys())))
    metrics = [wg.update_policy(d)[0] for wg, d in zip(groups, (with_old, data))]
    assert metrics[1] == pytest.approx(metrics[0], rel=1e-6, abs=1e-7)
    assert metrics[1]["actor/is/weight_mean"] == pytest.approx(math.exp(0.1), rel=1e-5)
    for a, b in zip(groups[0].worker(0).module.parameters(), groups[1].worker(0).module.parameters()):
        torch.testing.assert_close(b.full_tensor(), a.full_tensor(), rtol=0, atol=1e-7)

    two_steps = LocalWorkerGroup(ClassWithInitArgs(ActorWorker, actor_config(tiny_model_dir, ppo_epochs=2)), 1)
    two_steps.init_model()
    with pytest.raises(WorkerError, match="old_log_probs.*ppo_epochs=1"):
        two_steps.update_policy(data)


def test_bf16_mixed_precision_keeps_float32_parameters(tiny_model_dir, make_batch):
    """model.mixed_precision=bfloat16: log-probs and the update agree with float32 to bf16 precision
    (and differ from it: the compute really is bf16); parameters and gradients stay float32."""
    groups = {}
    for name, mp in (("fp32", None), ("bf16", "bfloat16")):
        cfg = actor_config(tiny_model_dir)
        cfg["model"]["mixed_precision"] = mp
        groups[name] = LocalWorkerGroup(ClassWithInitArgs(ActorWorker, cfg), 1)
        groups[name].init_model()
    data = {name: with_old_log_probs(wg, make_batch(seed=3)) for name, wg in groups.items()}
    fp32, bf16 = (data[n].batch["old_log_probs"] * data[n].batch["response_mask"] for n in ("fp32", "bf16"))
    assert bf16.dtype == torch.float32
    assert 1e-4 < (bf16 - fp32).abs().max() < 0.05  # bf16 rounding: visible, small
    metrics = {name: wg.update_policy(data[name])[0] for name, wg in groups.items()}
    assert metrics["bf16"]["actor/grad_norm"] == pytest.approx(metrics["fp32"]["actor/grad_norm"], rel=0.05)
    module = groups["bf16"].worker(0).module
    assert {p.dtype for p in module.parameters()} == {torch.float32}
    for a, b in zip(groups["fp32"].worker(0).module.parameters(), module.parameters()):  # one SGD step, alike
        torch.testing.assert_close(b.full_tensor(), a.full_tensor(), rtol=0, atol=5e-3)

    bad = actor_config(tiny_model_dir)
    bad["model"].update(mixed_precision="bfloat16", dtype="bfloat16")
    with pytest.raises(ConfigError, match="config section 'model': .*model.dtype is 'bfloat16'"):  # at construction
        LocalWorkerGroup(ClassWithInitArgs(ActorWorker, bad), 1)


def test_dynamic_batch_size_gives_the_same_results(tiny_model_dir, make_batch):
    groups = [LocalWorkerGroup(ClassWithInitArgs(ActorWorker, actor_config(tiny_model_dir, **kw)), 1)
              for kw in ({"ppo_micro_batch_size_per_gpu": 3}, {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 12})]
    for wg in groups:
        wg.init_model()
    fixed, dynamic = (with_old_log_probs(wg, make_batch()) for wg in groups)
    torch.testing.assert_close(valid(dynamic.batch["old_log_probs"], fixed), valid(fixed.batch["old_log_probs"], fixed),
                               atol=1e-6, rtol=1e-6)
    norms = [wg.update_policy(d)[0]["actor/grad_norm"] for wg, d in zip(groups, (fixed, dynamic))]
    assert norms[1] == pytest.approx(norms[0], rel=1e-5)


def test_kl_loss_and_rollout_importance_weights(tiny_model_dir, make_batch):
    cfg = actor_config(tiny_model_dir, use_kl_loss=True, kl_loss_type="k2", use_rollout_is=True, rollout_is_cap=2.0)
    wg = LocalWorkerGroup(ClassWithInitArgs(ActorWorker, cfg), 1)
    wg.init_model()
    data = with_old_log_probs(wg, make_batch())
    data.batch["ref_log_prob"] = data.batch["old_log_probs"] - 0.2  # k2 = 0.5 * 0.2^2 at every token
    data.batch["rollout_log_probs"] = data.batch["old_log_probs"] - 0.1  # IS weight exp(0.1) < cap
    metrics = wg.update_policy(data)[0]
    assert metrics["actor/kl_loss"] == pytest.approx(0.02, rel=1e-4)
    assert metrics["actor/is/weight_mean"] == pytest.approx(math.exp(0.1), rel=1e-5)
    with pytest.raises(WorkerError, match="ref_log_prob"):
        wg.update_policy(data.select(batch_keys=[k for k in data.batch.keys() if k != "ref_log_prob"]))


def test_registered_loss_may_read_the_micro_batch(tiny_model_dir, make_batch):
    seen_settings = []

    @register_policy_loss("test_weighted_ppo")
    def weighted_ppo(inp, cfg):
        weight = inp.data.batch["weight"]
        seen_settings.append(cfg)
        loss, metrics = get_policy_loss("ppo")(dataclasses.replace(inp, advantages=inp.advantages * weight[:, None]), cfg)
        return loss, {**metrics, "weight_seen": float(weight.sum())}

    weighted_ppo.batch_keys = ("weight",)  # the actor keeps declared keys in the micro-batch

    wg = LocalWorkerGroup(ClassWithInitArgs(ActorWorker, actor_config(tiny_model_dir, policy_loss="test_weighted_ppo")), 1)
    wg.init_model()
    data = with_old_log_probs(wg, make_batch())
    data.batch["weight"] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert wg.update_policy(data)[0]["actor/weight_seen"] == pytest.approx(2.5)  # mean over 4 one-row micro-batches
    assert len(seen_settings) == 4 and all(isinstance(c, ActorConfig) for c in seen_settings)  # the actor section
    assert seen_settings[0].policy_loss == "test_weighted_ppo" and seen_settings[0].lr == LR


# ------------------------------------------------------------------------------------ roles and config
def test_reference_role(tiny_model_dir, make_batch):
    data = make_batch()
    ref = LocalWorkerGroup(ClassWithInitArgs(ActorWorker, actor_config(tiny_model_dir), role="ref"), 1)
    ref.init_model()
    expected, _ = hand_log_probs(hf_model(tiny_model_dir), data)
    torch.testing.assert_close(valid(ref.compute_ref_log_prob(data).batch["ref_log_prob"], data), expected,
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(WorkerError, match="has no optimizer"):
        ref.update_policy(with_old_log_probs(ref, data))


def test_actor_role_refuses_ref_log_prob(local_actor, make_batch):
    with pytest.raises(WorkerError, match="needs role 'ref'"):
        local_actor.compute_ref_log_prob(make_batch())


def test_config_errors_name_the_key(tiny_model_dir):
    with pytest.raises(ConfigError, match=r"actor\.clip_ratio\b"):
        ActorWorker(actor_config(tiny_model_dir, clip_ratio=0.3))
    with pytest.raises(ConfigError, match=r"config key actor\.lr: .*\(expected float\)"):
        ActorWorker(actor_config(tiny_model_dir, lr="abc"))
    with pytest.raises(ValueError, match="model.path is required"):
        ActorWorker({"actor": {}})
    with pytest.raises(ValueError, match="unknown policy loss 'ppo2'"):
        ActorWorker(actor_config(tiny_model_dir, policy_loss="ppo2"))
    with pytest.raises(ConfigError, match="config section 'actor': loss_agg_mode 'sum'"):
        ActorWorker(actor_config(tiny_model_dir, loss_agg_mode="sum"))
    with pytest.raises(ValueError, match="role"):
        ActorWorker(actor_config(tiny_model_dir), role="critic")
    worker = ActorWorker({**actor_config(tiny_model_dir), "rollout": {"n": 4}})
    assert isinstance(worker.model_cfg, ModelConfig) and worker.model_cfg.dtype == "float32"
    assert isinstance(worker.train_cfg, ActorConfig) and worker.train_cfg.lr == LR
    assert worker.train_cfg.clip_ratio_low == ActorConfig().clip_ratio_low  # defaults from the dataclass
    assert worker.config["rollout"] == {"n": 4}  # the raw whole config: sections a worker does not own pass through
    assert read_section(worker.config, "rollout", RolloutConfig).n == 4
    assert worker_device(worker.config) == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert worker_device(OmegaConf.create({"trainer": {"device": "cpu"}})) == torch.device("cpu")
    with pytest.raises(ValueError, match="trainer.device must be"):
        worker_device(OmegaConf.create({"trainer": {"device": "tpu"}}))


@pytest.mark.parametrize("section", [ActorConfig, ModelConfig])
def test_every_key_of_the_actor_sections_is_documented(section, undocumented_fields):
    """A field's comment is its documentation (``--cfg job`` shows the key, the source says what it means)."""
    assert undocumented_fields(section) == []


def test_lr_schedule_warmup_then_cosine():
    expected = [1 / 2, 1.0, 1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4)), 0.0, 0.0]
    assert [lr_multiplier(s, 2, 6, "cosine") for s in range(8)] == pytest.approx(expected)
    assert [lr_multiplier(s, 0, 4, "linear", min_lr_ratio=0.2) for s in range(5)] == pytest.approx([1, 0.8, 0.6, 0.4, 0.2])
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    cfg = TrainConfig(warmup_steps=2, total_steps=6, lr_scheduler="cosine")
    scheduler, seen = build_lr_scheduler(optimizer, cfg), []
    for _ in range(4):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([0.1 * m for m in expected[:4]])
    with pytest.raises(ValueError, match="total_steps"):
        lr_multiplier(0, 0, None, "cosine")


# ------------------------------------------------------------------------------------ checkpoints and export
def test_checkpoint_round_trip_restores_parameters(actor_group, make_batch, tmp_path):
    data = with_old_log_probs(actor_group, make_batch())
    actor_group.save_checkpoint(str(tmp_path / "ckpt"))
    saved = actor_group.get_full_state_dict()
    actor_group.update_policy(data)
    assert not torch.equal(actor_group.get_full_state_dict()["lm_head.weight"], saved["lm_head.weight"])
    actor_group.load_checkpoint(str(tmp_path / "ckpt"))
    restored = actor_group.get_full_state_dict()
    assert saved.keys() == restored.keys()
    assert all(torch.equal(restored[k], v) for k, v in saved.items())


def _optimizer_state(worker):
    """Optimizer state with every tensor as a plain local copy (FSDP2 keeps DTensors)."""
    state = copy.deepcopy(worker.optimizer.state_dict()["state"])
    return {i: {k: v.to_local().clone() if hasattr(v, "to_local") else v for k, v in s.items()} for i, s in state.items()}


def test_checkpoint_restores_adamw_state_schedule_and_rng(tiny_model_dir, make_batch, tmp_path):
    cfg = actor_config(tiny_model_dir, optimizer="adamw", lr=1e-2, warmup_steps=1, total_steps=5, lr_scheduler="linear")
    wg = LocalWorkerGroup(ClassWithInitArgs(ActorWorker, cfg), 1)
    wg.init_model()
    worker = wg.worker(0)
    data = with_old_log_probs(wg, make_batch())
    wg.update_policy(data)
    wg.save_checkpoint(str(tmp_path / "ckpt"))
    saved_params, saved_optim = wg.get_full_state_dict(), _optimizer_state(worker)
    saved_lr, saved_draw = worker.optimizer.param_groups[0]["lr"], torch.rand(3)
    assert saved_optim and all(s["exp_avg"].abs().sum() > 0 for s in saved_optim.values())
    wg.update_policy(data)
    assert worker.optimizer.param_groups[0]["lr"] != saved_lr
    wg.load_checkpoint(str(tmp_path / "ckpt"))
    assert all(torch.equal(wg.get_full_state_dict()[k], v) for k, v in saved_params.items())
    restored = _optimizer_state(worker)
    assert restored.keys() == saved_optim.keys()
    for i, s in saved_optim.items():
        assert all(torch.equal(torch.as_tensor(restored[i][k]), torch.as_tensor(v)) for k, v in s.items())
    assert worker.optimizer.param_groups[0]["lr"] == saved_lr
    assert torch.equal(torch.rand(3), saved_draw)  # the RNG resumes where the checkpoint left it
    assert worker.update_calls == 1


def test_export_hf_loads_with_from_pretrained(ray_actor, make_batch, tmp_path):
    out = str(tmp_path / "hf")
    ray_actor.export_hf(out)
    exported = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.decode(tokenizer("12 + 3 =")["input_ids"]) == "12 + 3 ="
    reference = hf_model(out, ray_actor.get_full_state_dict())
    data = make_batch()
    ids = data.batch["input_ids"]
    assert torch.equal(exported(ids).logits, reference(ids).logits)
    expected, _ = hand_log_probs(exported, data)
    torch.testing.assert_close(valid(ray_actor.compute_log_prob(data).batch["old_log_probs"], data), expected,
                               atol=1e-5, rtol=1e-5)
