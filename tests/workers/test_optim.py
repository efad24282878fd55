"""AdamW's moments are made when the optimizer is built (rlcore.workers.optim.allocate_moments): the same
state its first step would make, so the same updates bit for bit, with the memory placed at init."""

import copy

import torch
from torch import nn

from rlcore.models import cpu_matmul
from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup
from rlcore.workers.actor import ActorWorker
from rlcore.workers.config import TrainConfig
from rlcore.workers.optim import allocate_moments, build_optimizer

from tests.workers.test_actor import actor_config, with_old_log_probs


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 3) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        loss = model(torch.randn(4, 5, generator=gen)).square().sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_build_optimizer_makes_zero_moments_at_step_zero_and_leaves_no_gradients():
    model = small_model()
    optimizer = build_optimizer(model.parameters(), TrainConfig(lr=1e-2))
    assert len(optimizer.state) == 4
    for p in model.parameters():
        state = optimizer.state[p]
        assert float(state["step"]) == 0.0
        assert state["exp_avg"].shape == p.shape and not state["exp_avg"].any()
        assert state["exp_avg_sq"].shape == p.shape and not state["exp_avg_sq"].any()
        assert p.grad is None


def test_moments_made_at_build_give_the_lazy_optimizers_updates_bit_for_bit():
    eager_model, lazy_model = small_model(), small_model()
    eager = build_optimizer(eager_model.parameters(), TrainConfig(lr=1e-2, weight_decay=0.1))
    lazy = torch.optim.AdamW(lazy_model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    train(eager_model, eager)
    train(lazy_model, lazy)
    for a, b in zip(eager_model.parameters(), lazy_model.parameters(), strict=True):
        assert torch.equal(a, b)
        assert torch.equal(eager.state[a]["exp_avg_sq"], lazy.state[b]["exp_avg_sq"])
        assert float(eager.state[a]["step"]) == float(lazy.state[b]["step"]) == 3.0


def test_a_gradient_already_there_is_kept():
    model = small_model()
    first = next(model.parameters())
    first.grad = torch.full_like(first, 2.0)
    optimizer = allocate_moments(torch.optim.AdamW(model.parameters(), fused=True))
    assert torch.equal(first.grad, torch.full_like(first, 2.0))
    assert all(p.grad is None for p in list(model.parameters())[1:])
    assert len(optimizer.state) == 4


def test_sharded_actor_starts_with_its_moments_and_updates_as_with_lazy_ones(tiny_model_dir, make_batch):
    """Through FSDP2 (DTensor parameters): the actor's optimizer holds every trained parameter's moments
    after init_model, and an update from them equals one from moments made by the first step. (The
    response head's oneDNN flag is checked here too: the same actor, built as the recipes build it.)"""
    results = []
    for lazy in (False, True):
        wg = LocalWorkerGroup(ClassWithInitArgs(ActorWorker, actor_config(tiny_model_dir, optimizer="adamw", lr=1e-2)), 1)
        wg.init_model()
        worker = wg.worker(0)
        assert worker.head.onednn == cpu_matmul.available()  # model.cpu_matmul's default reaches the response head
        trained = [p for p in worker.module.parameters() if p.requires_grad]
        assert len(worker.optimizer.state) == len(trained)
        assert all(float(s["step"]) == 0 and not s["exp_avg"].full_tensor().any() for s in worker.optimizer.state.values())
        if lazy:
            worker.optimizer.state.clear()
        data = with_old_log_probs(wg, make_batch())
        wg.update_policy(data)
        wg.update_policy(data)
        results.append(copy.deepcopy(wg.get_full_state_dict()))
    eager, lazy = results
    assert eager.keys() == lazy.keys()
    assert all(torch.equal(eager[k], lazy[k]) for k in eager)
    assert any(not torch.equal(eager[k], v) for k, v in hf_initial(tiny_model_dir).items() if k in eager)


def hf_initial(path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).state_dict()
