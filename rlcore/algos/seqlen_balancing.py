"""Balancing work by sequence length: across data-parallel ranks and into micro-batches.

Compute per row grows with its token count, and RL batches are skewed (some responses stop early,
some run to the limit). A DP dispatch that hands rank r the r-th contiguous chunk can give one rank
most of the long rows while the others wait at the gradient all-reduce. Reordering the batch first
so each chunk holds about the same number of tokens removes that wait.

Partitioning uses the Karmarkar-Karp largest differencing method generalised to k groups: keep a
pool of partial solutions (k groups each); repeatedly take the two with the largest spread
(max group sum - min group sum) and merge them by adding the heaviest group of one to the
lightest group of the other, and so on down the line. Merging the most unbalanced pair first lets
their differences cancel. For equal-size groups, each starting partial solution is a run of k
consecutive items in sorted order, one per group, so every group gains exactly one item per merge.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

# A partial solution: k groups as (token sum, indices), kept sorted by sum, heaviest first.
_Partial = list[tuple[int, list[int]]]


def _spread(partial: _Partial) -> int:
    return partial[0][0] - partial[-1][0]


def _merge(a: _Partial, b: _Partial) -> _Partial:
    # a is sorted heaviest first, so reversing b pairs a's heaviest group with b's lightest.
    merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))]
    return sorted(merged, key=lambda g: g[0], reverse=True)


def balance_partitions(seq_lens: Sequence[int], k: int,
                       equal_size: bool = True) -> list[list[int]]:
    """Split indices 0..n-1 into k groups with near-equal sums of `seq_lens`.

    With `equal_size`, n must be a multiple of k and every group gets n/k items. Each group's
    indices are sorted ascending; groups come out heaviest first.
    """
    n = len(seq_lens)
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    if n < k:
        raise ValueError(f"cannot split {n} items into {k} non-empty groups")
    if equal_size and n % k:
        raise ValueError(f"equal_size=True needs len(seq_lens) divisible by k; got {n} items, k={k}")
    if any(length < 0 for length in seq_lens):
        raise ValueError("seq_lens must be non-negative")

    order = sorted(range(n), key=lambda i: seq_lens[i])
    if equal_size:
        starts = [order[j:j + k] for j in range(0, n, k)]
    else:
        starts = [[i] for i in order]
    tie = itertools.count()  # equal spreads pop in insertion order: deterministic output
    heap = []
    for members in starts:
        partial = [(seq_lens[i], [i]) for i in members] + [(0, [])] * (k - len(members))
        partial.sort(key=lambda g: g[0], reverse=True)
        heapq.heappush(heap, (-_spread(partial), next(tie), partial))
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = _merge(a, b)
        heapq.heappush(heap, (-_spread(merged), next(tie), merged))
    return [sorted(indices) for _, indices in heap[0][2]]


def balanced_permutation(seq_lens: Sequence[int], k: int) -> list[int]:
    """An index order whose k equal contiguous chunks are the balanced groups.

    Apply it to a batch (`batch[perm]`) before a dispatch that splits into k equal chunks.
    """
    return [i for group in balance_partitions(seq_lens, k, equal_size=True) for i in group]


def rearrange_micro_batches(seq_lens: Sequence[int], max_token_len: int,
                            num_micro_batches: int | None = None) -> list[list[int]]:
    """Pack indices into micro-batches whose token sums stay within `max_token_len`.

    First-fit decreasing: place the longest remaining item in the first micro-batch with room,
    opening a new one when none has. It uses few micro-batches (at most 11/9 of the optimum plus
    one), which is what dynamic batching wants: fewer forward passes at a bounded memory peak.
    Each micro-batch's indices are sorted ascending.

    `num_micro_batches` asks for exactly that many (at least the packing's count, at most one per
    item): data-parallel ranks must run the same number of forward passes, since each is a round
    of FSDP collectives, so each rank packs its rows, they agree on the largest count, and a rank
    that packed fewer splits its heaviest micro-batches in two until it has as many; a split never
    exceeds the budget.
    """
    if max_token_len <= 0:
        raise ValueError(f"max_token_len must be positive, got {max_token_len}")
    too_long = [i for i, length in enumerate(seq_lens) if length > max_token_len]
    if too_long:
        i = too_long[0]
        raise ValueError(f"item {i} has {seq_lens[i]} tokens, more than max_token_len="
                         f"{max_token_len}: raise the budget to at least the longest sequence "
                         f"({max(seq_lens)})")
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(seq_lens)), key=lambda i: seq_lens[i], reverse=True):
        for b, load in enumerate(loads):
            if load + seq_lens[i] <= max_token_len:
                bins[b].append(i)
                loads[b] += seq_lens[i]
                break
        else:
            bins.append([i])
            loads.append(seq_lens[i])
    if num_micro_batches is not None:
        if not len(bins) <= num_micro_batches <= len(seq_lens):
            raise ValueError(f"num_micro_batches={num_micro_batches} must be between the {len(bins)} micro-batches "
                             f"the token budget needs and the {len(seq_lens)} items")
        while len(bins) < num_micro_batches:
            b = max((b for b in range(len(bins)) if len(bins[b]) > 1), key=lambda b: loads[b])
            members = sorted(bins[b], key=lambda i: seq_lens[i], reverse=True)
            bins[b], half = members[0::2], members[1::2]  # alternate: two halves of about equal tokens
            bins.append(half)
            loads[b] = sum(seq_lens[i] for i in bins[b])
            loads.append(sum(seq_lens[i] for i in half))
    return [sorted(b) for b in bins]
