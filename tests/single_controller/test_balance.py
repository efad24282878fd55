"""Karmarkar-Karp partitions of rows by token count, and the balanced DP dispatch built on them."""

import random

import numpy as np
import pytest
import torch

from rlcore.protocol import DataProto
from rlcore.single_controller import (
    ClassWithInitArgs,
    Dispatch,
    LocalWorkerGroup,
    RayResourcePool,
    RayWorkerGroup,
    Worker,
    register,
)
from rlcore.single_controller.balance import balance_partitions, balanced_permutation, chunk_loads


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




def test_chunk_loads_are_the_ranks_token_sums():
    assert chunk_loads([6, 5, 1, 2], 2) == [11, 3]
    assert chunk_loads([6, 5, 1, 2], 2, order=[1, 3, 0, 2]) == [7, 7]


# ------------------------------------------------------------------------------ balanced dispatch
class Rows(Worker):
    @register(Dispatch.DP_COMPUTE_PROTO, balance=True)
    def tag(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"out": data.batch["ids"] * 10, "rank": torch.full((len(data),), self.rank)},
                                   {"uid": data.non_tensor_batch["uid"]})

    @register(Dispatch.DP_COMPUTE_PROTO, balance=True)
    def twice(self, data: DataProto) -> DataProto:
        out = data.repeat(2, interleave=True)
        out.batch["rank"] = torch.full((len(out),), self.rank)
        return out

    @register(Dispatch.DP_COMPUTE_PROTO, balance=True)
    def add(self, a: DataProto, b: DataProto) -> DataProto:
        return DataProto.from_dict({"sum": a.batch["ids"] + b.batch["ids"]})

    @register(Dispatch.DP_COMPUTE_METRIC, balance=True)
    def tokens(self, data: DataProto) -> dict:
        return {"rank": self.rank, "ids": data.batch["ids"].tolist(), "tokens": int(data.batch["attention_mask"].sum())}

    @register(Dispatch.DP_COMPUTE_PROTO)
    def echo(self, data: DataProto) -> DataProto:
        return data

    @register(Dispatch.DP_COMPUTE_PROTO)
    def plain(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"out": data.batch["out"] + 1, "rank": torch.full((len(data),), self.rank)})


def rows(lengths, width=8):
    n = len(lengths)
    mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).long()
    return DataProto.from_dict({"ids": torch.arange(n), "attention_mask": mask},
                               {"uid": np.array([f"u{i}" for i in range(n)], dtype=object)})


@pytest.fixture(scope="module")
def ray_rows(ray_cluster):
    pool = RayResourcePool([2], num_cpus_per_process=0.25, name_prefix="rows")
    wg = RayWorkerGroup(pool, ClassWithInitArgs(Rows), default_timeout=60)
    yield wg
    wg.shutdown()
    pool.shutdown()


@pytest.fixture(params=["ray", "local"])
def group(request):
    wg = request.getfixturevalue("ray_rows") if request.param == "ray" else LocalWorkerGroup(ClassWithInitArgs(Rows), 2)
    wg.balance_dp = True
    return wg


def test_balanced_split_by_hand_and_results_in_the_callers_order(group):
    """Tokens 6, 5, 1, 2: the plain split gives rank 0 rows 0-1 (11 tokens) and rank 1 rows 2-3 (3).
    Karmarkar-Karp sorts them (2, 3, 1, 0), pairs (2, 3) and (1, 0), and merges the heaviest of one
    with the lightest of the other: {3, 1} = 7 and {2, 0} = 7, rank 0 taking rows 1 and 3."""
    out = group.tag(rows([6, 5, 1, 2]))
    assert out.batch["out"].tolist() == [0, 10, 20, 30]
    assert out.non_tensor_batch["uid"].tolist() == ["u0", "u1", "u2", "u3"]
    assert out.batch["rank"].tolist() == [1, 0, 1, 0]
    assert group.last_balance == {"tokens_max_before": 11, "tokens_min_before": 3,
                                  "tokens_max_after": 7, "tokens_min_after": 7}
    per_rank = group.tokens(rows([6, 5, 1, 2]))  # the update's mode: the ranks see the balanced shards
    assert per_rank == [{"rank": 0, "ids": [1, 3], "tokens": 7}, {"rank": 1, "ids": [0, 2], "tokens": 7}]

    plain = group.tag.options(balance=False)(rows([6, 5, 1, 2]))
    assert plain.batch["out"].tolist() == [0, 10, 20, 30] and plain.batch["rank"].tolist() == [0, 0, 1, 1]
    assert group.last_balance == {"tokens_max_before": 11, "tokens_min_before": 3,
                                  "tokens_max_after": 11, "tokens_min_after": 3}  # the imbalance, still measured


def test_several_outputs_per_row_and_several_arguments_follow_the_order(group):
    out = group.twice(rows([6, 5, 1, 2]))
    assert out.batch["ids"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert out.batch["rank"].tolist() == [1, 1, 0, 0, 1, 1, 0, 0]
    a, b = rows([6, 5, 1, 2]), rows([1, 1, 1, 1])
    b.batch["ids"] = torch.tensor([100, 200, 300, 400])
    assert group.add(a, b=b).batch["sum"].tolist() == [100, 201, 302, 403]  # b split by a's order
    with pytest.raises(ValueError, match="2 rows, but the call's first DataProto argument has 4"):
        group.add(a, rows([1, 1]))


def test_padding_rows_are_balanced_too_and_dropped(group):
    """Tokens 6, 6, 5, 1, 1 padded to 6 rows with a copy of row 0 (6): plain halves 17 | 8.
    Sorted (3, 4, 2, 0, 1, 5); pairs (3, 4) spread 0, (2, 0) spread 1, (1, 5) spread 0. The most
    spread pair (2, 0) merges with the next, (3, 4): {0, 4} = 7, {2, 3} = 6; then with (1, 5):
    {0, 4, 5} = 13 on rank 0, {1, 2, 3} = 12 on rank 1."""
    out = group.tag.options(pad=True)(rows([6, 6, 5, 1, 1]))
    assert out.batch["out"].tolist() == [0, 10, 20, 30, 40]
    assert out.batch["rank"].tolist() == [0, 1, 1, 1, 0]
    assert group.last_balance == {"tokens_max_before": 17, "tokens_min_before": 8,
                                  "tokens_max_after": 13, "tokens_min_after": 12}


def test_group_switch_and_call_option(group):
    group.balance_dp = False
    try:
        assert group.tag(rows([6, 5, 1, 2])).batch["rank"].tolist() == [0, 0, 1, 1]
        assert group.tag.options(balance=True)(rows([6, 5, 1, 2])).batch["rank"].tolist() == [1, 0, 1, 0]
    finally:
        group.balance_dp = True
    data = rows([6, 5, 1, 2])
    data.batch["out"] = data.batch["ids"]
    assert group.plain(data).batch["rank"].tolist() == [0, 0, 1, 1]  # not registered balance=True
    assert group.plain.options(balance=True)(data).batch["rank"].tolist() == [1, 0, 1, 0]
    with pytest.raises(ValueError, match="weighs rows by their attention_mask"):
        group.tag(DataProto.from_dict({"ids": torch.arange(4)}, {"uid": np.array(list("abcd"), dtype=object)}))


def test_future_of_a_balanced_call_reaches_the_next_call_in_order(group):
    """On Ray an unbalanced consumer would read the producer's per-rank results straight from the
    object store; after a balanced split those are in another row order, so they go through the driver."""
    future = group.tag.options(blocking=False)(rows([6, 5, 1, 2]))
    out = group.plain(future)
    assert out.batch["out"].tolist() == [1, 11, 21, 31]
    balanced_consumer = group.tag(group.echo.options(blocking=False)(rows([6, 5, 1, 2])))  # reads the future's rows
    assert balanced_consumer.batch["out"].tolist() == [0, 10, 20, 30]
    assert balanced_consumer.batch["rank"].tolist() == [1, 0, 1, 0]


def test_a_row_of_several_sequences_weighs_all_their_tokens():
    """Pair rows (B, 2, T): a row's weight is both sequences' tokens, here 6, 5, 1, 2 as above."""
    group = LocalWorkerGroup(ClassWithInitArgs(Rows), 2)
    lengths = torch.tensor([[4, 2], [3, 2], [1, 0], [1, 1]])
    mask = (torch.arange(8) < lengths[..., None]).long()
    data = DataProto.from_dict({"ids": torch.arange(4), "attention_mask": mask},
                               {"uid": np.array(list("abcd"), dtype=object)})
    assert group.tag(data).batch["rank"].tolist() == [1, 0, 1, 0]
    assert group.last_balance["tokens_max_before"] == 11 and group.last_balance["tokens_max_after"] == 7


def test_a_prompts_samples_stay_on_one_rank(group):
    """Rows of uids a, b, a, b, c, c, d, d (two samples each) with tokens 6, 1, 5, 1, 2, 2, 3, 3: the
    groups weigh a 11, b 2, c 4, d 6; balanced as groups, {a, b} = 13 and {c, d} = 10, every prompt's
    samples on one rank (so a packed forward holds each prompt once); row by row it would be 12 | 11
    with a's samples apart."""
    data = rows([6, 1, 5, 1, 2, 2, 3, 3])
    data.non_tensor_batch["uid"] = np.array(list("ababccdd"), dtype=object)
    ranks = group.tag(data).batch["rank"].tolist()
    by_uid = {}
    for uid, rank in zip("ababccdd", ranks):
        by_uid.setdefault(uid, set()).add(rank)
    assert all(len(r) == 1 for r in by_uid.values()) and by_uid["a"] == by_uid["b"] != by_uid["c"] == by_uid["d"]
    assert group.last_balance["tokens_max_after"] == 13 and group.last_balance["tokens_min_after"] == 10
    # groups of unequal size, or too few to divide: rows as before
    data.non_tensor_batch["uid"] = np.array(list("aaabbbcd"), dtype=object)
    group.tag(data)
    assert group.last_balance["tokens_max_after"] - group.last_balance["tokens_min_after"] <= 1
