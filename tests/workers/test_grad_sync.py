"""rlcore.workers.grad_sync: on one rank the update reduces its gradients once per mini-batch instead of
after every micro-batch's backward; the weights it leaves are bit for bit those of reducing every time,
and a mini-batch given up half-way leaves nothing of what it accumulated behind."""

import pytest
import torch

from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup, abandon
from rlcore.single_controller.abandon import AbandonedCallError, run_abandonable
from rlcore.workers import fsdp_utils
from rlcore.workers.actor import ActorWorker
from rlcore.workers.grad_sync import accumulates_unsynced


def actor(path, **model):
    """AdamW with clipping, one row per micro-batch: four backwards per optimizer step on four rows."""
    config = {"model": {"path": path, **model},
              "actor": {"lr": 0.05, "grad_clip": 1.0, "ppo_micro_batch_size_per_gpu": 1, "shuffle": False}}
    group = LocalWorkerGroup(ClassWithInitArgs(ActorWorker, config), world_size=1)
    group.init_model()
    return group, group.worker(0)


def weights(worker) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().clone() for k, v in worker.module.state_dict().items()}


@pytest.mark.parametrize("mixed_precision", [None, "bfloat16"])
def test_reducing_once_per_mini_batch_equals_reducing_after_every_backward(tiny_model_dir, make_batch, monkeypatch,
                                                                          mixed_precision):
    results = {}
    for unsynced in (True, False):
        monkeypatch.setattr(fsdp_utils, "UNSYNCED_ACCUMULATION", unsynced)
        group, worker = actor(tiny_model_dir, mixed_precision=mixed_precision)
        assert accumulates_unsynced(worker.module, 1)  # the path under test runs (FSDP2's groups were found)
        metrics = [group.update_policy(make_batch(seed=s))[0] for s in range(2)]
        results[unsynced] = metrics, weights(worker)
    (metrics, ours), (ref_metrics, ref) = results[True], results[False]
    assert [m["actor/grad_norm"] for m in metrics] == [m["actor/grad_norm"] for m in ref_metrics]
    for name in ref:
        assert torch.equal(ours[name], ref[name]), name
    assert not torch.equal(ours["lm_head.weight"], weights(actor(tiny_model_dir)[1])["lm_head.weight"])  # it trained


def test_a_mini_batch_given_up_half_way_leaves_none_of_its_gradients(tiny_model_dir, make_batch, monkeypatch):
    """Asked to stop during the second of four backwards: the gradients of the first two, held unsharded,
    are dropped with the update, so the next update moves the weights exactly as on a fresh worker."""
    group, worker = actor(tiny_model_dir)
    loss = worker._loss
    calls = []

    def loss_asking_to_stop(micro, scale):
        calls.append(1)
        if len(calls) == 2:
            abandon.request_abandon()
        return loss(micro, scale)

    monkeypatch.setattr(worker, "_loss", loss_asking_to_stop)
    abandon.reset()
    try:
        with pytest.raises(AbandonedCallError, match="micro-batch boundary 3"):
            run_abandonable("update_policy", lambda: worker.update_policy(make_batch(seed=0)), {}, permit=True)
    finally:
        abandon.reset()
    monkeypatch.setattr(worker, "_loss", loss)
    assert all(p.grad is None for p in worker.module.parameters())
    group.update_policy(make_batch(seed=1))
    fresh_group, fresh = actor(tiny_model_dir)
    fresh_group.update_policy(make_batch(seed=1))
    ours, ref = weights(worker), weights(fresh)
    for name in ref:
        assert torch.equal(ours[name], ref[name]), name
