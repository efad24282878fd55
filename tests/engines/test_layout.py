"""The trajectory layout (rlcore.engines.layout) against hand-written tensors."""

import numpy as np
import pytest
import torch

from rlcore.engines.base import Generation
from rlcore.engines.layout import build_output, check_left_padded, pad_rollout, trim_padding, widths
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
