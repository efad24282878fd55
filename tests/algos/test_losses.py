"""Numbers from rlcore.trainer.core_algos against references computed by hand or by plain loops."""

import math
import statistics

import numpy as np
import pytest
import torch

from rlcore.trainer import core_algos as ca

PAD = 1e6  # garbage at masked positions: any leak shows up at once


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64),
                               torch.as_tensor(expected, dtype=torch.float64), atol=atol, rtol=1e-5)


def whiten_ref(values):
    """Reference whitening of a flat list: (x - mean) / unbiased std."""
    mean, std = statistics.mean(values), statistics.stdev(values)
    return [(v - mean) / std for v in values]


# ------------------------------------------------------------------ masked statistics / logprobs


def test_masked_stats_ignore_padding_and_match_hand_values():
    x = torch.tensor([[1.0, 2.0, float("inf")], [3.0, float("nan"), PAD]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    close(ca.masked_sum(x, mask), 6.0)
    close(ca.masked_mean(x, mask), 2.0)
    close(ca.masked_mean(x, mask, dim=-1), [1.5, 3.0])
    close(ca.masked_var(x, mask), 1.0)  # (1 + 0 + 1) / (3 - 1)
    close(ca.masked_var(x, mask, unbiased=False), 2.0 / 3.0)
    close(ca.masked_whiten(x, mask), [[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]], atol=1e-4)
    close(ca.masked_whiten(x, mask, shift_mean=False), [[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]], atol=1e-4)
    close(ca.masked_mean(x, torch.zeros_like(mask)), 0.0)
    with pytest.raises(ValueError, match="no entries"):
        ca.masked_var(x, torch.zeros_like(mask))
    with pytest.raises(ValueError, match="shape"):
        ca.masked_sum(x, mask[:, :2])


def test_logprobs_and_entropy_from_logits():
    logits = torch.tensor([[[0.0, math.log(3.0)], [1.0, 1.0]]])  # (1, 2, V=2)
    labels = torch.tensor([[1, 0]])
    close(ca.logprobs_from_logits(logits, labels), [[math.log(0.75), math.log(0.5)]])
    close(ca.entropy_from_logits(logits), [[-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), math.log(2.0)]])

    torch.manual_seed(0)
    big = torch.randn(3, 5, 11) * 4
    lab = torch.randint(0, 11, (3, 5))
    ref = torch.log_softmax(big.double(), -1).gather(-1, lab.unsqueeze(-1)).squeeze(-1)
    close(ca.logprobs_from_logits(big, lab), ref)
    bf16 = ca.logprobs_from_logits(big.bfloat16(), lab)
    assert bf16.dtype == torch.bfloat16
    close(bf16.float(), ref, atol=0.1)
    with pytest.raises(ValueError, match="labels shape"):
        ca.logprobs_from_logits(big, lab[:, :4])


# ------------------------------------------------------------------ advantage estimators


def gae_ref(rewards, values, mask, gamma, lam):
    """Plain GAE over the valid positions of each row only."""
    adv_out, ret_out = [], []
    for r, v, m in zip(rewards, values, mask):
        idx = [t for t, keep in enumerate(m) if keep]
        adv_row, ret_row = [0.0] * len(m), [0.0] * len(m)
        last = 0.0
        for k in reversed(range(len(idx))):
            t = idx[k]
            next_v = v[idx[k + 1]] if k + 1 < len(idx) else 0.0
            delta = r[t] + gamma * next_v - v[t]
            last = delta + gamma * lam * last
            adv_row[t], ret_row[t] = last, last + v[t]
        adv_out.append(adv_row)
        ret_out.append(ret_row)
    return adv_out, ret_out


@pytest.mark.parametrize("mask", [[[1, 1, 1, 0], [1, 1, 0, 0]], [[1, 0, 1, 1], [1, 1, 0, 0]]])
def test_gae_matches_python_loop_with_padding(mask):
    rewards = [[0.1, -0.2, 1.0, PAD], [0.3, 0.5, PAD, PAD]]
    values = [[0.5, 0.4, 0.2, PAD], [0.1, -0.3, PAD, PAD]]
    if mask[0][1] == 0:  # interior masked token (e.g. tool output): skipped, not a value source
        values[0][1], rewards[0][1] = PAD, PAD
    exp_adv, exp_ret = gae_ref(rewards, values, mask, gamma=0.9, lam=0.8)
    kw = dict(token_level_rewards=torch.tensor(rewards), values=torch.tensor(values),
              response_mask=torch.tensor(mask, dtype=torch.float32), gamma=0.9, lam=0.8)

    adv, ret = ca.compute_gae_advantage_return(**kw, whiten=False)
    close(adv, exp_adv)
    close(ret, exp_ret)

    adv_w, ret_w = ca.get_advantage_estimator("gae")(**kw)  # whiten=True by default
    close(ret_w, exp_ret)
    flat = [a for row, m in zip(exp_adv, mask) for a, keep in zip(row, m) if keep]
    white = iter(whiten_ref(flat))
    close(adv_w, [[next(white) if keep else 0.0 for keep in m] for m in mask], atol=1e-4)


def test_gae_hand_numbers_single_row():
    # gamma=0.9, lam=0.8, V=[1, 2], r=[0, 1], last token bootstraps from 0:
    # delta1 = 1 - 2 = -1 ; delta0 = 0 + 0.9*2 - 1 = 0.8 ; A0 = 0.8 + 0.72*(-1) = 0.08
    adv, ret = ca.compute_gae_advantage_return(
        torch.tensor([[0.0, 1.0, PAD]]), torch.tensor([[1.0, 2.0, PAD]]), torch.tensor([[1, 1, 0]]),
        gamma=0.9, lam=0.8, whiten=False)
    close(adv, [[0.08, -1.0, 0.0]])
    close(ret, [[1.08, 1.0, 0.0]])


def outcome_batch():
    """Five sequences of different lengths; the score sits on the last valid token.
    Groups: a -> scores [1, 0, 2], b -> [3, 1], c -> [5] (a singleton)."""
    index = np.array(["a", "b", "a", "b", "a", "c"], dtype=object)
    scores = [1.0, 3.0, 0.0, 1.0, 2.0, 5.0]
    lengths = [3, 1, 2, 3, 2, 2]
    T = 4
    rewards = torch.zeros(len(scores), T)
    mask = torch.zeros(len(scores), T)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        rewards[i, n - 1] = s
        mask[i, :n] = 1
    return rewards, mask, index


def broadcast_ref(per_seq, mask):
    return [[a if keep else 0.0 for keep in m] for a, m in zip(per_seq, mask.tolist())]


def test_grpo_two_groups_and_singleton():
    rewards, mask, index = outcome_batch()
    eps = 1e-6
    # group a: scores 1, 0, 2 -> mean 1, unbiased std 1; group b: 3, 1 -> mean 2, std sqrt(2);
    # group c: singleton -> mean 0, std 1.
    s2 = math.sqrt(2.0)
    expected = [0.0, 1 / (s2 + eps), -1 / (1 + eps), -1 / (s2 + eps), 1 / (1 + eps), 5 / (1 + eps)]
    adv, ret = ca.get_advantage_estimator("grpo")(token_level_rewards=rewards, response_mask=mask, index=index)
    close(adv, broadcast_ref(expected, mask))
    close(ret, adv)
    # index given as a plain list of uids gives the same
    adv_list, _ = ca.compute_grpo_outcome_advantage(rewards, mask, list(index))
    close(adv_list, adv)
    with pytest.raises(ValueError, match="one group id per sequence"):
        ca.compute_grpo_outcome_advantage(rewards, mask, index[:3])


def test_dr_grpo_drops_std():
    rewards, mask, index = outcome_batch()
    expected = [0.0, 1.0, -1.0, -1.0, 1.0, 5.0]
    adv, _ = ca.get_advantage_estimator("dr_grpo")(token_level_rewards=rewards, response_mask=mask, index=index)
    close(adv, broadcast_ref(expected, mask))
    adv2, _ = ca.compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std=False)
    close(adv2, adv)


def test_rloo_leave_one_out_baseline():
    rewards, mask, index = outcome_batch()
    # a: 1-(0+2)/2=0, 0-(1+2)/2=-1.5, 2-(1+0)/2=1.5 ; b: 3-1=2, 1-3=-2 ; c: no others -> 5
    expected = [0.0, 2.0, -1.5, -2.0, 1.5, 5.0]
    adv, ret = ca.get_advantage_estimator("rloo")(token_level_rewards=rewards, response_mask=mask, index=index)
    close(adv, broadcast_ref(expected, mask))
    close(ret, adv)


def test_reinforce_plus_plus_return_to_go_and_whitening():
    rewards = torch.tensor([[1.0, 0.0, 2.0, PAD], [0.0, 3.0, PAD, PAD]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    # gamma 0.5: row0 G2=2, G1=0+0.5*2=1, G0=1+0.5*1=1.5 ; row1 G1=3, G0=1.5
    expected_ret = [[1.5, 1.0, 2.0, 0.0], [1.5, 3.0, 0.0, 0.0]]
    adv, ret = ca.get_advantage_estimator("reinforce_plus_plus")(
        token_level_rewards=rewards, response_mask=mask, gamma=0.5)
    close(ret, expected_ret)
    w = whiten_ref([1.5, 1.0, 2.0, 1.5, 3.0])
    close(adv, [[w[0], w[1], w[2], 0.0], [w[3], w[4], 0.0, 0.0]], atol=1e-4)


def test_reinforce_plus_plus_baseline():
    rewards, mask, index = outcome_batch()
    centred = [0.0, 1.0, -1.0, -1.0, 1.0, 5.0]  # score minus group mean (a singleton's mean is 0)
    flat = [c for c, m in zip(centred, mask.tolist()) for keep in m if keep]
    white = iter(whiten_ref(flat))
    expected = [[next(white) if keep else 0.0 for keep in m] for m in mask.tolist()]
    adv, _ = ca.get_advantage_estimator("reinforce_plus_plus_baseline")(
        token_level_rewards=rewards, response_mask=mask, index=index)
    close(adv, expected, atol=1e-4)


def test_remax_subtracts_greedy_baseline():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.5, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    adv, ret = ca.get_advantage_estimator("remax")(
        token_level_rewards=rewards, reward_baselines=torch.tensor([0.25, 1.0]), response_mask=mask)
    close(ret, [[1.0, 1.0, 1.0, 0.0], [0.5, 0.0, 0.0, 0.0]])
    close(adv, [[0.75, 0.75, 0.75, 0.0], [-0.5, -1.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match="reward_baselines"):
        ca.compute_remax_outcome_advantage(rewards, torch.tensor([0.25]), mask)


def test_registries_reject_unknown_names():
    with pytest.raises(ValueError, match="known:.*grpo"):
        ca.get_advantage_estimator("nope")
    with pytest.raises(ValueError, match="known:.*dual_clip"):
        ca.get_policy_loss("nope")
    with pytest.raises(ValueError, match="already registered"):
        ca.register_advantage_estimator("gae")(lambda: None)


# ------------------------------------------------------------------ KL


def test_kl_penalty_kinds_on_hand_numbers():
    logp = torch.tensor([-1.0, -2.0, -6.0])
    ref = torch.tensor([-1.5, -1.0, -1.0])  # logp - ref = 0.5, -1, -5
    close(ca.kl_penalty(logp, ref, "k1"), [0.5, -1.0, -5.0])
    close(ca.kl_penalty(logp, ref, "kl"), [0.5, -1.0, -5.0])
    close(ca.kl_penalty(logp, ref, "abs"), [0.5, 1.0, 5.0])
    close(ca.kl_penalty(logp, ref, "k2"), [0.125, 0.5, 12.5])
    close(ca.kl_penalty(logp, ref, "mse"), [0.125, 0.5, 12.5])
    # k3: exp(d) - d - 1 with d = ref - logp = -0.5, 1, 5 (e^5 - 6 = 142.4 -> clamped to 10)
    k3 = [math.exp(-0.5) + 0.5 - 1, math.e - 2, 10.0]
    close(ca.kl_penalty(logp, ref, "k3"), k3)
    close(ca.kl_penalty(logp, ref, "low_var_kl"), k3)
    with pytest.raises(ValueError, match="unknown kl_penalty kind"):
        ca.kl_penalty(logp, ref, "k4")


def test_k3_gradient_stays_finite_for_huge_log_ratio():
    logp = torch.tensor([-200.0, -1.0], requires_grad=True)
    ca.kl_penalty(logp, torch.tensor([0.0, -1.5]), "k3").sum().backward()
    assert torch.isfinite(logp.grad).all()
    # d/dlogp [exp(ref - logp) - (ref - logp) - 1] = -exp(ref - logp) + 1 at ref - logp = -0.5
    close(logp.grad[1], 1 - math.exp(-0.5))


def test_adaptive_kl_controller_update_formula_and_state():
    ctl = ca.get_kl_controller("adaptive", init_kl_coef=0.2, target_kl=6.0, horizon=10000)
    ctl.update(current_kl=9.0, n_steps=256)  # error = clip(9/6 - 1) = 0.2
    close(ctl.value, 0.2 * (1 + 0.2 * 256 / 10000))
    ctl.update(current_kl=5.4, n_steps=100)  # error = -0.1
    expected = 0.2 * (1 + 0.2 * 256 / 10000) * (1 - 0.1 * 100 / 10000)
    close(ctl.value, expected)
    restored = ca.AdaptiveKLController(init_kl_coef=1.0, target_kl=6.0, horizon=10000)
    restored.load_state_dict(ctl.state_dict())
    close(restored.value, expected)

    fixed = ca.get_kl_controller("fixed", kl_coef=0.05)
    fixed.update(100.0, 10)
    assert fixed.value == 0.05
    with pytest.raises(ValueError, match="known: fixed, adaptive"):
        ca.get_kl_controller("pid")
    with pytest.raises(ValueError, match="target_kl"):
        ca.AdaptiveKLController(0.1, 0.0, 10)


def test_apply_kl_penalty_rewards_metrics_and_controller_update():
    scores = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0]])
    logp = torch.tensor([[-1.0, -1.0, float("inf")], [-2.0, -2.0, -2.0]])
    ref = torch.tensor([[-1.5, -2.0, 0.0], [-1.0, -2.0, -2.0]])  # k1: [0.5, 1, -], [-1, 0, 0]
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    ctl = ca.AdaptiveKLController(init_kl_coef=0.1, target_kl=1.0, horizon=100)
    rewards, metrics = ca.apply_kl_penalty(scores, logp, ref, mask, ctl, kind="k1")
    close(rewards, [[-0.05, 0.9, 0.0], [2.1, 0.0, 0.0]])
    batch_kl = ((0.5 + 1.0) / 2 + (-1.0) / 3) / 2
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(batch_kl)
    assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(0.1)
    error = max(batch_kl / 1.0 - 1, -0.2)
    close(ctl.value, 0.1 * (1 + error * 2 / 100))


# ------------------------------------------------------------------ loss aggregation


def test_agg_loss_local_modes_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, PAD, PAD], [PAD, PAD, PAD]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # last row: DP padding, not a sequence
    close(ca.agg_loss(loss, mask, "token-mean"), 10.0 / 4)
    close(ca.agg_loss(loss, mask, "seq-mean-token-sum"), (6.0 + 4.0) / 2)
    close(ca.agg_loss(loss, mask, "seq-mean-token-mean"), (2.0 + 4.0) / 2)
    close(ca.agg_loss(loss, mask, "seq-mean-token-sum-norm"), (6.0 / 3 + 4.0 / 3) / 2)
    close(ca.agg_loss(loss, mask, "seq-mean-token-sum-norm", norm_len=10), (0.6 + 0.4) / 2)
    with pytest.raises(ValueError, match="unknown loss_agg_mode"):
        ca.agg_loss(loss, mask, "token-sum")
    with pytest.raises(ValueError, match="global_tokens"):
        ca.agg_loss(loss, mask, "token-mean", global_tokens=0)


def dp_batch():
    torch.manual_seed(3)
    lengths = [1, 6, 3, 2, 5, 4, 6, 2]
    T = 6
    loss = torch.randn(8, T) + torch.arange(8).unsqueeze(-1) * 0.5  # per-sequence offsets
    mask = torch.zeros(8, T)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    loss = torch.where(mask.bool(), loss, torch.full_like(loss, PAD))
    rows = [[loss[i, t].item() for t in range(n)] for i, n in enumerate(lengths)]
    global_means = {
        "token-mean": sum(sum(r) for r in rows) / sum(lengths),
        "seq-mean-token-sum": sum(sum(r) for r in rows) / 8,
        "seq-mean-token-mean": sum(sum(r) / len(r) for r in rows) / 8,
        "seq-mean-token-sum-norm": sum(sum(r) / T for r in rows) / 8,
    }
    # 2 DP ranks x 2 micro-batches of unequal sizes (as token-balanced batching produces)
    ranks = [[[0], [1, 2, 3]], [[4, 5], [6, 7]]]
    return loss, mask, global_means, ranks


@pytest.mark.parametrize("mode", ca.LOSS_AGG_MODES)
def test_agg_loss_is_dp_and_micro_batch_invariant(mode):
    loss, mask, global_means, ranks = dp_batch()
    dp_size = len(ranks)
    global_tokens, global_seqs = int(mask.sum()), 8

    per_rank = []  # gradient accumulation: sum contributions, no further division
    for micro_batches in ranks:
        per_rank.append(sum(
            ca.agg_loss(loss[mb], mask[mb], mode, global_tokens=global_tokens,
                        global_seqs=global_seqs, dp_size=dp_size)
            for mb in micro_batches))
    all_reduced = sum(per_rank) / dp_size  # what DDP/FSDP do with gradients
    close(all_reduced, global_means[mode])

    # the naive recipe (local mean per micro-batch, divided by the number of micro-batches,
    # averaged over ranks) is biased by how the batch was cut
    naive = sum(sum(ca.agg_loss(loss[mb], mask[mb], mode) for mb in mbs) / len(mbs) for mbs in ranks) / dp_size
    assert abs(float(naive) - global_means[mode]) > 1e-2


def test_agg_loss_gradient_equals_global_mean_gradient():
    loss, mask, _, ranks = dp_batch()
    leaf = loss.clone().requires_grad_(True)
    total = sum(ca.agg_loss(leaf[mb], mask[mb], "token-mean", global_tokens=int(mask.sum()), dp_size=2)
                for mbs in ranks for mb in mbs) / 2
    total.backward()
    close(leaf.grad, mask / mask.sum())


# ------------------------------------------------------------------ policy losses


def ppo_example():
    """Row 0: four valid tokens; row 1: one valid token then padding. old_log_prob = 0 so the
    ratio is exp(log_prob)."""
    ratios = torch.tensor([[1.5, 0.9, 0.5, 1.1], [0.7, 1.0, 1.0, 1.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0], [2.0, PAD, PAD, PAD]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float32)
    return torch.log(ratios), torch.zeros(2, 4), adv, mask


def test_ppo_clip_loss_hand_example():
    logp, old, adv, mask = ppo_example()
    # per token: A=1,r=1.5 -> max(-1.5,-1.2)=-1.2 (clipped); A=1,r=0.9 -> -0.9;
    # A=-1,r=0.5 -> max(0.5,0.8)=0.8 (clipped); A=-1,r=1.1 -> 1.1; A=2,r=0.7 -> max(-1.4,-1.6)=-1.4
    loss, m = ca.get_policy_loss("ppo")(logp, old, adv, mask)
    close(loss, (-1.2 - 0.9 + 0.8 + 1.1 - 1.4) / 5)
    assert m["pg_loss"] == pytest.approx(-1.6 / 5, abs=1e-6)
    assert m["pg_clipfrac"] == pytest.approx(2 / 5)
    assert m["pg_clipfrac_lower"] == 0.0
    assert m["ppo_kl"] == pytest.approx(-sum(math.log(r) for r in [1.5, 0.9, 0.5, 1.1, 0.7]) / 5, abs=1e-6)
    with pytest.raises(ValueError, match="advantages"):
        ca.compute_policy_loss_ppo(logp, old, adv[:, :3], mask)


def test_ppo_loss_gradient_matches_analytic():
    logp, old, adv, mask = ppo_example()
    logp = logp.clone().requires_grad_(True)
    loss, _ = ca.compute_policy_loss_ppo(logp, old, adv, mask)
    loss.backward()
    # d/dlogp of -A * exp(logp) is -A * r where unclipped, 0 where the clip is active or masked
    expected = torch.tensor([[0.0, -0.9, 0.0, 1.1], [-1.4, 0.0, 0.0, 0.0]]) / 5
    close(logp.grad, expected)


def test_dual_clip_caps_negative_advantage_loss():
    logp = torch.log(torch.tensor([[5.0, 2.0, 5.0]]))
    old = torch.zeros(1, 3)
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    mask = torch.ones(1, 3)
    # ppo: [max(5, 1.2)=5, 2, max(-5, -1.2)=-1.2]; dual clip caps A<0 tokens at -A*3 = 3
    ppo_loss, _ = ca.compute_policy_loss_ppo(logp, old, adv, mask)
    close(ppo_loss, (5.0 + 2.0 - 1.2) / 3)
    loss, m = ca.get_policy_loss("dual_clip")(logp, old, adv, mask, clip_ratio_c=3.0)
    close(loss, (3.0 + 2.0 - 1.2) / 3)
    assert m["pg_clipfrac_lower"] == pytest.approx(1 / 3)
    assert m["pg_clipfrac"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="clip_ratio_c > 1"):
        ca.compute_policy_loss_dual_clip(logp, old, adv, mask, clip_ratio_c=1.0)


def test_clip_higher_uses_asymmetric_bounds():
    logp = torch.log(torch.tensor([[1.25, 1.3, 0.75]]))
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    mask = torch.ones(1, 3)
    # high 0.28: r=1.25 stays, r=1.3 -> 1.28 ; low 0.2: r=0.75 -> 0.8
    loss, m = ca.get_policy_loss("clip_higher")(logp, old, adv, mask)
    close(loss, (-1.25 - 1.28 + 0.8) / 3)
    assert m["pg_clipfrac"] == pytest.approx(2 / 3)
    sym, _ = ca.compute_policy_loss_ppo(logp, old, adv, mask)
    close(sym, (-1.2 - 1.2 + 0.8) / 3)
    asym, _ = ca.compute_policy_loss_ppo(logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    close(asym, loss)


def test_reinforce_loss_is_unclipped():
    logp, old, adv, mask = ppo_example()
    loss, m = ca.get_policy_loss("reinforce")(logp, old, adv, mask)
    close(loss, (-1.5 - 0.9 + 0.5 + 1.1 - 1.4) / 5)
    assert m["pg_clipfrac"] == 0.0


def test_is_weights_scale_per_token_loss():
    logp, old, adv, mask = ppo_example()
    w = torch.tensor([[1.0, 2.0, 0.5, 0.0], [3.0, PAD, PAD, PAD]])
    loss, _ = ca.compute_policy_loss_ppo(logp, old, adv, mask, is_weights=w)
    close(loss, (-1.2 * 1 - 0.9 * 2 + 0.8 * 0.5 + 1.1 * 0 - 1.4 * 3) / 5)


def test_compute_is_weights_token_and_sequence():
    old = torch.log(torch.tensor([[0.5, 3.0, 1.5], [3.0, 3.0, 7.0]]))
    rollout = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    w, m = ca.compute_is_weights(old, rollout, mask, cap=2.0, level="token")
    close(w, [[0.5, 2.0, 1.5], [2.0, 2.0, 0.0]])
    assert m["is/capped_frac"] == pytest.approx(3 / 5)
    assert m["is/weight_mean"] == pytest.approx((0.5 + 2 + 1.5 + 2 + 2) / 5)

    old_seq = torch.log(torch.tensor([[0.5, 3.0, 1.0], [3.0, 3.0, 7.0]]))
    # row 0: 0.5 * 3 * 1 = 1.5 ; row 1: 3 * 3 = 9 (the 7 is masked) -> capped at 4
    w, m = ca.compute_is_weights(old_seq, rollout, mask, cap=4.0, level="sequence")
    close(w, [[1.5, 1.5, 1.5], [4.0, 4.0, 0.0]])
    assert m["is/capped_frac"] == pytest.approx(0.5)
    assert not w.requires_grad
    with pytest.raises(ValueError, match="level"):
        ca.compute_is_weights(old, rollout, mask, level="batch")


# ------------------------------------------------------------------ value loss and DPO


def test_value_loss_clipping():
    vpreds = torch.tensor([[1.0, 0.2, -1.0, 0.3, PAD]])
    values = torch.zeros(1, 5)
    returns = torch.tensor([[2.0, 1.0, 0.0, 0.3, PAD]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    # v=1 clipped to 0.5: max(1, 2.25) = 2.25 (clip wins) ; 0.64 ; v=-1 -> max(1, 0.25) = 1 ; 0
    loss, m = ca.compute_value_loss(vpreds, values, returns, mask, cliprange_value=0.5)
    close(loss, 0.5 * (2.25 + 0.64 + 1.0 + 0.0) / 4)
    assert m["vf_clipfrac"] == pytest.approx(0.25)
    assert m["vf_loss"] == pytest.approx(0.5 * 3.89 / 4, abs=1e-6)


def dpo_inputs():
    # logits = (pc - pr) - (rc - rr) = [2, -1]
    return (torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -1.0]),
            torch.tensor([-2.0, -2.0]), torch.tensor([-2.0, -2.0]))


def test_dpo_sigmoid_with_label_smoothing():
    def nls(x):  # -logsigmoid(x)
        return math.log1p(math.exp(-x))

    loss, m = ca.compute_dpo_loss(*dpo_inputs(), beta=0.5)
    close(loss, (nls(1.0) + nls(-0.5)) / 2)
    assert m["dpo/reward_chosen"] == pytest.approx(0.25)  # 0.5 * [1, 0]
    assert m["dpo/reward_rejected"] == pytest.approx(0.0)  # 0.5 * [-1, 1]
    assert m["dpo/reward_margin"] == pytest.approx(0.25)  # mean of [1, -0.5]
    assert m["dpo/accuracy"] == pytest.approx(0.5)

    smooth, _ = ca.compute_dpo_loss(*dpo_inputs(), beta=0.5, label_smoothing=0.1)
    close(smooth, (0.9 * nls(1.0) + 0.1 * nls(-1.0) + 0.9 * nls(-0.5) + 0.1 * nls(0.5)) / 2)


def test_dpo_ipo_and_errors():
    loss, _ = ca.compute_dpo_loss(*dpo_inputs(), beta=0.5, loss_type="ipo")
    close(loss, ((2 - 1) ** 2 + (-1 - 1) ** 2) / 2)  # target margin 1 / (2 * 0.5) = 1
    with pytest.raises(ValueError, match="loss_type"):
        ca.compute_dpo_loss(*dpo_inputs(), loss_type="hinge2")
    with pytest.raises(ValueError, match="sigmoid loss only"):
        ca.compute_dpo_loss(*dpo_inputs(), loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"shape \(B,\)"):
        ca.compute_dpo_loss(*(t.unsqueeze(0) for t in dpo_inputs()))
