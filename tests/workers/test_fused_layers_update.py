"""model.fused_layers (rlcore.models.fused_layers) in the actor: an FSDP2 update with the fused RMSNorm
and SiLU product gives the unfused update's losses and weights, in bf16 mixed precision bit for bit and
in fp32 to rounding (why: tests/models/test_fused_layers.py), with and without gradient checkpointing."""

import pytest
import torch

from rlcore.models.fused_layers import FUSED_MARK
from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup
from rlcore.workers.actor import ActorWorker


def updated(path, make_batch, fused, mixed_precision=None, checkpointing=False):
    config = {"model": {"path": path, "fused_layers": fused, "mixed_precision": mixed_precision,
                        "gradient_checkpointing": checkpointing},
              "actor": {"optimizer": "sgd", "lr": 0.05, "ppo_micro_batch_size_per_gpu": 2, "shuffle": False}}
    group = LocalWorkerGroup(ClassWithInitArgs(ActorWorker, config), world_size=1)
    group.init_model()
    worker = group.worker(0)
    fused_modules = [m for m in worker.module.modules() if getattr(m, FUSED_MARK, False)]
    metrics = [group.update_policy(make_batch(seed=s))[0] for s in range(2)]
    weights = {k: v.full_tensor().clone() for k, v in worker.module.state_dict().items()}
    return len(fused_modules), metrics, weights


@pytest.mark.parametrize("mixed_precision", [None, "bfloat16"])
def test_a_fused_update_equals_the_unfused_one(tiny_model_dir, make_batch, mixed_precision):
    count, metrics, ours = updated(tiny_model_dir, make_batch, True, mixed_precision)
    none, ref_metrics, ref = updated(tiny_model_dir, make_batch, False, mixed_precision)
    assert (count, none) == (2 * 2 + 1 + 2, 0)  # the tiny model's 2 layers: 2 norms and an MLP each, the final norm
    _, ckpt_metrics, ckpt = updated(tiny_model_dir, make_batch, True, mixed_precision, checkpointing=True)
    for key in ("actor/loss", "actor/grad_norm"):
        assert [m[key] for m in ckpt_metrics] == [m[key] for m in metrics]  # the same fused forward, recomputed
        if mixed_precision:
            assert [m[key] for m in metrics] == [m[key] for m in ref_metrics]
        else:
            assert [m[key] for m in metrics] == pytest.approx([m[key] for m in ref_metrics], rel=1e-5)
    for name in ref:
        assert torch.equal(ckpt[name], ours[name]), name
        if mixed_precision:
            assert torch.equal(ours[name], ref[name]), name
        else:  # gradients a few ulps apart (one summation order), then 2 SGD steps (AdamW would blow up
            # an ulp of a near-zero gradient into a whole step's difference)
            torch.testing.assert_close(ours[name], ref[name], rtol=1e-6, atol=1e-6)
