import random

import pytest

from rlcore.algos.seqlen_balancing import rearrange_micro_batches


def sums(groups, lens):
    return [sum(lens[i] for i in g) for g in groups]


def assert_each_index_once(groups, n):
    flat = [i for g in groups for i in g]
    assert sorted(flat) == list(range(n))


def test_micro_batches_first_fit_decreasing_by_hand():
    lens = [5, 3, 8, 2, 6, 1]  # 25 tokens, budget 10: three micro-batches is the minimum
    batches = rearrange_micro_batches(lens, 10)
    assert batches == [[2, 3], [1, 4, 5], [0]]
    assert sums(batches, lens) == [10, 10, 5]


def test_micro_batches_respect_budget_on_random_lengths():
    rng = random.Random(1)
    lens = [rng.randint(1, 300) for _ in range(200)]
    batches = rearrange_micro_batches(lens, 512)
    assert_each_index_once(batches, 200)
    assert max(sums(batches, lens)) <= 512
    assert len(batches) <= -(-sum(lens) // 512) * 11 // 9 + 1


def test_micro_batch_item_over_budget_is_an_error():
    assert rearrange_micro_batches([4, 4], 4) == [[0], [1]]
    with pytest.raises(ValueError, match="item 1 has 9 tokens, more than max_token_len=8"):
        rearrange_micro_batches([3, 9], 8)


def test_micro_batches_to_a_forced_count_split_the_heaviest_within_budget():
    """DP ranks must agree on the count: a rank that packed fewer splits its heaviest micro-batches."""
    lens = [5, 4, 3, 3, 2, 1]
    assert rearrange_micro_batches(lens, 10) == [[0, 1, 5], [2, 3, 4]]  # loads 10 and 8
    assert rearrange_micro_batches(lens, 10, num_micro_batches=2) == [[0, 1, 5], [2, 3, 4]]
    assert rearrange_micro_batches(lens, 10, num_micro_batches=3) == [[0, 5], [2, 3, 4], [1]]  # 10 split: 5+1 | 4
    four = rearrange_micro_batches(lens, 10, num_micro_batches=4)
    assert four == [[0, 5], [2, 4], [1], [3]]  # then the 8: 3+2 | 3
    assert rearrange_micro_batches(lens, 10, num_micro_batches=6) == [[i] for i in (0, 2, 1, 3, 5, 4)]
    rng = random.Random(1)
    lens = [rng.randint(1, 300) for _ in range(40)]
    for count in range(len(rearrange_micro_batches(lens, 512)), 41):
        batches = rearrange_micro_batches(lens, 512, num_micro_batches=count)
        assert len(batches) == count and all(batches)
        assert sorted(i for b in batches for i in b) == list(range(40))
        assert max(sum(lens[i] for i in b) for b in batches) <= 512
    with pytest.raises(ValueError, match="num_micro_batches=1 must be between the 2 micro-batches"):
        rearrange_micro_batches([5, 4, 3, 3, 2, 1], 10, num_micro_batches=1)
    with pytest.raises(ValueError, match="and the 6 items"):
        rearrange_micro_batches([5, 4, 3, 3, 2, 1], 10, num_micro_batches=7)
