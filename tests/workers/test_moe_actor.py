"""ActorWorker on a tiny Qwen3-MoE model (rlcore.workers.moe): fp32 routers under bf16 mixed
precision, a frozen router, the load-balancing and z-loss terms with their coefficients, and router
replay against a forward whose routing was forced by hand."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlcore.models.moe import load_balancing_loss, router_modules, router_z_loss
from rlcore.models.tiny import build_tiny_model
from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup, WorkerError
from rlcore.workers.actor import ActorWorker


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_moe"), arch="qwen3_moe", seed=0)


def moe_actor(path, model=None, **actor):
    base = {"optimizer": "sgd", "lr": 0.1, "weight_decay": 0.0, "grad_clip": None,
            "ppo_micro_batch_size_per_gpu": 8, "shuffle": False}
    wg = LocalWorkerGroup(ClassWithInitArgs(ActorWorker, {"model": {"path": path, **(model or {})},
                                                           "actor": {**base, **actor}}), 1)
    wg.init_model()
    return wg


def test_router_computes_in_fp32_under_bf16_mixed_precision(moe_dir, make_batch):
    wg = moe_actor(moe_dir, model={"mixed_precision": "bfloat16"})
    module = wg.worker(0).module
    seen = {}
    hooks = [router_modules(module)[0].register_forward_hook(lambda m, a, o: seen.update(router=(a[0].dtype, o[0].dtype))),
             module.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, a, o: seen.update(q=o.dtype))]
    wg.compute_log_prob(make_batch())
    for h in hooks:
        h.remove()
    assert seen["router"] == (torch.float32, torch.float32)  # input cast up, logits in fp32
    assert seen["q"] == torch.bfloat16  # the rest computes in bf16
    assert {p.dtype for p in module.parameters()} == {torch.float32}


def test_freeze_router_keeps_gate_weights_bitwise_and_out_of_the_optimizer(moe_dir, make_batch):
    wg = moe_actor(moe_dir, freeze_router=True, moe_aux_loss_coef=0.1)
    worker = wg.worker(0)
    gates = [r.weight for r in router_modules(worker.module)]
    assert gates and not any(g.requires_grad for g in gates)
    in_optimizer = {id(p) for group in worker.optimizer.param_groups for p in group["params"]}
    assert not {id(g) for g in gates} & in_optimizer
    before = [g.detach().clone() for g in gates]
    experts = worker.module.model.layers[0].mlp.experts.gate_up_proj
    experts_before = experts.detach().clone()
    wg.update_policy(make_batch())
    assert all(torch.equal(g.detach(), b) for g, b in zip(gates, before))
    assert not torch.equal(experts.detach(), experts_before)  # the rest did train
    # without freezing, the same update moves the router
    free = moe_actor(moe_dir, moe_aux_loss_coef=0.1)
    free.update_policy(make_batch())
    assert not torch.equal(router_modules(free.worker(0).module)[0].weight.detach(), before[0])


def test_reported_loss_includes_aux_and_z_loss_with_their_coefficients(moe_dir, make_batch):
    data = make_batch()  # 4 rows, one micro-batch of 8: the terms enter with weight exactly 1
    plain = moe_actor(moe_dir).update_policy(data)[0]
    coefs = {"moe_aux_loss_coef": 0.3, "moe_z_loss_coef": 0.05}
    with_terms = moe_actor(moe_dir, **coefs).update_policy(data)[0]
    # the terms themselves, from a plain HF forward of the same weights on the same tokens
    model = AutoModelForCausalLM.from_pretrained(moe_dir)
    b = data.batch
    with torch.no_grad():
        out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"],
                    output_router_logits=True)
    aux = float(load_balancing_loss(out.router_logits, 4, 2, b["attention_mask"]))
    z = float(router_z_loss(out.router_logits, b["attention_mask"]))
    assert aux == pytest.approx(float(out.aux_loss), rel=1e-5)  # HF's own value on the same mask
    assert with_terms["actor/moe_aux_loss"] == pytest.approx(aux, rel=1e-5)
    assert with_terms["actor/moe_z_loss"] == pytest.approx(z, rel=1e-5)
    assert plain["actor/moe_aux_loss"] == pytest.approx(aux, rel=1e-5)  # reported with coefficient 0 too
    assert aux > 2.0 and z > 0.0  # k=2 is perfect balance
    assert with_terms["actor/loss"] - plain["actor/loss"] == pytest.approx(0.3 * aux + 0.05 * z, rel=1e-4)


def _least_likely_experts(model_dir, data):
    """(B, T, L, 2) int16: at every position and layer the two experts the router likes least (with
    the forward routed that way from layer 0 on), and that forward's response log-probs."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    b = data.batch
    routers = router_modules(model)
    bsz, width = b["input_ids"].shape
    chosen = []

    def forced(router):
        def forward(hidden):
            hidden = hidden.reshape(-1, router.weight.shape[1])
            logits = hidden @ router.weight.T
            probs = torch.softmax(logits.float(), -1)
            experts = probs.argsort(-1)[:, :2]  # the two least likely
            chosen.append(experts)
            w = probs.gather(-1, experts)
            return logits, (w / w.sum(-1, keepdim=True)).to(logits.dtype), experts
        return forward

    for r in routers:
        r.forward = forced(r)
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                       position_ids=b["position_ids"]).logits
    t_r = b["responses"].shape[1]
    log_probs = torch.log_softmax(logits[:, -t_r - 1:-1].float(), -1).gather(-1, b["responses"][..., None])[..., 0]
    routed = torch.stack([c.reshape(bsz, width, 2) for c in chosen], dim=2).to(torch.int16)
    return routed, log_probs


def test_router_replay_uses_the_recorded_experts(moe_dir, make_batch):
    data = make_batch()
    routed, forced_log_probs = _least_likely_experts(moe_dir, data)
    data.batch["routed_experts"] = routed
    free = moe_actor(moe_dir).compute_log_prob(data).batch["old_log_probs"]
    replayed = moe_actor(moe_dir, router_replay=True).compute_log_prob(data).batch["old_log_probs"]
    mask = data.batch["response_mask"].bool()
    assert torch.allclose(replayed[mask], forced_log_probs[mask], atol=1e-5, rtol=0)
    assert (replayed[mask] - free[mask]).abs().max() > 1e-3  # the router alone would route elsewhere
    # recording what the free router picks and replaying it gives the free forward back
    wg = moe_actor(moe_dir, router_replay=True)
    data.batch["routed_experts"] = torch.full_like(routed, -1)  # nothing recorded: route freely
    assert torch.allclose(wg.compute_log_prob(data).batch["old_log_probs"][mask], free[mask], atol=1e-6, rtol=0)


def test_router_replay_update_and_missing_routing(moe_dir, make_batch):
    data = make_batch()
    routed, _ = _least_likely_experts(moe_dir, data)
    wg = moe_actor(moe_dir, router_replay=True, moe_aux_loss_coef=0.01)
    with pytest.raises(WorkerError, match="record_routing"):
        wg.compute_log_prob(data)
    data.batch["routed_experts"] = routed
    metrics = wg.update_policy(data)[0]
    assert metrics["actor/moe_aux_loss"] > 2.0 and torch.isfinite(torch.tensor(metrics["actor/loss"]))
    with pytest.raises(WorkerError, match="MoE model"):
        moe_actor(build_tiny_model(moe_dir + "_dense"), router_replay=True)
