"""``actor.skip_zero_advantage_rows``: rows whose advantages are all zero (a GRPO group whose samples
all got the same reward) are left out of the forward and backward where their gradient is exactly
zero, and the update is the one that trains on every row: the same parameters after AdamW steps
(moments and weight decay included, also on a step where no row trains), in-process and on 2 FSDP2
ranks whose rows differ in how many train."""

import pytest
import torch

from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup, RayResourcePool, RayWorkerGroup
from rlcore.trainer.validation import mean_over_ranks
from rlcore.workers.actor import ActorWorker

# AdamW with weight decay: a step on zero gradients still moves the weights (the moments, the decay),
# which a missing gradient would not: the all-zero step below tells the two apart.
ADAMW = {"optimizer": "adamw", "lr": 1e-2, "weight_decay": 0.1, "grad_clip": 1.0, "ppo_micro_batch_size_per_gpu": 1,
         "shuffle": False}


def config(path, **actor):
    return {"model": {"path": path}, "actor": {**ADAMW, **actor}}


def local_actor(path, **actor):
    wg = LocalWorkerGroup(ClassWithInitArgs(ActorWorker, config(path, **actor)), world_size=1)
    wg.init_model()
    return wg


def zero_rows(data, rows):
    data.batch["advantages"][list(rows)] = 0.0
    return data


def count_forward_rows(wg) -> list[int]:
    """Rows per forward pass of the worker, appended as they run."""
    worker, seen = wg.worker(0), []
    forward = worker._forward

    def counted(micro):
        seen.append(len(micro))
        return forward(micro)

    worker._forward = counted
    return seen


def parameters(wg) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in wg.worker(0).get_full_state_dict().items()}


@pytest.mark.parametrize("batching", [{}, {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 12}],
                         ids=["one-row", "token-budget"])
def test_skipped_rows_give_the_update_of_every_row(tiny_model_dir, make_batch, batching):
    skipping = local_actor(tiny_model_dir, **batching)
    every_row = local_actor(tiny_model_dir, skip_zero_advantage_rows=False, **batching)
    ran, ran_all = count_forward_rows(skipping), count_forward_rows(every_row)
    start = parameters(every_row)
    for data_of, trained in ((lambda: zero_rows(make_batch(seed=4), [1, 3]), 0.5),  # half the rows train
                             (lambda: zero_rows(make_batch(seed=5), range(4)), 0.0)):  # none: moments and decay only
        before = parameters(every_row)
        ran.clear(), ran_all.clear()
        got, want = skipping.update_policy(data_of())[0], every_row.update_policy(data_of())[0]
        assert got["actor/trained_rows_frac"] == trained and "actor/trained_rows_frac" not in want
        if not batching:  # one row per pass; with no row to train, one stand-in pass
            assert ran == ([1, 1] if trained else [1]) and ran_all == [1, 1, 1, 1]
        assert sum(ran) == (2 if trained else 1) and sum(ran_all) == 4
        assert got["actor/loss"] == pytest.approx(want["actor/loss"], abs=1e-7)
        assert got["actor/grad_norm"] == pytest.approx(want["actor/grad_norm"], rel=1e-6, abs=1e-9)
        after, after_all = parameters(skipping), parameters(every_row)
        assert max((after_all[k] - before[k]).abs().max().item() for k in start) > 1e-4  # the step moved weights
        for name, value in after_all.items():
            torch.testing.assert_close(after[name], value, rtol=1e-6, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")


def test_a_rank_that_trains_no_row_reports_no_loss_terms():
    """Its metrics lack the per-micro-batch terms; the mean over ranks takes them from the others."""
    assert mean_over_ranks([{"a/loss": 1.0}, {"a/loss": 3.0, "a/pg_loss": 2.0}]) == {"a/loss": 2.0, "a/pg_loss": 2.0}


@pytest.mark.parametrize("actor, skips", [({}, True), ({"skip_zero_advantage_rows": False}, False),
                                          ({"use_kl_loss": True}, False), ({"entropy_coeff": 0.01}, False),
                                          ({"use_kl_loss": True, "kl_loss_coef": 0.0}, True),
                                          ({"policy_loss": "gspo"}, True), ({"policy_loss": "cispo"}, True),
                                          ({"policy_loss": "dpo"}, False)])
def test_rows_are_skipped_only_where_their_gradient_is_exactly_zero(tiny_model_dir, actor, skips):
    """A KL loss term or an entropy bonus gives every row a gradient; a loss not marked
    ``zero_without_advantage`` (DPO's) may too."""
    wg = LocalWorkerGroup(ClassWithInitArgs(ActorWorker, config(tiny_model_dir, **actor)), world_size=1)
    assert (wg.worker(0)._rows_with_grad() is not None) == skips


def test_ranks_training_different_row_counts_take_the_one_rank_step(ray_cluster, tiny_model_dir, make_batch):
    """Of rank 0's four rows only the first has a non-zero advantage, rank 1's all have: rank 0 runs
    three stand-in passes (its first row, times 0) so both run as many FSDP rounds (else the
    collectives would hang), and the step equals one rank's on all rows. With SGD and weight decay
    (which also tells a zero gradient from a missing one): its step is linear in the gradient, so the
    float-order difference of summing over one rank or two stays ~1e-7. AdamW's first step divides
    by |g|, which turns that difference into up to lr where |g| is near its eps (seen on a Zen 5 CPU:
    3 of 16384 weights 1e-5 apart)."""
    def data():  # the plain split: rank 0 gets rows 0-3
        return zero_rows(make_batch(prompt_lens=(5, 3, 4, 2) * 2, response_lens=(6, 5, 1, 2) * 2, seed=6), [1, 2, 3])
    want = local_actor(tiny_model_dir, skip_zero_advantage_rows=False, optimizer="sgd")
    want_metrics = want.update_policy(data())[0]
    pool = RayResourcePool([2], num_cpus_per_process=0.5, name_prefix="zero_adv")
    group = RayWorkerGroup(pool, ClassWithInitArgs(ActorWorker, config(tiny_model_dir, optimizer="sgd")), default_timeout=120)
    try:
        group.init_model()
        per_rank = group.update_policy.options(balance=False)(data())
        got = group.get_full_state_dict()
    finally:
        group.shutdown()
        pool.shutdown()
    assert [m["actor/trained_rows_frac"] for m in per_rank] == [0.25, 1.0]
    assert per_rank[0]["actor/loss"] == pytest.approx(want_metrics["actor/loss"], rel=1e-5)
    assert per_rank[0]["actor/grad_norm"] == pytest.approx(want_metrics["actor/grad_norm"], rel=1e-5)
    for name, value in parameters(want).items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
