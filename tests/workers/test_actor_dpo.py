"""The actor trains with the registered dpo loss: the chosen-over-rejected margin grows."""

import numpy as np
import pytest

import rlcore.algos.preference  # noqa: F401  (registers the "dpo" policy loss)
from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup
from rlcore.workers.actor import ActorWorker


def test_dpo_updates_raise_the_preference_margin(tiny_model_dir, make_batch):
    data = make_batch(prompt_lens=(5, 5, 3, 3), response_lens=(4, 5, 2, 3))
    data.non_tensor_batch["uid"] = np.array(["a", "a", "b", "b"], dtype=object)
    data.meta_info["dpo_beta"] = 0.5
    base = {"model": {"path": tiny_model_dir}}
    ref = LocalWorkerGroup(ClassWithInitArgs(ActorWorker, {**base, "actor": {}}, role="ref"))
    ref.init_model()
    data.union(ref.compute_ref_log_prob(data))
    actor_cfg = {"policy_loss": "dpo", "shuffle": False, "lr": 1e-3, "ppo_micro_batch_size_per_gpu": 2}
    actor = LocalWorkerGroup(ClassWithInitArgs(ActorWorker, {**base, "actor": actor_cfg}))
    actor.init_model()

    def margin():
        logp = actor.compute_log_prob(data).batch["old_log_probs"]
        mask = data.batch["response_mask"]
        seq = ((logp - data.batch["ref_log_prob"]) * mask).sum(-1)
        return float((seq[0::2] - seq[1::2]).mean())

    assert abs(margin()) < 1e-5  # the actor starts as the reference
    first = actor.update_policy(data)[0]
    for _ in range(4):
        last = actor.update_policy(data)[0]
    assert margin() > 0.5
    assert last["actor/dpo/accuracy"] == 1.0
    assert first["actor/loss"] == pytest.approx(np.log(2), rel=1e-5)  # -log sigmoid(0) before any step
    assert last["actor/loss"] < first["actor/loss"]
