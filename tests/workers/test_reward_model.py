"""RewardModelWorker against HF's own sequence-classification forward on a tiny reward model."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification

from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup
from rlcore.workers.reward_model import RewardModelWorker


@pytest.fixture(scope="module")
def rm_dir(tiny_model_dir, tmp_path_factory):
    """A randomly initialised one-label reward model with the tiny LM's architecture."""
    config = AutoConfig.from_pretrained(tiny_model_dir, num_labels=1)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    out = tmp_path_factory.mktemp("tiny_rm")
    model.save_pretrained(out)
    return str(out)


def rm_group(path, **reward_model):
    wg = LocalWorkerGroup(ClassWithInitArgs(RewardModelWorker, {"model": {"path": path}, "reward_model": reward_model}), 1)
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


def test_unknown_key_is_an_error(rm_dir):
    with pytest.raises(ValueError, match=r"reward_model\.micro_batch_size\b"):
        RewardModelWorker({"model": {"path": rm_dir}, "reward_model": {"micro_batch_size": 2}})
