"""A pack's rows layout written out by hand, for the tests of the attention that reads it
(test_rows_attention.py, test_shared_varlen.py)."""

import torch

from rlcore.workers.packing import RowLayout


def shared_layout() -> tuple[RowLayout, int]:
    """A prompt of 3 tokens (pack 0-2) held by a row with a response of 2 (3, 4), borrowed by a row
    with a response of 4 (5-8), then a row of 2 alone (9, 10): 11 tokens packed, 3 rows of 7
    positions (the prompt twice, index 11 the fill behind the shorter rows)."""
    n = 11
    rows = [[0, 1, 2, 3, 4], [0, 1, 2, 5, 6, 7, 8], [9, 10]]
    source = torch.full((3, 7), n)
    for r, ix in enumerate(rows):
        source[r, :len(ix)] = torch.tensor(ix)
    take = torch.tensor([0, 1, 2, 3, 4, 7 + 3, 7 + 4, 7 + 5, 7 + 6, 14, 15])
    return RowLayout(source=source.flatten(), take=take, rows=3, max_len=7), n
