"""The consistency check's tensor math against hand-computed numbers: mismatch sums (bands, lags,
turns) and their exact merge over micro-batches. (Weight fingerprints: tests/trainer/test_weight_fingerprints.py.)"""

import pytest
import torch

from rlcore.algos.consistency import (
    merge_mismatch_sums,
    mismatch_metrics,
    mismatch_sums,
    turn_index,
)


def test_turn_index_counts_runs_of_policy_tokens():
    mask = torch.tensor([[1, 1, 0, 0, 1, 0, 1], [0, 1, 1, 1, 0, 0, 0]])
    assert turn_index(mask).tolist() == [[0, 0, 0, 0, 1, 1, 2], [-1, 0, 0, 0, 0, 0, 0]]


def test_mismatch_metrics_by_hand():
    trainer = torch.tensor([[-1.0, -2.0, -3.0, 0.0], [-0.5, -0.5, 0.0, 0.0]])
    sampler = torch.tensor([[-1.0, -2.2, -2.8, 9.0], [-0.7, -0.4, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    m = mismatch_metrics(mismatch_sums(trainer, sampler, mask, band=(0.9, 1.1)))
    d = [0.0, 0.2, -0.2, 0.2, -0.1]  # the masked column (diff -9) counts nowhere
    assert m["check/tokens"] == 5
    assert m["check/logprob_abs_diff_mean"] == pytest.approx(sum(map(abs, d)) / 5)
    assert m["check/logprob_diff_mean"] == pytest.approx(sum(d) / 5)
    assert m["check/logprob_abs_diff_max"] == pytest.approx(0.2)
    # exp(0.2) = 1.22 and exp(-0.2) = 0.82 leave [0.9, 1.1]; exp(-0.1) = 0.905 does not
    assert m["check/ratio_out_of_band"] == pytest.approx(3 / 5)
    assert "check/logprob_abs_diff_mean/turn_later" not in m  # one turn per row


def test_lags_and_turns_break_the_mismatch_down():
    trainer = torch.zeros(2, 5)
    sampler = torch.tensor([[0.0, 0.0, 0.0, -0.5, -0.5], [0.0, -1.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0, 1, 1], [1, 1, 1, 0, 0]])
    versions = torch.tensor([[3, 3, -1, 3, 3], [1, 1, 1, -1, -1]])
    m = mismatch_metrics(mismatch_sums(trainer, sampler, mask, lags=3 - versions))
    assert m["check/tokens/lag_0"] == 4 and m["check/tokens/lag_2"] == 3 and "check/tokens/lag_1" not in m
    assert m["check/logprob_abs_diff_mean/lag_0"] == pytest.approx(1.0 / 4)
    assert m["check/logprob_abs_diff_mean/lag_2"] == pytest.approx(1.0 / 3)
    assert m["check/ratio_out_of_band/lag_0"] == pytest.approx(2 / 4)
    # row 0 has two turns (env token between): its later-turn tokens hold the whole mismatch
    assert m["check/logprob_abs_diff_mean/turn_first"] == pytest.approx(1.0 / 5)
    assert m["check/logprob_abs_diff_mean/turn_later"] == pytest.approx(1.0 / 2)


def test_lags_of_many_versions_share_the_last_bucket():
    m = mismatch_metrics(mismatch_sums(torch.zeros(1, 3), torch.zeros(1, 3), torch.ones(1, 3),
                                       lags=torch.tensor([[4, 7, 30]])))
    assert m["check/tokens/lag_4"] == 3


def test_merge_over_micro_batches_is_exact():
    g = torch.Generator().manual_seed(0)
    trainer, sampler = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)
    mask = (torch.rand(6, 8, generator=g) > 0.3).long()
    whole = mismatch_metrics(mismatch_sums(trainer, sampler, mask))
    parts = merge_mismatch_sums(mismatch_sums(trainer[i:i + 2], sampler[i:i + 2], mask[i:i + 2]) for i in (0, 2, 4))
    assert mismatch_metrics(parts) == pytest.approx(whole)


def test_bad_band_and_no_tokens():
    with pytest.raises(ValueError, match="0 < low < 1 < high"):
        mismatch_sums(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), band=(1.1, 0.9))
    assert mismatch_metrics(mismatch_sums(torch.zeros(1, 2), torch.ones(1, 2), torch.zeros(1, 2))) == {}
