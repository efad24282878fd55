"""Balancing data-parallel shards by token count: which rows each rank gets.

Compute per row grows with its token count, and RL batches are skewed (some responses stop early,
some run to the limit). A DP dispatch that hands rank r the r-th contiguous chunk can give one rank
most of the long rows while the others wait at the gradient all-reduce. Reordering the batch first
so each chunk holds about the same number of tokens removes that wait; the balanced dispatch
(``register(balance=True)`` in ``decorator``) does it and puts the results back in the caller's order.

Partitioning uses the Karmarkar-Karp largest differencing method generalised to k groups: keep a
pool of partial solutions (k groups each); repeatedly take the two with the largest spread
(max group sum - min group sum) and merge them by adding the heaviest group of one to the
lightest group of the other, and so on down the line. Merging the most unbalanced pair first lets
their differences cancel. For equal-size groups, each starting partial solution is a run of k
consecutive items in sorted order, one per group, so every group gains exactly one item per merge.

Pure Python on lists of ints, in this layer because the dispatch uses it; it knows nothing of RL.
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


def chunk_loads(seq_lens: Sequence[int], k: int, order: Sequence[int] | None = None) -> list[int]:
    """Token sums of the k equal contiguous chunks of ``order`` (the rows as given when None): what
    each of k ranks gets from a dispatch that splits the batch so ordered."""
    order = range(len(seq_lens)) if order is None else order
    size = len(order) // k
    return [sum(seq_lens[i] for i in order[r * size:(r + 1) * size]) for r in range(k)]
