"""Packing rows into micro-batches by token count (dynamic batch size).

Which rows each data-parallel rank gets is decided before, by the dispatch
(``rlcore.single_controller.balance``: Karmarkar-Karp over token counts); here a rank packs its own
rows into as few forward passes as a token budget allows.
"""

from __future__ import annotations

from collections.abc import Sequence


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
