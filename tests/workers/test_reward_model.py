"""RewardModelWorker against HF's own sequence-classification forward on a tiny reward model: the
frozen scorer, and the trained one (one SGD step against a hand computation, on 1 and 2 ranks;
training lowers the loss; the exported directory loads and scores the same)."""

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from rlcore.data.preference import PairDataset, collate_pairs, write_pairs_jsonl
from rlcore.protocol import DataProto
from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup, RayResourcePool, RayWorkerGroup
from rlcore.typed_config import ConfigError
from rlcore.workers.reward_model import RewardModelConfig, RewardModelWorker


@pytest.fixture(scope="module")
def rm_dir(tiny_model_dir, tmp_path_factory):
    """A randomly initialised one-label reward model with the tiny LM's architecture."""
    config = AutoConfig.from_pretrained(tiny_model_dir, num_labels=1)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    out = tmp_path_factory.mktemp("tiny_rm")
    model.save_pretrained(out)
    return str(out)


def rm_group(path, **scoring):
    wg = LocalWorkerGroup(ClassWithInitArgs(RewardModelWorker, {"reward": {"model": {"path": path, **scoring}}}), 1)
    wg.init_model()
    return wg


@pytest.fixture(scope="module")
def rm(rm_dir):
    return rm_group(rm_dir, micro_batch_size_per_gpu=3)


def hf_scores(path, data):
    model = AutoModelForSequenceClassification.from_pretrained(path)
    b = data.batch
    with torch.no_grad():
        return model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits[:, 0]


def test_scores_equal_hf_sequence_classification(rm, rm_dir, make_batch):
    data = make_batch()  # padding holds the pad id, so HF's own pooling finds the last real token
    out = rm.compute_rm_score(data)
    torch.testing.assert_close(out.batch["rm_scores"], hf_scores(rm_dir, data), atol=1e-5, rtol=1e-5)


def test_token_level_scores_sit_on_the_last_response_token(rm, make_batch):
    data = make_batch(response_lens=(6, 5, 1, 0))
    out = rm.compute_rm_score(data).batch
    expected = torch.zeros(4, 6)
    for row, last in ((0, 5), (1, 4), (2, 0)):
        expected[row, last] = out["rm_scores"][row]
    assert torch.equal(out["token_level_scores"], expected)  # an empty response gets no token score
    assert (out["rm_scores"] != 0).all()


def test_pooling_follows_the_attention_mask_not_the_pad_id(rm, rm_dir, make_batch):
    data = make_batch()
    reference = rm.compute_rm_score(data).batch["rm_scores"]
    eos_padded = make_batch()
    padding = eos_padded.batch["attention_mask"] == 0
    eos_padded.batch["input_ids"] = torch.where(padding, torch.full_like(padding, 2, dtype=torch.long),
                                                eos_padded.batch["input_ids"])
    torch.testing.assert_close(rm.compute_rm_score(eos_padded).batch["rm_scores"], reference, atol=1e-6, rtol=1e-6)
    # HF's pad-id pooling would now read a padding position for the short rows
    assert not torch.allclose(hf_scores(rm_dir, eos_padded)[1:], reference[1:], atol=1e-3)


def test_dynamic_batches_keep_row_order(rm, rm_dir, make_batch):
    data = make_batch()
    dynamic = rm_group(rm_dir, use_dynamic_bsz=True, max_token_len_per_gpu=12).compute_rm_score(data)
    torch.testing.assert_close(dynamic.batch["rm_scores"], rm.compute_rm_score(data).batch["rm_scores"], atol=1e-6, rtol=1e-6)


def test_unknown_key_is_an_error(rm_dir, tiny_model_dir):
    with pytest.raises(ConfigError, match=r"reward\.model\.micro_batch_size\b"):
        RewardModelWorker({"reward": {"model": {"path": rm_dir, "micro_batch_size": 2}}})
    with pytest.raises(ConfigError, match=r"reward_model\.micro_batch_size\b"):
        RewardModelWorker({"model": {"path": tiny_model_dir}, "reward_model": {"micro_batch_size": 2}}, trainable=True)


def test_scorer_needs_a_trained_head(tiny_model_dir):
    with pytest.raises(ValueError, match=r"reward\.model\.path"):
        RewardModelWorker({"model": {"path": tiny_model_dir}})  # a scorer reads reward.model.path, not model.path
    with pytest.raises(Exception, match="holds no trained score head"):
        rm_group(tiny_model_dir)  # a causal LM would score with a random head


# ----------------------------------------------------------------------------- training
PAIRS = [{"prompt": "1+2=", "chosen": "3", "rejected": "4"}, {"prompt": "12+3=", "chosen": "15", "rejected": ""},
         {"prompt": "7+7=", "chosen": "14", "rejected": "41"}, {"prompt": "9+0=", "chosen": "9", "rejected": "9+"}]


@pytest.fixture(scope="module")
def pairs(tiny_model_dir, tmp_path_factory) -> DataProto:
    """Four pairs of different lengths in the pair layout (B, 2, T), right-padded with the pad id."""
    path = write_pairs_jsonl(tmp_path_factory.mktemp("pairs") / "p.jsonl", PAIRS)
    ds = PairDataset(path, AutoTokenizer.from_pretrained(tiny_model_dir))
    return DataProto.from_dict(*collate_pairs([ds[i] for i in range(len(ds))], 0))


def trained_config(path, **reward_model):
    base = {"optimizer": "sgd", "lr": 0.1, "weight_decay": 0.0, "grad_clip": None, "ppo_micro_batch_size_per_gpu": 1}
    return {"model": {"path": path}, "reward_model": {**base, **reward_model}}


def trained_group(path, **reward_model):
    wg = LocalWorkerGroup(ClassWithInitArgs(RewardModelWorker, trained_config(path, **reward_model), trainable=True), 1)
    wg.init_model()
    return wg


@pytest.fixture(scope="module")
def ray_trained(ray_cluster, tiny_model_dir):
    pool = RayResourcePool([2], num_cpus_per_process=0.5, name_prefix="rm_test")
    wg = RayWorkerGroup(pool, ClassWithInitArgs(RewardModelWorker, trained_config(tiny_model_dir), trainable=True),
                        default_timeout=300)
    wg.init_model()
    yield wg
    wg.shutdown()
    pool.shutdown()


def hand_model(path, state):
    """HF's sequence-classification model of ``path`` holding the worker's full weights."""
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
    model.model.load_state_dict({k.removeprefix("backbone."): v for k, v in state.items() if k.startswith("backbone.")})
    model.score.load_state_dict({"weight": state["head.weight"]})
    return model


def hand_pair_scores(model, data):
    """HF's own forward (it pools at the last non-pad token: each sequence's eos here), (B, 2)."""
    b = data.batch
    flat = {k: b[k].reshape(-1, b[k].shape[-1]) for k in ("input_ids", "attention_mask", "position_ids")}
    return model(**flat).logits[:, 0].reshape(-1, 2)


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_one_sgd_step_is_the_bradley_terry_gradient(backend, tiny_model_dir, pairs, request):
    """One SGD step (lr 0.1) on mean -log sigmoid(r_c - r_r) over 4 pairs, cut into 4 one-pair
    micro-batches, and on Ray over 2 ranks: the same step as the plain loss's gradient."""
    wg = trained_group(tiny_model_dir) if backend == "local" else request.getfixturevalue("ray_trained")
    before = wg.get_full_state_dict()
    model = hand_model(tiny_model_dir, before)
    scores = hand_pair_scores(model, pairs)
    torch.testing.assert_close(wg.compute_pair_scores(pairs).batch["chosen_scores"], scores[:, 0].detach(),
                               atol=1e-5, rtol=1e-5)
    loss = -F.logsigmoid(scores[:, 0] - scores[:, 1]).mean()
    params = dict(model.named_parameters())
    grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
    norm = math.sqrt(sum(g.square().sum().item() for g in grads.values()))
    for m in wg.update_rm(pairs):
        assert m["rm/loss"] == pytest.approx(loss.item(), rel=1e-5)
        assert m["rm/grad_norm"] == pytest.approx(norm, rel=1e-4)
    after = wg.get_full_state_dict()
    torch.testing.assert_close(after["head.weight"], before["head.weight"] - 0.1 * grads["score.weight"],
                               atol=1e-6, rtol=1e-5)
    key = "layers.1.mlp.down_proj.weight"
    torch.testing.assert_close(after[f"backbone.{key}"], before[f"backbone.{key}"] - 0.1 * grads[f"model.{key}"],
                               atol=1e-6, rtol=1e-5)


def test_training_ranks_the_pairs_and_exports_a_loadable_reward_model(tiny_model_dir, pairs, tmp_path):
    wg = trained_group(tiny_model_dir, optimizer="adamw", lr=3e-3, ppo_micro_batch_size_per_gpu=4)
    losses = [wg.update_rm(pairs)[0]["rm/loss"] for _ in range(8)]
    assert losses[-1] < 0.5 * losses[0], losses  # from ~log 2
    scores = wg.compute_pair_scores(pairs).batch
    assert (scores["chosen_scores"] > scores["rejected_scores"]).all()
    wg.export_hf(str(tmp_path / "hf"))
    exported = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf")
    assert exported.config.num_labels == 1 and exported.config.architectures == ["LlamaForSequenceClassification"]
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").encode("12+3=") == [5, 6, 14, 7, 18]
    with torch.no_grad():
        hf = hand_pair_scores(exported, pairs)
    torch.testing.assert_close(hf[:, 0], scores["chosen_scores"], atol=1e-5, rtol=1e-5)
    scorer = rm_group(str(tmp_path / "hf"), micro_batch_size_per_gpu=3)  # the frozen scorer of PPO/GRPO
    torch.testing.assert_close(scorer.compute_pair_scores(pairs).batch["rejected_scores"], hf[:, 1],
                               atol=1e-5, rtol=1e-5)


def test_update_refuses_rows_that_are_not_pairs_and_a_frozen_scorer(tiny_model_dir, rm, make_batch, pairs):
    wg = trained_group(tiny_model_dir)
    with pytest.raises(Exception, match=r"pair rows \(B, 2, T\)"):
        wg.update_rm(make_batch())
    with pytest.raises(Exception, match="has no optimizer"):
        rm.update_rm(pairs)


def test_reward_model_section_is_documented(undocumented_fields):
    assert RewardModelConfig().lr == 1e-5
    assert undocumented_fields(RewardModelConfig) == []
