"""rlcore.algos.losses: loss aggregation, the policy losses and the value loss against hand-computed numbers."""

import math

import pytest
import torch
from algo_refs import PAD, close

from rlcore.algos import losses as L
from rlcore.algos.losses import LossScale, PolicyLossConfig, PolicyLossInput


def run_loss(name, logp, old, adv, mask, is_weights=None, scale=LossScale(), **settings):
    """Call the registered policy loss ``name`` the way the actor does: tensors in a PolicyLossInput,
    settings in a PolicyLossConfig."""
    inp = PolicyLossInput(logp, old, adv, mask, is_weights=is_weights, scale=scale)
    return L.get_policy_loss(name)(inp, PolicyLossConfig(policy_loss=name, **settings))


# ------------------------------------------------------------------ loss aggregation


def test_agg_loss_local_modes_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, PAD, PAD], [PAD, PAD, PAD]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # last row: DP padding, not a sequence
    close(L.agg_loss(loss, mask, "token-mean"), 10.0 / 4)
    close(L.agg_loss(loss, mask, "seq-mean-token-sum"), (6.0 + 4.0) / 2)
    close(L.agg_loss(loss, mask, "seq-mean-token-mean"), (2.0 + 4.0) / 2)
    close(L.agg_loss(loss, mask, "seq-mean-token-sum-norm"), (6.0 / 3 + 4.0 / 3) / 2)
    close(L.agg_loss(loss, mask, "seq-mean-token-sum-norm", norm_len=10), (0.6 + 0.4) / 2)
    # a cropped micro-batch's scale carries the mini-batch's width: rows 0-1 cropped to 2 columns
    # still divide by 10 (and an explicit norm_len wins over the scale's)
    close(L.agg_loss(loss[:2, :2], mask[:2, :2], "seq-mean-token-sum-norm", LossScale(norm_len=10)), (0.3 + 0.4) / 2)
    close(L.agg_loss(loss, mask, "seq-mean-token-sum-norm", LossScale(norm_len=10), norm_len=5), (1.2 + 0.8) / 2)
    with pytest.raises(ValueError, match="unknown loss_agg_mode"):
        L.agg_loss(loss, mask, "token-sum")
    with pytest.raises(ValueError, match="global_tokens"):
        L.agg_loss(loss, mask, "token-mean", LossScale(global_tokens=0))
    with pytest.raises(ValueError, match="global_seqs"):
        L.agg_loss(loss, mask, "seq-mean-token-mean", LossScale(global_seqs=0))
    with pytest.raises(ValueError, match="dp_size"):
        LossScale(dp_size=0)


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


@pytest.mark.parametrize("mode", L.LOSS_AGG_MODES)
def test_agg_loss_is_dp_and_micro_batch_invariant(mode):
    loss, mask, global_means, ranks = dp_batch()
    dp_size = len(ranks)
    global_tokens, global_seqs = int(mask.sum()), 8

    per_rank = []  # gradient accumulation: sum contributions, no further division
    for micro_batches in ranks:
        per_rank.append(sum(
            L.agg_loss(loss[mb], mask[mb], mode,
                       LossScale(global_tokens=global_tokens, global_seqs=global_seqs, dp_size=dp_size))
            for mb in micro_batches))
    all_reduced = sum(per_rank) / dp_size  # what DDP/FSDP do with gradients
    close(all_reduced, global_means[mode])

    # the naive recipe (local mean per micro-batch, divided by the number of micro-batches,
    # averaged over ranks) is biased by how the batch was cut
    naive = sum(sum(L.agg_loss(loss[mb], mask[mb], mode) for mb in mbs) / len(mbs) for mbs in ranks) / dp_size
    assert abs(float(naive) - global_means[mode]) > 1e-2


def test_agg_loss_gradient_equals_global_mean_gradient():
    loss, mask, _, ranks = dp_batch()
    leaf = loss.clone().requires_grad_(True)
    total = sum(L.agg_loss(leaf[mb], mask[mb], "token-mean", LossScale(global_tokens=int(mask.sum()), dp_size=2))
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
    loss, m = L.get_policy_loss("ppo")(PolicyLossInput(logp, old, adv, mask), PolicyLossConfig())
    close(loss, (-1.2 - 0.9 + 0.8 + 1.1 - 1.4) / 5)
    assert m["pg_loss"] == pytest.approx(-1.6 / 5, abs=1e-6)
    assert m["pg_clipfrac"] == pytest.approx(2 / 5)
    assert m["pg_clipfrac_lower"] == 0.0
    assert m["ppo_kl"] == pytest.approx(-sum(math.log(r) for r in [1.5, 0.9, 0.5, 1.1, 0.7]) / 5, abs=1e-6)
    with pytest.raises(ValueError, match="advantages"):
        L.compute_policy_loss_ppo(PolicyLossInput(logp, old, adv[:, :3], mask), PolicyLossConfig())
    with pytest.raises(ValueError, match="'ppo' policy loss needs advantages"):
        L.compute_policy_loss_ppo(PolicyLossInput(logp, old, None, mask), PolicyLossConfig())


def test_ppo_loss_with_a_global_scale_is_its_share_and_logs_the_local_mean():
    logp, old, adv, mask = ppo_example()
    # this micro-batch holds 5 of the mini-batch's 8 valid tokens over 2 ranks: sum / 8 * 2
    loss, m = run_loss("ppo", logp, old, adv, mask, scale=LossScale(global_tokens=8, dp_size=2))
    close(loss, (-1.2 - 0.9 + 0.8 + 1.1 - 1.4) / 8 * 2)
    assert m["pg_loss"] == pytest.approx(-1.6 / 5, abs=1e-6)  # the local mean, whatever the split


def test_ppo_loss_gradient_matches_analytic():
    logp, old, adv, mask = ppo_example()
    logp = logp.clone().requires_grad_(True)
    loss, _ = L.compute_policy_loss_ppo(PolicyLossInput(logp, old, adv, mask), PolicyLossConfig())
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
    ppo_loss, _ = run_loss("ppo", logp, old, adv, mask)
    close(ppo_loss, (5.0 + 2.0 - 1.2) / 3)
    loss, m = run_loss("dual_clip", logp, old, adv, mask, clip_ratio_c=3.0)
    close(loss, (3.0 + 2.0 - 1.2) / 3)
    assert m["pg_clipfrac_lower"] == pytest.approx(1 / 3)
    assert m["pg_clipfrac"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="clip_ratio_c > 1"):
        L.compute_policy_loss_dual_clip(PolicyLossInput(logp, old, adv, mask), PolicyLossConfig(clip_ratio_c=1.0))


def test_ppo_with_clip_ratio_high_uses_asymmetric_bounds():
    """DAPO's clip-higher is ppo with clip_ratio_high=0.28 (the separate "clip_higher" loss was removed)."""
    logp = torch.log(torch.tensor([[1.25, 1.3, 0.75]]))
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    mask = torch.ones(1, 3)
    # high 0.28: r=1.25 stays, r=1.3 -> 1.28 ; low 0.2: r=0.75 -> 0.8
    loss, m = run_loss("ppo", logp, old, adv, mask, clip_ratio_high=0.28)
    close(loss, (-1.25 - 1.28 + 0.8) / 3)
    assert m["pg_clipfrac"] == pytest.approx(2 / 3)
    sym, m_sym = run_loss("ppo", logp, old, adv, mask)
    close(sym, (-1.2 - 1.2 + 0.8) / 3)
    assert m_sym["pg_clipfrac"] == pytest.approx(1.0)
    asym, _ = run_loss("ppo", logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    close(asym, loss)
    with pytest.raises(ValueError, match="known:"):
        L.get_policy_loss("clip_higher")


def test_reinforce_loss_is_unclipped():
    logp, old, adv, mask = ppo_example()
    loss, m = run_loss("reinforce", logp, old, adv, mask)
    close(loss, (-1.5 - 0.9 + 0.5 + 1.1 - 1.4) / 5)
    assert m["pg_clipfrac"] == 0.0


def gspo_example():
    """Row 0: three valid tokens, log ratios 0.3, -0.1, 0.1 (mean 0.1); row 1: two valid tokens,
    -0.4 and 0.0 (mean -0.2), then padding with garbage."""
    old = torch.tensor([[0.5, -1.0, -2.0], [-0.3, -0.7, PAD]])
    logp = old + torch.tensor([[0.3, -0.1, 0.1], [-0.4, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float32)
    return logp, torch.where(mask.bool(), old, torch.zeros(())), mask


def test_gspo_value_is_the_clipped_sequence_ratio_surrogate():
    logp, old, mask = gspo_example()
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, PAD]])
    s0, s1 = math.exp(0.1), math.exp(-0.2)
    # PPO's 0.2 clip never binds (s in [0.8, 1.2]): per token -A * s_i, here token-mean over 5 tokens
    for name in ("gspo", "gspo_token"):
        loss, m = run_loss(name, logp, old, adv, mask)
        close(loss, (3 * -s0 + 2 * s1) / 5)
        assert m["pg_clipfrac"] == 0.0
        assert m["ppo_kl"] == pytest.approx(-(0.3 - 0.1 + 0.1 - 0.4 + 0.0) / 5, abs=1e-6)
    # the paper's clip range: both rows clip, row 0 at 1 + 4e-4, row 1 (A < 0) at 1 - 3e-4
    settings = dict(clip_ratio_low=3e-4, clip_ratio_high=4e-4, loss_agg_mode="seq-mean-token-mean")
    for name in ("gspo", "gspo_token"):
        loss, m = run_loss(name, logp, old, adv, mask, **settings)
        close(loss, (-(1 + 4e-4) + (1 - 3e-4)) / 2)
        assert m["pg_clipfrac"] == 1.0
    leaf = logp.clone().requires_grad_(True)
    run_loss("gspo", leaf, old, adv, mask, **settings)[0].backward()
    close(leaf.grad, torch.zeros(2, 3))  # a clipped response gets no gradient at all


def test_gspo_gradient_flows_through_the_sequence_mean_and_gspo_token_keeps_tokens_apart():
    logp, old, mask = gspo_example()
    s0, s1 = math.exp(0.1), math.exp(-0.2)
    adv = torch.tensor([[1.0, 2.0, -1.0], [-1.0, -1.0, PAD]])  # per-token advantages in row 0
    grads = {}
    for name in ("gspo", "gspo_token"):
        leaf = logp.clone().requires_grad_(True)
        run_loss(name, leaf, old, adv, mask)[0].backward()
        grads[name] = leaf.grad
    # gspo: d(-A_t s_0)/dlogp_u = -A_t s_0 / 3 for every u of the row, summed over t: -(1+2-1) s_0 / 3, / 5 tokens
    close(grads["gspo"], [[-2 * s0 / 15] * 3, [2 * s1 / 2 / 5, 2 * s1 / 2 / 5, 0.0]])
    # gspo_token: token t's own -A_t s_0, / 5 tokens
    close(grads["gspo_token"], [[-s0 / 5, -2 * s0 / 5, s0 / 5], [s1 / 5, s1 / 5, 0.0]])
    # with one advantage per response and seq-mean-token-mean the two are the same loss
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, PAD]])
    for name in ("gspo", "gspo_token"):
        leaf = logp.clone().requires_grad_(True)
        run_loss(name, leaf, old, adv, mask, loss_agg_mode="seq-mean-token-mean")[0].backward()
        # d(-A s_i)/dlogp_t = -A s_i / |y_i|, / 2 responses
        close(leaf.grad, [[-s0 / 3 / 2] * 3, [s1 / 2 / 2, s1 / 2 / 2, 0.0]])


def test_gspo_at_ratio_one_is_the_seq_mean_token_mean_policy_gradient():
    _, old, mask = gspo_example()
    adv = torch.tensor([[1.0, 1.0, 1.0], [-3.0, -3.0, PAD]])
    grads = []
    for name in ("gspo", "reinforce"):
        leaf = old.clone().requires_grad_(True)  # on-policy: ratio 1
        loss, _ = run_loss(name, leaf, old, adv, mask, loss_agg_mode="seq-mean-token-mean")
        close(loss, (-1.0 + 3.0) / 2)
        loss.backward()
        grads.append(leaf.grad)
    close(grads[0], [[-1 / 3 / 2] * 3, [3 / 2 / 2, 3 / 2 / 2, 0.0]])  # -A / |y_i| / 2 responses
    close(grads[0], grads[1])


def test_cispo_keeps_every_tokens_gradient_with_a_clipped_weight():
    logp, old, adv, mask = ppo_example()  # ratios 1.5, 0.9, 0.5, 1.1 | 0.7; A 1, 1, -1, -1 | 2
    leaf = logp.clone().requires_grad_(True)
    loss, m = run_loss("cispo", leaf, old, adv, mask)
    # weights clip(r, 0.8, 1.2) = 1.2, 0.9, 0.8, 1.1 | 0.8; value per token -w * A
    close(loss, (-1.2 - 0.9 + 0.8 + 1.1 - 1.6) / 5)
    loss.backward()
    # gradient -w * A / N on every valid token, the clipped ones included (PPO gives those 0)
    close(leaf.grad, [[-1.2 / 5, -0.9 / 5, 0.8 / 5, 1.1 / 5], [-1.6 / 5, 0.0, 0.0, 0.0]])
    assert m["pg_clipfrac"] == pytest.approx(3 / 5)  # 1.5 above; 0.5 and 0.7 below
    assert m["pg_clipfrac_lower"] == pytest.approx(2 / 5)
    # MiniMax-M1's setting: no lower bound (clip_ratio_low=1.0), only the upper one
    leaf = logp.clone().requires_grad_(True)
    loss, m = run_loss("cispo", leaf, old, adv, mask, clip_ratio_low=1.0, clip_ratio_high=0.2)
    loss.backward()
    close(leaf.grad, [[-1.2 / 5, -0.9 / 5, 0.5 / 5, 1.1 / 5], [-1.4 / 5, 0.0, 0.0, 0.0]])
    assert m["pg_clipfrac"] == pytest.approx(1 / 5) and m["pg_clipfrac_lower"] == 0.0
    with pytest.raises(ValueError, match="'cispo' policy loss needs advantages"):
        run_loss("cispo", logp, old, None, mask)


def test_is_weights_scale_per_token_loss():
    logp, old, adv, mask = ppo_example()
    w = torch.tensor([[1.0, 2.0, 0.5, 0.0], [3.0, PAD, PAD, PAD]])
    loss, _ = L.compute_policy_loss_ppo(PolicyLossInput(logp, old, adv, mask, is_weights=w), PolicyLossConfig())
    close(loss, (-1.2 * 1 - 0.9 * 2 + 0.8 * 0.5 + 1.1 * 0 - 1.4 * 3) / 5)


def test_policy_loss_input_checks_shapes():
    logp, old, adv, mask = ppo_example()
    with pytest.raises(ValueError, match="old_log_prob"):
        PolicyLossInput(logp, old[:, :3], adv, mask)
    with pytest.raises(ValueError, match="response_mask"):
        PolicyLossInput(logp, old, adv, mask[:1])
    with pytest.raises(ValueError, match="is_weights"):
        PolicyLossInput(logp, old, adv, mask, is_weights=torch.ones(2, 3))


def test_policy_loss_config_refuses_bad_settings():
    with pytest.raises(ValueError, match="loss_agg_mode 'bogus'"):
        PolicyLossConfig(loss_agg_mode="bogus")
    with pytest.raises(ValueError, match="clip ratios must be >= 0"):
        PolicyLossConfig(clip_ratio_high=-0.1)


def test_policy_loss_registry_rejects_unknown_names():
    with pytest.raises(ValueError, match="known:.*dual_clip"):
        L.get_policy_loss("nope")
    with pytest.raises(ValueError, match="already registered"):
        L.register_policy_loss("ppo")(lambda inp, cfg: None)


# ------------------------------------------------------------------ value loss


def test_value_loss_clipping():
    vpreds = torch.tensor([[1.0, 0.2, -1.0, 0.3, PAD]])
    values = torch.zeros(1, 5)
    returns = torch.tensor([[2.0, 1.0, 0.0, 0.3, PAD]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    # v=1 clipped to 0.5: max(1, 2.25) = 2.25 (clip wins) ; 0.64 ; v=-1 -> max(1, 0.25) = 1 ; 0
    loss, m = L.compute_value_loss(vpreds, values, returns, mask, cliprange_value=0.5)
    close(loss, 0.5 * (2.25 + 0.64 + 1.0 + 0.0) / 4)
    assert m["vf_clipfrac"] == pytest.approx(0.25)
    assert m["vf_loss"] == pytest.approx(0.5 * 3.89 / 4, abs=1e-6)


def test_value_loss_with_a_global_scale():
    vpreds = torch.tensor([[1.0, 0.2, -1.0, 0.3, PAD]])
    values = torch.zeros(1, 5)
    returns = torch.tensor([[2.0, 1.0, 0.0, 0.3, PAD]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, m = L.compute_value_loss(vpreds, values, returns, mask, cliprange_value=0.5,
                                   scale=LossScale(global_tokens=8, dp_size=2))
    close(loss, 0.5 * 3.89 / 8 * 2)
    assert m["vf_loss"] == pytest.approx(0.5 * 3.89 / 4, abs=1e-6)
