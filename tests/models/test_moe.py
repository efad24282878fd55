"""MoE pieces of rlcore.models.moe against hand numbers and HF's own functions: the tiny
Qwen3-MoE model, load-balancing and z-losses, recording and replaying routing."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from rlcore.models.moe import (
    RouterReplay,
    RoutingRecorder,
    load_balancing_loss,
    mask_routing,
    router_modules,
    router_z_loss,
)
from rlcore.models.tiny import build_tiny_model


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_moe"), arch="qwen3_moe", seed=0)


def test_tiny_moe_model_shape(moe_dir):
    model = AutoModelForCausalLM.from_pretrained(moe_dir)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    routers = router_modules(model)
    assert len(routers) == 2 and {(r.num_experts, r.top_k) for r in routers} == {(4, 2)}
    assert model.config.head_dim == 32 and model.config.norm_topk_prob
    assert all(float(r.weight.detach().std()) > 0.01 for r in routers)  # not all-zero: no tied top-k
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        build_tiny_model(moe_dir + "_bad", arch="qwen3_moe", num_experts_per_tok=5)


def test_load_balancing_loss_hand_number():
    # both tokens pick experts {0, 1}: f = [1, 1, 0, 0], P = [.4, .3, .2, .1] -> 4 * (.4 + .3) = 2.8
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]] * 2))
    assert float(load_balancing_loss([logits], num_experts=4, top_k=2)) == pytest.approx(2.8, abs=1e-6)
    # each row's top-2 are two experts of (nearly) equal probability, the rows disjoint: f = P = uniform,
    # 4 * sum_e (1/2 * 1/4) = 2 = k exactly (a + b = 1/2 per pair of probabilities)
    even = torch.tensor([[10.0, 10.0, 0.0, 0.0], [0.0, 0.0, 10.0, 10.0]])
    assert float(load_balancing_loss([even], 4, 2)) == pytest.approx(2.0, abs=1e-6)


def test_load_balancing_loss_equals_hf_with_and_without_mask():
    g = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(2 * 5, 4, generator=g) * 2 for _ in range(3))  # 3 layers, B=2, T=5
    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 0, 0, 1, 1]])
    hf = load_balancing_loss_func(logits, 4, 2, None)
    ours = load_balancing_loss(list(logits), 4, 2)
    assert float(ours) == pytest.approx(float(hf), rel=1e-6) and float(ours) > 2.0
    hf_masked = load_balancing_loss_func(logits, 4, 2, mask)
    ours_masked = load_balancing_loss(list(logits), 4, 2, mask)
    assert float(ours_masked) == pytest.approx(float(hf_masked), rel=1e-6)
    assert abs(float(ours_masked) - float(ours)) > 1e-3  # the mask matters


def test_router_z_loss_hand_numbers():
    zeros = torch.zeros(3, 4)  # logsumexp = log 4 on every row
    assert float(router_z_loss([zeros])) == pytest.approx(math.log(4) ** 2, rel=1e-6)
    # a masked-out row with huge logits does not count; two layers average row by row
    big = torch.tensor([[0.0, 0, 0, 0], [50.0, 0, 0, 0]])
    mask = torch.tensor([[1, 0]])
    assert float(router_z_loss([big, torch.zeros(2, 4)], mask)) == pytest.approx(math.log(4) ** 2, rel=1e-6)
    assert float(router_z_loss([big, torch.zeros(2, 4)])) == pytest.approx(
        (3 * math.log(4) ** 2 + 50.0 ** 2) / 4, rel=1e-6)


def _batch():
    ids = torch.tensor([[0, 0, 5, 9, 13, 7], [6, 8, 10, 12, 14, 16]])
    mask = (ids != 0).long()
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _forced(router, experts_of_layer):
    """A router forward written from scratch (not the replay hook's code) choosing given experts."""
    def forward(hidden):
        hidden = hidden.reshape(-1, router.weight.shape[1])
        logits = hidden @ router.weight.T
        probs = torch.softmax(logits.float(), -1)
        w = probs.gather(-1, experts_of_layer.long())
        return logits, (w / w.sum(-1, keepdim=True)).to(logits.dtype), experts_of_layer.long()
    return forward


def test_replay_of_recorded_routing_is_bitwise_and_forced_experts_change_the_forward(moe_dir):
    model = AutoModelForCausalLM.from_pretrained(moe_dir).eval()
    ids, mask, pos = _batch()
    recorder = RoutingRecorder(model)
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    recorder.remove()
    routed = torch.stack([c.reshape(2, 6, 2) for c in recorder.calls[0]], dim=2)  # (B, T, L, k)
    assert routed.shape == (2, 6, 2, 2)

    replay = RouterReplay(model)
    replay.set(mask_routing(routed, mask))  # padding positions: -1, routed by the router itself
    with torch.no_grad():
        replayed = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert torch.equal(replayed, plain)

    # Force the two experts the router likes least at every position: the replayed forward must equal
    # a forward whose routers were rewritten by hand to choose them, and differ from the free one.
    replay.set(None)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, output_router_logits=True)
    least = torch.stack([lg.argsort(-1)[:, :2].reshape(2, 6, 2) for lg in out.router_logits], dim=2)
    assert not torch.equal(least.sort(-1).values, routed.long().sort(-1).values)
    replay.set(least.to(torch.int16))
    with torch.no_grad():
        forced_replay = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    replay.remove()
    routers = router_modules(model)
    originals = [r.forward for r in routers]
    # the hand-forced routing must see the same hidden states: layer 0's choice changes layer 1's input,
    # so force both layers at once
    for layer, r in enumerate(routers):
        r.forward = _forced(r, least[:, :, layer].reshape(-1, 2))
    with torch.no_grad():
        by_hand = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    for r, f in zip(routers, originals):
        r.forward = f
    assert torch.allclose(forced_replay, by_hand, atol=1e-6, rtol=0)
    assert (forced_replay - plain).abs().max() > 1e-3
