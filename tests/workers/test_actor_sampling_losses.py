"""ActorWorker with the GSPO / CISPO losses, masked IS weights, and the sampler's top-k / top-p:
each against a hand-built reference run (in-process, one rank)."""

import pytest
import torch
from rollout_fixtures import local_rollout, make_prompts

from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup
from rlcore.workers.actor import ActorWorker

LR = 0.1


def actor(path, **settings):
    """Plain SGD, no clipping, one row per micro-batch: an update is exactly -lr * gradient."""
    base = {"optimizer": "sgd", "lr": LR, "weight_decay": 0.0, "grad_clip": None,
            "ppo_micro_batch_size_per_gpu": 1, "shuffle": False}
    wg = LocalWorkerGroup(ClassWithInitArgs(ActorWorker, {"model": {"path": path}, "actor": {**base, **settings}}), 1)
    wg.init_model()
    return wg


def max_diff(a, b):
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("loss,agg", [("cispo", "token-mean"), ("gspo_token", "token-mean"),
                                      ("gspo", "seq-mean-token-mean")])
def test_gspo_and_cispo_take_reinforces_step_on_policy(tiny_model_dir, make_batch, loss, agg):
    """On-policy (ratio 1, one advantage per response) CISPO's weight is 1 and GSPO's sequence
    ratio is 1, so their gradient is REINFORCE's -A d log pi under the same aggregation: the SGD
    steps must be the same, and not zero."""
    data = make_batch()
    per_row = torch.tensor([1.0, -0.5, 2.0, -1.5])[:, None]
    data.batch["advantages"] = per_row * data.batch["response_mask"]
    runs = {}
    for name in (loss, "reinforce"):
        wg = actor(tiny_model_dir, policy_loss=name, loss_agg_mode=agg)
        before = wg.get_full_state_dict()
        metrics = wg.update_policy(data)[0]
        runs[name] = wg.get_full_state_dict()
        assert metrics["actor/pg_clipfrac"] == 0.0
    assert max_diff(runs[loss], before) > 1e-4  # the weights moved
    assert max_diff(runs[loss], runs["reinforce"]) < 1e-6


def test_mask_mode_drops_tokens_from_the_loss_and_its_token_count(tiny_model_dir, make_batch):
    """rollout_is_mode=mask with cap 2 (lower 1/2): tokens whose pi_old / pi_rollout is e^2 or
    e^-2 leave the loss; the step equals that of a plain run whose response_mask lacks them (the
    token-mean denominator shrinks too, 14 -> 11 tokens). No old_log_probs: a single-step update."""
    data = make_batch()  # 6 + 5 + 1 + 2 = 14 valid tokens
    masked = actor(tiny_model_dir, use_rollout_is=True, rollout_is_mode="mask", rollout_is_cap=2.0)
    old = masked.compute_log_prob(data).batch["old_log_probs"]
    shift = torch.zeros_like(old)
    shift[0, 1], shift[0, 4], shift[1, 0] = 2.0, -2.0, 2.0  # w = e^2 > 2 twice, e^-2 < 1/2 once
    data.batch["rollout_log_probs"] = old - shift  # elsewhere w = 1
    metrics = masked.update_policy(data)[0]
    assert metrics["actor/is/masked_frac"] == pytest.approx(3 / 14)
    assert metrics["actor/is/masked_seq_frac"] == pytest.approx(2 / 4)
    assert metrics["actor/is/weight_mean"] == pytest.approx(1.0, abs=1e-5)  # the kept tokens

    reference = data.select(batch_keys=[k for k in data.batch.keys() if k != "rollout_log_probs"])
    reference.batch["response_mask"] = data.batch["response_mask"] * (shift == 0)
    plain = actor(tiny_model_dir)
    plain.update_policy(reference)
    assert max_diff(masked.get_full_state_dict(), plain.get_full_state_dict()) < 1e-6


@pytest.mark.parametrize("sampling", [{"temperature": 0.7, "top_k": 5}, {"temperature": 1.3, "top_p": 0.3},
                                      {"temperature": 1.0, "top_k": 8, "top_p": 0.8}])
def test_actor_log_probs_equal_the_hf_samplers_under_top_k_top_p(model_dir, tok, sampling):
    """Same weights: the actor's log-probs of the sampled tokens are the HF engine's (processed,
    truncated) ones, because the rollout records top_k / top_p and the actor applies them. Scored
    under the full softmax instead, they differ: an IS weight would be biased on every token."""
    rollout = local_rollout(model_dir, max_new_tokens=8, seed=0)
    out = rollout.generate_sequences(make_prompts(tok, meta_info={**sampling, "n": 2, "seed": 3}))
    assert {k: out.meta_info[k] for k in sampling} == sampling
    policy = actor(model_dir)
    mask = out.batch["response_mask"].bool()
    rollout_lp = out.batch["rollout_log_probs"][mask]
    actor_lp = policy.compute_log_prob(out).batch["old_log_probs"][mask]
    torch.testing.assert_close(actor_lp, rollout_lp, atol=1e-5, rtol=1e-5)
    for key in ("top_k", "top_p"):
        out.meta_info.pop(key, None)
    unfiltered = policy.compute_log_prob(out).batch["old_log_probs"][mask]
    assert (unfiltered - rollout_lp).abs().max() > 1e-2
