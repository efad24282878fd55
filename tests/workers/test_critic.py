"""CriticWorker: value alignment and value-loss steps against the plain HF body + head, 1 and 2 ranks."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlcore.models.config import ModelConfig
from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup, RayResourcePool, RayWorkerGroup
from rlcore.typed_config import ConfigError
from rlcore.workers.config import CriticConfig
from rlcore.workers.critic import CriticWorker


def critic_config(path, **critic):
    base = {"optimizer": "sgd", "lr": 0.05, "weight_decay": 0.0, "grad_clip": None, "ppo_micro_batch_size_per_gpu": 1}
    return {"model": {"path": path}, "critic": {**base, **critic}}


@pytest.fixture(scope="module")
def local_critic(tiny_model_dir):
    wg = LocalWorkerGroup(ClassWithInitArgs(CriticWorker, critic_config(tiny_model_dir)), world_size=1)
    wg.init_model()
    return wg


@pytest.fixture(scope="module")
def ray_critic(ray_cluster, tiny_model_dir):
    pool = RayResourcePool([2], num_cpus_per_process=0.5, name_prefix="critic_test")
    wg = RayWorkerGroup(pool, ClassWithInitArgs(CriticWorker, critic_config(tiny_model_dir)), default_timeout=300)
    wg.init_model()
    yield wg
    wg.shutdown()
    pool.shutdown()


@pytest.fixture(params=["local", "ray"])
def critic_group(request):
    return request.getfixturevalue(f"{request.param}_critic")


def hand_value_model(path, state):
    """The LM body and a Linear(hidden, 1) head, loaded from the worker's full state dict."""
    body = AutoModelForCausalLM.from_pretrained(path).model
    body.load_state_dict({k.removeprefix("backbone."): v for k, v in state.items() if k.startswith("backbone.")})
    head = torch.nn.Linear(body.config.hidden_size, 1)
    head.load_state_dict({"weight": state["head.weight"], "bias": state["head.bias"]})
    return body, head


def hand_values(body, head, data):
    """Value of response token t = head(hidden state at position T_p - 1 + t); 0 past the response."""
    b = data.batch
    prompt_width, (n, response_width) = b["prompts"].shape[1], b["responses"].shape
    hidden = body(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).last_hidden_state
    values = torch.zeros(n, response_width)
    for i in range(n):
        for t in range(int(b["attention_mask"][i, prompt_width:].sum())):
            values[i, t] = head(hidden[i, prompt_width - 1 + t])[0]
    return values


def test_values_align_with_response_tokens(critic_group, tiny_model_dir, make_batch):
    data = make_batch()
    body, head = hand_value_model(tiny_model_dir, critic_group.get_full_state_dict())
    values = critic_group.compute_values(data).batch["values"]
    assert values.shape == (4, 6)
    torch.testing.assert_close(values, hand_values(body, head, data), atol=1e-5, rtol=1e-5)
    assert (values[2, 1:] == 0).all()  # row 2 has a one-token response


def test_value_step_is_the_global_mean_gradient(critic_group, tiny_model_dir, make_batch):
    """One SGD step on 0.5 * token-mean (v - R)^2, the same whether 1 rank or 2 split the batch."""
    data = make_batch()
    data.union(critic_group.compute_values(data))
    data.batch["returns"] = torch.linspace(-1, 1, 24).reshape(4, 6) * data.batch["response_mask"]
    body, head = hand_value_model(tiny_model_dir, critic_group.get_full_state_dict())
    params = list(body.parameters()) + list(head.parameters())
    mask = data.batch["response_mask"].bool()
    loss = 0.5 * (hand_values(body, head, data) - data.batch["returns"])[mask].square().mean()
    grads = torch.autograd.grad(loss, params)
    expected_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()
    for m in critic_group.update_critic(data):
        assert m["critic/grad_norm"] == pytest.approx(expected_norm, rel=1e-5)
        assert m["critic/loss"] == pytest.approx(loss.item(), rel=1e-5)
    after = critic_group.get_full_state_dict()
    torch.testing.assert_close(after["head.bias"], head.bias.detach() - 0.05 * grads[-1], atol=1e-6, rtol=1e-5)


def test_value_updates_fit_the_returns(tiny_model_dir, make_batch):
    wg = LocalWorkerGroup(ClassWithInitArgs(CriticWorker, critic_config(tiny_model_dir, optimizer="adamw", lr=1e-3, ppo_epochs=4)), 1)
    wg.init_model()
    data = make_batch(seed=3)
    data.batch["returns"] = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None] * data.batch["response_mask"]
    mask = data.batch["response_mask"].bool()
    errors = []
    for _ in range(3):
        step = data.select(batch_keys=list(data.batch.keys()))
        step.union(wg.compute_values(step))
        errors.append(((step.batch["values"] - step.batch["returns"])[mask] ** 2).mean().item())
        wg.update_critic(step)
    assert errors[2] < errors[1] < errors[0]
    assert errors[2] < 0.5 * errors[0]


def test_critic_checkpoint_round_trip(local_critic, make_batch, tmp_path):
    data = make_batch()
    data.union(local_critic.compute_values(data))
    data.batch["returns"] = data.batch["values"] + 1.0
    local_critic.save_checkpoint(str(tmp_path / "ckpt"))
    saved = local_critic.get_full_state_dict()
    local_critic.update_critic(data)
    assert not torch.equal(local_critic.get_full_state_dict()["head.bias"], saved["head.bias"])
    local_critic.load_checkpoint(str(tmp_path / "ckpt"))
    assert all(torch.equal(local_critic.get_full_state_dict()[k], v) for k, v in saved.items())


def test_critic_config_errors(tiny_model_dir, undocumented_fields):
    with pytest.raises(ConfigError, match=r"critic\.clip_range_value"):
        CriticWorker(critic_config(tiny_model_dir, clip_range_value=0.2))
    with pytest.raises(ConfigError, match="config section 'critic': loss_agg_mode 'mean'"):
        CriticWorker(critic_config(tiny_model_dir, loss_agg_mode="mean"))
    with pytest.raises(ConfigError, match=r"config key critic\.cliprange_value: .*\(expected float\)"):
        CriticWorker(critic_config(tiny_model_dir, cliprange_value="wide"))
    worker = CriticWorker(critic_config(tiny_model_dir))
    assert isinstance(worker.model_cfg, ModelConfig) and isinstance(worker.train_cfg, CriticConfig)
    assert worker.train_cfg.lr == 0.05 and worker.train_cfg.cliprange_value == CriticConfig().cliprange_value == 0.5
    assert CriticConfig().lr == 1e-5  # the critic's own default, not TrainConfig's
    assert undocumented_fields(CriticConfig) == []


def test_bf16_mixed_precision_values_are_close_and_parameters_float32(tiny_model_dir, make_batch):
    groups = []
    for mp in (None, "bfloat16"):
        cfg = critic_config(tiny_model_dir)
        cfg["model"]["mixed_precision"] = mp
        groups.append(LocalWorkerGroup(ClassWithInitArgs(CriticWorker, cfg), world_size=1))
        groups[-1].init_model()  # same seed: the same fresh head
    wg = groups[1]
    data = make_batch()
    fp32, bf16 = (g.compute_values(data).batch["values"] for g in groups)
    assert bf16.dtype == torch.float32 and 1e-4 < (bf16 - fp32).abs().max() < 0.05
    assert {p.dtype for p in wg.worker(0).module.parameters()} == {torch.float32}
