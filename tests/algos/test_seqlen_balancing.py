import random

import pytest

from rlcore.algos.seqlen_balancing import (
    balance_partitions,
    balanced_permutation,
    rearrange_micro_batches,
)


def sums(groups, lens):
    return [sum(lens[i] for i in g) for g in groups]


def assert_each_index_once(groups, n):
    flat = [i for g in groups for i in g]
    assert sorted(flat) == list(range(n))


def test_equal_size_partition_of_1_to_8_is_perfect():
    lens = [1, 2, 3, 4, 5, 6, 7, 8]  # total 36: two groups of 18 exist, KK finds them
    groups = balance_partitions(lens, 2)
    assert_each_index_once(groups, 8)
    assert [len(g) for g in groups] == [4, 4]
    assert sums(groups, lens) == [18, 18]


def test_skewed_batch_is_balanced_where_contiguous_split_is_not():
    lens = [1000] * 4 + [10] * 12  # long rows first, as a sorted or unlucky batch arrives
    naive = [sum(lens[c * 4:(c + 1) * 4]) for c in range(4)]
    assert max(naive) - min(naive) == 4000 - 40
    groups = balance_partitions(lens, 4)
    assert_each_index_once(groups, 16)
    assert sums(groups, lens) == [1030, 1030, 1030, 1030]  # one long + three short each


def test_random_skewed_lengths_spread_shrinks_a_lot():
    rng = random.Random(0)
    lens = sorted([rng.randint(20, 60) for _ in range(48)] + [rng.randint(900, 1024)
                                                              for _ in range(16)], reverse=True)
    k = 8
    chunk = len(lens) // k
    naive = [sum(lens[c * chunk:(c + 1) * chunk]) for c in range(k)]
    groups = balance_partitions(lens, k)
    assert_each_index_once(groups, len(lens))
    assert all(len(g) == chunk for g in groups)
    balanced = sums(groups, lens)
    assert max(naive) - min(naive) > 3000
    assert max(balanced) - min(balanced) <= 0.01 * (max(naive) - min(naive))
    assert max(balanced) - min(balanced) < 60


def test_unequal_size_karmarkar_karp_by_hand():
    # differencing: {8}|{7} and {6}|{5}; then 4 joins 7 -> {4,7}|{8}; then 11+5 | 8+6
    lens = [8, 7, 6, 5, 4]
    groups = balance_partitions(lens, 2, equal_size=False)
    assert groups == [[1, 3, 4], [0, 2]]
    assert sums(groups, lens) == [16, 14]


def test_balanced_permutation_chunks_are_the_partitions():
    lens = [9, 1, 1, 9, 5, 5]
    perm = balanced_permutation(lens, 3)
    assert sorted(perm) == list(range(6))
    chunks = [perm[0:2], perm[2:4], perm[4:6]]
    assert sums(chunks, lens) == [10, 10, 10]
    assert chunks == balance_partitions(lens, 3)


def test_partition_argument_errors():
    with pytest.raises(ValueError, match="divisible"):
        balance_partitions([1, 2, 3], 2)
    with pytest.raises(ValueError, match="3 items into 4"):
        balance_partitions([1, 2, 3], 4, equal_size=False)
    with pytest.raises(ValueError, match="k must be positive"):
        balance_partitions([1, 2], 0)


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
