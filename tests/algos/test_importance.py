"""rlcore.algos.importance: truncated and masked importance weights, per token, per sequence and
by the geometric mean, against hand-computed numbers."""

import math

import pytest
import torch
from algo_refs import close

from rlcore.algos import importance
from rlcore.algos.importance import IS_LEVELS, IS_MODES


def test_compute_is_weights_token_and_sequence():
    old = torch.log(torch.tensor([[0.5, 3.0, 1.5], [3.0, 3.0, 7.0]]))
    rollout = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    w, m = importance.compute_is_weights(old, rollout, mask, cap=2.0, level="token")
    close(w, [[0.5, 2.0, 1.5], [2.0, 2.0, 0.0]])
    assert m["is/capped_frac"] == pytest.approx(3 / 5)
    assert m["is/weight_mean"] == pytest.approx((0.5 + 2 + 1.5 + 2 + 2) / 5)

    old_seq = torch.log(torch.tensor([[0.5, 3.0, 1.0], [3.0, 3.0, 7.0]]))
    # row 0: 0.5 * 3 * 1 = 1.5 ; row 1: 3 * 3 = 9 (the 7 is masked) -> capped at 4
    w, m = importance.compute_is_weights(old_seq, rollout, mask, cap=4.0, level="sequence")
    close(w, [[1.5, 1.5, 1.5], [4.0, 4.0, 0.0]])
    assert m["is/capped_frac"] == pytest.approx(0.5)
    assert not w.requires_grad
    with pytest.raises(ValueError, match="level"):
        importance.compute_is_weights(old, rollout, mask, level="batch")
    assert IS_LEVELS == ("token", "sequence", "geometric")  # the levels checked here, and no others
    assert IS_MODES == ("truncate", "mask")


def test_mask_mode_drops_tokens_outside_the_bounds_and_keeps_the_others_weights():
    # token ratios; row 1's 7.0 is padding, row 2 is DP padding (no valid token)
    old = torch.log(torch.tensor([[0.3, 3.0, 1.5], [3.0, 1.2, 7.0], [5.0, 5.0, 5.0]]))
    rollout = torch.zeros(3, 3)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    # cap 2, lower 1/2 by default: 0.3 (below) and the two 3.0 (above) are dropped
    w, m = importance.compute_is_weights(old, rollout, mask, cap=2.0, mode="mask")
    close(w, [[0.0, 0.0, 1.5], [0.0, 1.2, 0.0], [0.0, 0.0, 0.0]])
    assert m["is/masked_frac"] == pytest.approx(3 / 5)
    assert m["is/masked_seq_frac"] == pytest.approx(1.0)  # both real rows lost a token; row 2 not counted
    assert m["is/capped_frac"] == pytest.approx(2 / 5)
    assert m["is/weight_mean"] == pytest.approx(2.7 / 5)
    assert m["is/log_ratio_min"] == pytest.approx(math.log(0.3), abs=1e-6)
    assert m["is/log_ratio_max"] == pytest.approx(math.log(3.0), abs=1e-6)  # the padded 7.0 is not seen
    # an explicit lower bound of 0.25 keeps the 0.3
    w, m = importance.compute_is_weights(old, rollout, mask, cap=2.0, mode="mask", lower=0.25)
    close(w, [[0.3, 0.0, 1.5], [0.0, 1.2, 0.0], [0.0, 0.0, 0.0]])
    assert m["is/masked_frac"] == pytest.approx(2 / 5)
    # truncation of the same tokens: nothing dropped, 3.0 capped at 2
    w, m = importance.compute_is_weights(old, rollout, mask, cap=2.0)
    close(w, [[0.3, 2.0, 1.5], [2.0, 1.2, 0.0], [0.0, 0.0, 0.0]])
    assert "is/masked_frac" not in m


def test_sequence_and_geometric_levels_mask_whole_sequences():
    # row 0: ratios 0.5, 3, 1 (product 1.5, geometric mean 1.5 ** (1/3)); row 1: 3, 3 (product 9, geometric 3)
    old = torch.log(torch.tensor([[0.5, 3.0, 1.0], [3.0, 3.0, 7.0]]))
    rollout = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    w, m = importance.compute_is_weights(old, rollout, mask, cap=4.0, level="sequence", mode="mask")
    close(w, [[1.5, 1.5, 1.5], [0.0, 0.0, 0.0]])  # 9 > 4: the whole of row 1 goes
    assert m["is/masked_frac"] == pytest.approx(2 / 5)
    assert m["is/masked_seq_frac"] == pytest.approx(1 / 2)
    assert m["is/capped_frac"] == pytest.approx(1 / 2)
    g0 = 1.5 ** (1 / 3)
    w, m = importance.compute_is_weights(old, rollout, mask, cap=2.0, level="geometric")
    close(w, [[g0, g0, g0], [2.0, 2.0, 0.0]])  # truncation: 3 -> 2
    assert m["is/capped_frac"] == pytest.approx(1 / 2)
    w, m = importance.compute_is_weights(old, rollout, mask, cap=2.0, level="geometric", mode="mask")
    close(w, [[g0, g0, g0], [0.0, 0.0, 0.0]])
    # the geometric mean does not grow with length: eight tokens of ratio 1.5 each stay at 1.5,
    # where their product (25.6) is dropped by any cap below it
    long = torch.full((1, 8), math.log(1.5))
    w, _ = importance.compute_is_weights(long, torch.zeros(1, 8), torch.ones(1, 8), cap=2.0, level="geometric", mode="mask")
    close(w, torch.full((1, 8), 1.5))
    w, _ = importance.compute_is_weights(long, torch.zeros(1, 8), torch.ones(1, 8), cap=2.0, level="sequence", mode="mask")
    close(w, torch.zeros(1, 8))


def test_is_weights_refuse_bad_settings():
    old, mask = torch.zeros(1, 2), torch.ones(1, 2)
    with pytest.raises(ValueError, match="mode"):
        importance.compute_is_weights(old, old, mask, mode="clip")
    with pytest.raises(ValueError, match="lower .* applies to mode 'mask' only"):
        importance.compute_is_weights(old, old, mask, lower=0.5)
    with pytest.raises(ValueError, match="0 < lower <= cap"):
        importance.compute_is_weights(old, old, mask, cap=2.0, mode="mask", lower=3.0)
