"""rlcore.algos.dapo: the group filter, the truncation test and the soft overlong penalty against
values worked out by hand."""

import numpy as np
import pytest
import torch

from rlcore.algos.dapo import group_has_signal, overlong_penalty, truncated_rows


def test_only_groups_with_two_different_scores_have_signal():
    values = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5])
    index = np.array(["a", "a", "b", "b", "c", "c", "d", "d"], dtype=object)
    # a: all right, b: mixed, c: all wrong, d: all equal (a partial score)
    assert group_has_signal(values, index).tolist() == [False, False, True, True, False, False, False, False]


def test_groups_are_found_by_index_not_by_position():
    values = torch.tensor([1.0, 0.0, 1.0, 1.0, 3.0])
    index = ["x", "y", "x", "y", "z"]  # x: 1, 1 (none); y: 0, 1 (signal); z: a group of one (never)
    assert group_has_signal(values, index).tolist() == [False, True, False, True, False]


def test_a_tiny_difference_is_signal_and_shapes_are_checked():
    assert group_has_signal(torch.tensor([0.0, 1e-7]), [0, 0]).tolist() == [True, True]
    with pytest.raises(ValueError, match="one index per row"):
        group_has_signal(torch.tensor([0.0, 1.0]), [0, 0, 1])


def test_overlong_penalty_at_the_boundaries():
    # L_max 8, L_cache 4: free up to 4 tokens, then -1/4 per token, -1 at 8 and beyond
    lengths = torch.tensor([0, 3, 4, 5, 6, 7, 8, 9])
    assert overlong_penalty(lengths, 8, 4).tolist() == [0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0]
    assert overlong_penalty(lengths, 8, 4, penalty_factor=0.5).tolist() == [0, 0, 0, -0.125, -0.25, -0.375, -0.5, -0.5]
    # L_cache 3 of L_max 10: threshold 7; 8 -> -1/3, 9 -> -2/3
    got = overlong_penalty(torch.tensor([7, 8, 9, 10, 11]), 10, 3)
    assert torch.allclose(got, torch.tensor([0.0, -1 / 3, -2 / 3, -1.0, -1.0]))
    assert got.dtype == torch.float32


def test_overlong_penalty_refuses_a_buffer_longer_than_the_limit():
    for bad in (0, 9):
        with pytest.raises(ValueError, match="buffer_len"):
            overlong_penalty(torch.tensor([1]), 8, bad)


def test_truncated_means_full_length_without_a_stop_token():
    eos, stop, pad = 2, 9, 0
    responses = torch.tensor([
        [5, 6, eos, pad],   # stopped early
        [5, 6, 7, eos],     # stopped at exactly the limit: finished, not cut
        [5, 6, 7, 8],       # cut
        [5, stop, pad, pad],  # stopped early on an extra stop id
        [5, 6, 7, stop],    # stopped at the limit on an extra stop id
    ])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]])
    assert truncated_rows(responses, mask, 4, [eos, stop]).tolist() == [False, False, True, False, False]
    assert truncated_rows(responses, mask, 4, [eos]).tolist() == [False, False, True, False, True]
    # a wider padded layout (responses padded past the limit): the length decides, not the width
    wide = torch.nn.functional.pad(responses, (0, 2), value=pad)
    wide_mask = torch.nn.functional.pad(mask, (0, 2), value=0)
    assert truncated_rows(wide, wide_mask, 4, [eos, stop]).tolist() == [False, False, True, False, False]
