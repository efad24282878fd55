"""The trajectory layout (rlcore.engines.layout) against hand-written tensors."""

import numpy as np
import pytest
import torch

from rlcore.engines.base import Generation
from rlcore.engines.layout import build_output, check_left_padded, crop_padding, pad_back, pad_rollout, trim_padding, widths
from rlcore.protocol import DataProto

PAD = 0


def prompts():
    """Two left-padded prompts: [5, 6, 7] and [8]."""
    mask = torch.tensor([[1, 1, 1], [0, 0, 1]])
    return DataProto.from_dict(
        {"input_ids": torch.tensor([[5, 6, 7], [PAD, PAD, 8]]), "attention_mask": mask,
         "position_ids": torch.tensor([[0, 1, 2], [0, 0, 0]])},
        {"uid": np.array(["a", "b"], dtype=object)},
        {"temperature": 0.5},
    )


def test_build_output_masks_pads_and_continues_positions():
    # Row 0 generated 2 tokens, row 1 all 4; whatever an engine leaves after a row's length is ignored.
    gen = Generation(responses=torch.tensor([[11, 12, 99, 99], [13, 14, 15, 16]]), lengths=torch.tensor([2, 4]),
                     log_probs=torch.tensor([[-0.1, -0.2, -9.0, -9.0], [-0.3, -0.4, -0.5, -0.6]]))
    out = build_output(prompts(), gen, pad_token_id=PAD, gen_time_s=2.0)
    b = out.batch
    assert b["prompts"].tolist() == [[5, 6, 7], [PAD, PAD, 8]]
    assert b["responses"].tolist() == [[11, 12, PAD, PAD], [13, 14, 15, 16]]
    assert b["response_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert b["input_ids"].tolist() == [[5, 6, 7, 11, 12, PAD, PAD], [PAD, PAD, 8, 13, 14, 15, 16]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 2, 3, 4]]
    torch.testing.assert_close(b["rollout_log_probs"], torch.tensor([[-0.1, -0.2, 0.0, 0.0], [-0.3, -0.4, -0.5, -0.6]]))
    assert b["rollout_log_probs"].dtype == torch.float32
    assert list(out.non_tensor_batch["uid"]) == ["a", "b"]
    assert out.meta_info["temperature"] == 0.5  # the input's meta_info travels on
    assert out.meta_info["rollout/num_generated_tokens"] == 6
    assert out.meta_info["rollout/gen_time_s"] == 2.0 and out.meta_info["rollout/tokens_per_s"] == 3.0
    assert widths(out) == (3, 4)
    with pytest.raises(RuntimeError, match="3 responses for 2 prompts"):
        build_output(prompts(), Generation(torch.zeros((3, 4), dtype=torch.long), torch.ones(3, dtype=torch.long),
                                           torch.zeros((3, 4))), PAD, 1.0)


def test_check_left_padded():
    check_left_padded(torch.tensor([[1, 1, 1], [0, 0, 1]]))
    with pytest.raises(ValueError, match="left-padded with at least one token"):
        check_left_padded(torch.tensor([[1, 1, 0]]))  # right padding
    with pytest.raises(ValueError, match="a 0 between two 1s"):
        check_left_padded(torch.tensor([[1, 0, 1]]))
    with pytest.raises(ValueError, match=r"\(B, T_p\)"):
        check_left_padded(torch.ones(3))
    with pytest.raises(ValueError, match="at least one token"):
        check_left_padded(torch.ones((2, 0)))


def test_pad_rollout_and_trim_padding_round_trip():
    gen = Generation(responses=torch.tensor([[11, 12, 0], [13, 0, 0]]), lengths=torch.tensor([2, 1]),
                     log_probs=torch.tensor([[-0.1, -0.2, 0.0], [-0.3, 0.0, 0.0]]))
    out = build_output(prompts(), gen, PAD, 1.0)
    out.batch["advantages"] = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])  # a response-width key
    out.batch["score"] = torch.tensor([1.0, 2.0])  # (B,) keys are left alone
    wide = pad_rollout(out, 5, 4, pad_token_id=PAD)
    b = wide.batch
    assert widths(wide) == (5, 4)
    assert b["prompts"].tolist() == [[PAD, PAD, 5, 6, 7], [PAD, PAD, PAD, PAD, 8]]
    assert b["input_ids"].tolist() == [[PAD, PAD, 5, 6, 7, 11, 12, PAD, PAD], [PAD, PAD, PAD, PAD, 8, 13, PAD, PAD, PAD]]
    assert b["attention_mask"].tolist() == [[0, 0, 1, 1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 1, 1, 0, 0, 0]]
    assert b["position_ids"][:, :2].tolist() == [[0, 0], [0, 0]] and b["position_ids"][:, -1].tolist() == [0, 0]
    assert b["advantages"].tolist() == [[1.0, 2.0, 0.0, 0.0], [3.0, 0.0, 0.0, 0.0]]
    assert b["score"].tolist() == [1.0, 2.0]
    assert pad_rollout(out, 3, 3, PAD) is out  # nothing to do
    # Trimming drops the columns that are padding in every row: back to prompt width 3, response width 2.
    trimmed = trim_padding(wide, PAD)
    assert widths(trimmed) == (3, 2)
    t_full = 3 + 2  # prompt width + the trimmed response width
    for key in ("prompts", "input_ids", "attention_mask", "position_ids", "response_mask", "rollout_log_probs",
                "advantages", "score"):
        value = out.batch[key]
        expected = value[:, :t_full] if key in ("input_ids", "attention_mask", "position_ids") else value
        expected = expected[:, :2] if key in ("response_mask", "rollout_log_probs", "advantages") else expected
        assert torch.equal(trimmed.batch[key], expected), key
    bad = out.select(batch_keys=["prompts", "responses", "input_ids", "attention_mask", "position_ids"])
    bad.batch["odd"] = torch.zeros((2, 7 - 1))
    with pytest.raises(ValueError, match="batch\\['odd'\\] has width 6"):
        pad_rollout(bad, 4, 4, PAD)


def micro_batch():
    """Prompt width 4, response width 3. Row 0: prompt [5, 6], response [11, 12]; row 1: prompt [7],
    response [13]. Columns 0-1 are padding in both rows on the left, column 6 on the right."""
    ids = torch.tensor([[PAD, PAD, 5, 6, 11, 12, PAD], [PAD, PAD, PAD, 7, 13, PAD, PAD]])
    mask = (ids != PAD).long()
    routed = torch.arange(2 * 7 * 1 * 2).reshape(2, 7, 1, 2)  # (B, T, L=1, k=2)
    return DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
         "responses": ids[:, 4:], "response_mask": mask[:, 4:].float(),
         "advantages": torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]]), "routed_experts": routed,
         "rewards": torch.tensor([0.5, -0.5])},
        {"uid": np.array(["a", "b"], dtype=object)}, {"temperature": 0.5})


def test_crop_padding_drops_columns_padded_in_every_row():
    data = micro_batch()
    cropped, left, right = crop_padding(data)
    b = cropped.batch
    assert (left, right) == (2, 1)
    assert b["input_ids"].tolist() == [[5, 6, 11, 12], [PAD, 7, 13, PAD]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1], [0, 1, 1, 0]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3], [0, 0, 1, 1]]  # the rows' own positions, unchanged
    assert b["responses"].tolist() == [[11, 12], [13, PAD]]  # still the tail of input_ids
    assert b["response_mask"].tolist() == [[1.0, 1.0], [1.0, 0.0]]
    assert b["advantages"].tolist() == [[1.0, 2.0], [3.0, 0.0]]
    assert torch.equal(b["routed_experts"], data.batch["routed_experts"][:, 2:6])  # (B, T, L, k) on dim 1
    assert b["rewards"].tolist() == [0.5, -0.5]  # per row: kept whole
    assert cropped.meta_info == {"temperature": 0.5} and cropped.non_tensor_batch["uid"].tolist() == ["a", "b"]


def test_crop_padding_keeps_one_response_column_and_pair_rows():
    # Both responses empty: the right crop stops at one response column (the first response token's
    # logit sits at the last prompt column, which must stay).
    ids = torch.tensor([[5, 6, PAD, PAD], [PAD, 7, PAD, PAD]])
    mask = (ids != PAD).long()
    data = DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "responses": ids[:, 2:]})
    cropped, left, right = crop_padding(data)
    assert (left, right) == (0, 1) and cropped.batch["input_ids"].tolist() == [[5, 6, PAD], [PAD, 7, PAD]]
    # Pair rows (B, 2, T) are cropped on their last axis, over both sequences of every pair.
    pair_ids = torch.tensor([[[5, 6, PAD, PAD], [5, PAD, PAD, PAD]]])
    pairs = DataProto.from_dict({"input_ids": pair_ids, "attention_mask": (pair_ids != PAD).long()})
    cropped, left, right = crop_padding(pairs)
    assert (left, right) == (0, 2) and cropped.batch["input_ids"].tolist() == [[[5, 6], [5, PAD]]]
    # Nothing to drop: the same DataProto back.
    full = DataProto.from_dict({"input_ids": torch.tensor([[5, 6]]), "attention_mask": torch.ones(1, 2),
                                "responses": torch.tensor([[6]])})
    assert crop_padding(full) == (full, 0, 0)


def test_pad_back_restores_the_response_width_with_zeros():
    out = pad_back({"log_prob": torch.tensor([[-1.0, -2.0], [-3.0, -4.0]]), "score": torch.tensor([1.0, 2.0]),
                    "logits": torch.ones(2, 2, 3)}, width=2, right=1)
    assert out["log_prob"].tolist() == [[-1.0, -2.0, 0.0], [-3.0, -4.0, 0.0]]
    assert out["score"].tolist() == [1.0, 2.0]
    assert out["logits"].shape == (2, 3, 3) and out["logits"][:, 2].abs().sum() == 0
