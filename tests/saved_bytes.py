"""What autograd keeps for a backward, counted: the tests of the lighter backwards (fused layers, rows attention) use it."""

from __future__ import annotations

import torch


def saved_bytes(fn) -> int:
    """The bytes of the distinct storages autograd keeps for the backward of ``fn()``'s graph (each storage once)."""
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())
