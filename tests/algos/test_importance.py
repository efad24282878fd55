"""rlcore.algos.importance: truncated importance weights, per token and per sequence."""

import pytest
import torch
from algo_refs import close

from rlcore.algos import importance
from rlcore.algos.importance import IS_LEVELS


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
    assert IS_LEVELS == ("token", "sequence")  # the two levels checked above, and no others
