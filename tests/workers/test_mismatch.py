"""The actor's check/* metrics: the same numbers from one rank and from two (sums and max combined
over ranks, not averaged), from the update's own forward (single step) and from old_log_probs, and
with rows that skip the forward (zero advantage) or run as stand-ins counted once."""

import pytest
import torch

from rlcore.algos.consistency import mismatch_metrics, mismatch_sums
from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup, RayResourcePool, RayWorkerGroup
from rlcore.workers.actor import ActorWorker
from rlcore.workers.mismatch import CheckConfig, read_check_config


def config(path, **actor):
    return {"model": {"path": path, "mixed_precision": None},
            "actor": {"optimizer": "sgd", "lr": 1e-12, "weight_decay": 0.0, "ppo_micro_batch_size_per_gpu": 2, "shuffle": False, **actor}}


def scored_batch(make_batch, wg):
    """A batch whose sampler log-probs are the actor's own, shifted by known amounts."""
    batch = make_batch(prompt_lens=(5, 3, 4, 2), response_lens=(6, 5, 1, 2))
    own = wg.compute_log_prob(batch).batch["old_log_probs"]
    shift = torch.tensor([[0.0, 0.3, -0.3, 0.01, 0.0, 0.0]]).expand(4, -1)
    batch.batch["rollout_log_probs"] = own - shift
    return batch, own


def expected(batch, own):
    return mismatch_metrics(mismatch_sums(own, batch.batch["rollout_log_probs"], batch.batch["response_mask"]))


def test_one_rank_single_step_and_old_log_probs_agree(tiny_model_dir, make_batch):
    wg = LocalWorkerGroup(ClassWithInitArgs(ActorWorker, config(tiny_model_dir)))
    wg.init_model()
    batch, own = scored_batch(make_batch, wg)
    want = expected(batch, own)
    assert want["check/ratio_out_of_band"] == pytest.approx(5 / 14)  # the +-0.3 tokens of rows with >= 2 tokens
    single = wg.update_policy(batch)[0]
    assert {k: v for k, v in single.items() if k.startswith("check/")} == pytest.approx(want, abs=1e-5)
    batch.batch["old_log_probs"] = own
    assert {k: v for k, v in wg.update_policy(batch)[0].items() if k.startswith("check/")} == pytest.approx(want)
    # zero-advantage rows skip the forward: the check covers the rows trained
    batch.batch.pop("old_log_probs")
    batch.batch["advantages"][2:] = 0
    trained = batch[[0, 1]]
    got = {k: v for k, v in wg.update_policy(batch)[0].items() if k.startswith("check/")}
    assert got == pytest.approx(expected(trained, own[:2]), abs=1e-5)


def test_two_ranks_combine_exactly(ray_cluster, tiny_model_dir, make_batch):
    local = LocalWorkerGroup(ClassWithInitArgs(ActorWorker, config(tiny_model_dir)))
    local.init_model()
    batch, own = scored_batch(make_batch, local)
    want = expected(batch, own)
    pool = RayResourcePool([2], num_cpus_per_process=0.5, name_prefix="mismatch_test")
    wg = RayWorkerGroup(pool, ClassWithInitArgs(ActorWorker, config(tiny_model_dir)), default_timeout=300)
    try:
        wg.init_model()
        per_rank = wg.update_policy(batch)
        assert len(per_rank) == 2
        for metrics in per_rank:  # every rank reports the whole batch's numbers (max is a max, not a mean)
            assert {k: v for k, v in metrics.items() if k.startswith("check/")} == pytest.approx(want, abs=1e-5)
    finally:
        wg.shutdown()
        pool.shutdown()


def test_check_config_is_read_from_the_trainer_section():
    assert read_check_config({}) == CheckConfig()
    assert read_check_config({"trainer": {"check": {"ratio_band": [0.8, 1.25]}}}).ratio_band == [0.8, 1.25]
    with pytest.raises(ValueError, match="ratio_band"):
        read_check_config({"trainer": {"check": {"ratio_band": [1.2, 0.8]}}})
    with pytest.raises(ValueError, match="weight_checksum_freq"):
        CheckConfig(weight_checksum_freq=-1)


def test_every_check_key_is_documented(undocumented_fields):
    assert undocumented_fields(CheckConfig) == []
