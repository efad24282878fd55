"""actor.keep_logits_mb: the response head keeps the first chunks' logits from the forward for the
backward instead of recomputing them (rlcore.algos.token_scores); an update with them kept leaves the
weights bit for bit where recomputing every chunk leaves them, with and without an entropy bonus."""

import pytest
import torch

from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup
from rlcore.workers.actor import ActorWorker
from tests.workers.conftest import VOCAB

CHUNK_MB = 3 * VOCAB * 4 / (1 << 20)  # 3 positions' fp32 logits per chunk: every micro-batch has several


def updated_weights(path, make_batch, keep_mb, entropy_coeff):
    config = {"model": {"path": path},
              "actor": {"lr": 0.05, "ppo_micro_batch_size_per_gpu": 2, "shuffle": False, "logits_chunk_mb": CHUNK_MB,
                        "keep_logits_mb": keep_mb, "entropy_coeff": entropy_coeff}}
    group = LocalWorkerGroup(ClassWithInitArgs(ActorWorker, config), world_size=1)
    group.init_model()
    worker = group.worker(0)
    metrics = [group.update_policy(make_batch(seed=s))[0] for s in range(2)]
    return worker.head.keep_tokens, metrics, {k: v.full_tensor().clone() for k, v in worker.module.state_dict().items()}


@pytest.mark.parametrize("entropy_coeff", [0.0, 0.01])
def test_an_update_with_kept_logits_equals_one_that_recomputes_them(tiny_model_dir, make_batch, entropy_coeff):
    keep, metrics, ours = updated_weights(tiny_model_dir, make_batch, 2 * CHUNK_MB, entropy_coeff)  # 2 chunks kept
    none, ref_metrics, ref = updated_weights(tiny_model_dir, make_batch, 0.0, entropy_coeff)
    assert (keep, none) == (6, 0)
    assert [m["actor/grad_norm"] for m in metrics] == [m["actor/grad_norm"] for m in ref_metrics]
    for name in ref:
        assert torch.equal(ours[name], ref[name]), name
