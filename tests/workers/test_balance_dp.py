"""Balanced DP on 2 FSDP2 ranks (Ray actors, gloo): the actor, reference and critic split a skewed
batch by token count, their compute results come back row for row as with the plain split, and a
balanced update takes the same step as a plain one (the losses are DP-invariant: ``LossScale``).

The batch: tokens per row (prompt + response) 11, 10, 10, 10 | 3, 4, 4, 4. The plain split gives
rank 0 the first four (41 tokens) and rank 1 the rest (15). Karmarkar-Karp sorts the rows by
tokens (4, 5, 6, 7, 1, 2, 3, 0), pairs them (4, 5) (6, 7) (1, 2) (3, 0), merges the two most
spread pairs first, (4, 5) with (3, 0) into {5, 3} | {4, 0}, then (6, 7) with (1, 2) into
{6, 2} | {7, 1}, then those two: rank 0 rows 1, 3, 5, 7, rank 1 rows 0, 2, 4, 6, 28 tokens each.
"""

import pytest
import torch

from rlcore.single_controller import ClassWithInitArgs, RayResourcePool, RayWorkerGroup, create_colocated_worker_cls
from rlcore.single_controller.decorator import REGISTER_ATTR
from rlcore.workers.actor import ActorWorker
from rlcore.workers.critic import CriticWorker

PLAIN = {"tokens_max_before": 41, "tokens_min_before": 15, "tokens_max_after": 41, "tokens_min_after": 15}
BALANCED = {"tokens_max_before": 41, "tokens_min_before": 15, "tokens_max_after": 28, "tokens_min_after": 28}
SGD = {"optimizer": "sgd", "weight_decay": 0.0, "grad_clip": None, "shuffle": False,
       # packed to 22 tokens: plain, rank 0 needs 2 forwards (11+10, 10+10) and rank 1 one (15), so both run 2
       "use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 22}


@pytest.fixture
def skewed_batch(make_batch):
    return lambda: make_batch(prompt_lens=(5, 4, 5, 4, 2, 3, 2, 3), response_lens=(6, 6, 5, 6, 1, 1, 2, 1))


@pytest.fixture(scope="module")
def two_ranks(ray_cluster, tiny_model_dir):
    config = {"model": {"path": tiny_model_dir}, "actor": {**SGD, "lr": 0.1}, "critic": {**SGD, "lr": 0.05}}
    roles = {"actor": ClassWithInitArgs(ActorWorker, config), "ref": ClassWithInitArgs(ActorWorker, config, role="ref"),
             "critic": ClassWithInitArgs(CriticWorker, config)}
    pool = RayResourcePool([2], num_cpus_per_process=0.5, name_prefix="balance_test")
    group = RayWorkerGroup(pool, create_colocated_worker_cls(roles), default_timeout=300)
    views = group.spawn(list(roles))
    for role in ("actor", "ref", "critic"):
        views[role].init_model()
    yield views
    group.shutdown()
    pool.shutdown()


def test_the_token_heavy_methods_are_registered_balanced():
    methods = [ActorWorker.compute_log_prob, ActorWorker.compute_ref_log_prob, ActorWorker.update_policy,
               CriticWorker.compute_values, CriticWorker.update_critic]
    assert [getattr(m, REGISTER_ATTR)["balance"] for m in methods] == [True] * 5
    assert getattr(ActorWorker.init_model, REGISTER_ATTR)["balance"] is False


@pytest.mark.parametrize("role, method, key", [("actor", "compute_log_prob", "old_log_probs"),
                                               ("ref", "compute_ref_log_prob", "ref_log_prob"),
                                               ("critic", "compute_values", "values")])
def test_balanced_results_equal_the_plain_ones_row_for_row(two_ranks, skewed_batch, role, method, key):
    group = two_ranks[role]
    call = getattr(group, method)
    plain = call.options(balance=False)(skewed_batch()).batch[key]
    assert group.last_balance == PLAIN
    balanced = call(skewed_batch()).batch[key]
    assert group.last_balance == BALANCED
    assert plain.shape == (8, 6) and plain.abs().sum() > 0
    torch.testing.assert_close(balanced, plain, atol=1e-6, rtol=1e-6)


def _update_both_ways(group, update, data, tmp_path):
    """(plain metrics, plain weights, balanced metrics, balanced weights), both steps from one start."""
    group.save_checkpoint(str(tmp_path / "start"))
    plain_metrics = update.options(balance=False)(data)
    assert group.last_balance == PLAIN
    plain_after = group.get_full_state_dict()
    group.load_checkpoint(str(tmp_path / "start"))
    balanced_metrics = update(data)
    assert group.last_balance == BALANCED
    return plain_metrics, plain_after, balanced_metrics, group.get_full_state_dict()


def _assert_same_step(plain_metrics, plain_after, balanced_metrics, balanced_after, prefix, start):
    assert len(plain_metrics) == len(balanced_metrics) == 2
    for p, b in zip(plain_metrics, balanced_metrics):
        assert b[f"{prefix}/loss"] == pytest.approx(p[f"{prefix}/loss"], rel=1e-5, abs=1e-7)
        assert b[f"{prefix}/grad_norm"] == pytest.approx(p[f"{prefix}/grad_norm"], rel=1e-5)
    moved = max((plain_after[k] - start[k]).abs().max().item() for k in start)
    assert moved > 1e-4  # the step did something
    for name, value in plain_after.items():
        torch.testing.assert_close(balanced_after[name], value, atol=1e-6, rtol=1e-5, msg=name)


def test_balanced_policy_update_equals_the_plain_one(two_ranks, skewed_batch, tmp_path):
    actor = two_ranks["actor"]
    start = actor.get_full_state_dict()
    steps = _update_both_ways(actor, actor.update_policy, skewed_batch(), tmp_path)
    _assert_same_step(*steps, prefix="actor", start=start)


def test_balanced_critic_update_equals_the_plain_one(two_ranks, skewed_batch, tmp_path):
    critic = two_ranks["critic"]
    data = skewed_batch()
    data.union(critic.compute_values(data))
    data.batch["returns"] = torch.linspace(-1, 1, 48).reshape(8, 6) * data.batch["response_mask"]
    start = critic.get_full_state_dict()
    steps = _update_both_ways(critic, critic.update_critic, data, tmp_path)
    _assert_same_step(*steps, prefix="critic", start=start)
