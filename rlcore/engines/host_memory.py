"""Giving memory back to the machine between the phases of a step (glibc's heap, an idle KV cache).

A CPU run's tensors live in glibc's malloc. Memory freed after an update (the activations, the
gradients) goes back to malloc's free lists, not to the machine: glibc returns only what lies at
the top of a heap (``M_TRIM_THRESHOLD``), and its mmap threshold grows with every large block freed
(up to 32 MiB), so later tensors of that size land in the heap too. Measured on a two-step SmolLM2
GRPO run (docs/real_models.md, "Memory"), the heap kept ~0.8 GiB between steps, and the next
update, its blocks fragmented by the sampling in between, took fresh memory on top of it.
``trim_heap`` (``malloc_trim(0)``: every arena's free pages handed back with ``MADV_DONTNEED``,
the heap itself left as it is) is called where a phase has just freed a lot.

``release_pages``: the whole pages of a tensor whose contents no longer matter (a vLLM KV cache between
two generations: its blocks are zeroed when handed to a request, and the prefix cache that could
read old blocks is reset with it) handed back to the kernel; they read as zeros afterwards and are
faulted in again on the next write, as they were when the cache was allocated (``torch.zeros``).

``keep_large_blocks``: glibc serves blocks of every size from its heap and keeps what is freed there
(``mallopt``: no mmap, a 2 GiB trim threshold) instead of mapping each block over its mmap threshold
(at most 32 MiB: a SmolLM2 micro-batch's 96 MiB logits chunks, its 113 MB head and embedding gradients)
afresh and unmapping it when freed, so that the kernel zeroes and faults those pages in again at
every micro-batch: 2.0-2.2 million minor faults and ~4 s of system CPU in an fp32 update of 128 rows,
against 0.6 million and 1.2 s kept, and the update 28.1 -> 25.5 s at a lower peak (docs/benchmarks.md).
Within a phase the heap holds its high-water mark; ``trim_heap`` still hands the free pages back
between phases.

``trim_between_layers``: the same trim between the layers of an update's forward and backward. The forward
leaves its freed temporaries scattered between the activations it keeps, and the backward frees each
layer's activations while it makes the gradients and its own temporaries, which glibc mostly placed
in fresh pages rather than the freed, fragmented blocks: at SmolLM2 the heap held 0.4-0.6 GiB free
but resident at the forward's end and grew 0.35 GiB through a backward that freed 1.3
(docs/real_models.md, "Memory").

Linux with glibc only; elsewhere these do nothing and say so (``False``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys

import torch
from torch import nn

MADV_DONTNEED = 4  # linux/mman.h
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # malloc.h's mallopt parameters
KEPT_FREE_BYTES = (1 << 31) - 1  # free memory at the heap's top that free() leaves in place (trim_heap still takes it):
# mallopt's largest; at 1 GiB a SmolLM2 update that ended with more than that free at the top (sampling's
# blocks above it) gave it back, and the next update faulted 0.25-0.3 million pages in again
GLIBC_MMAP_MAX, GLIBC_TRIM_THRESHOLD = 65536, 128 * 1024  # glibc's defaults
_libc = None


def _glibc():
    """The C library if it is glibc on Linux (it has ``malloc_trim``), else None."""
    global _libc
    if _libc is None:
        _libc = False
        if sys.platform.startswith("linux"):
            try:
                lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
                lib.malloc_trim.argtypes = [ctypes.c_size_t]
                lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                lib.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
                _libc = lib
            except (OSError, AttributeError):
                pass
    return _libc or None


def trim_heap() -> bool:
    """Hand malloc's free pages back to the kernel (all arenas). True if glibc did so or had none to give."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def keep_large_blocks(on: bool = True) -> bool:
    """Large blocks from the heap, and freed memory kept there until ``trim_heap`` (this whole process, from
    now on); ``on=False``: glibc's defaults again (mmap over the threshold, trims at 128 KiB; the threshold
    itself no longer adapts). True if glibc took the settings; False off glibc."""
    libc = _glibc()
    if libc is None:
        return False
    mmap_max, trim = (0, KEPT_FREE_BYTES) if on else (GLIBC_MMAP_MAX, GLIBC_TRIM_THRESHOLD)
    return bool(libc.mallopt(M_MMAP_MAX, mmap_max)) and bool(libc.mallopt(M_TRIM_THRESHOLD, trim))


def release_pages(tensor: torch.Tensor) -> int:
    """Give back the whole pages of ``tensor``'s storage (a CPU tensor whose contents are no longer
    needed: they read as zeros afterwards). Returns the bytes released (0 where it cannot)."""
    libc = _glibc()
    if libc is None or tensor.device.type != "cpu":
        return 0
    storage = tensor.untyped_storage()
    start, size = storage.data_ptr(), storage.nbytes()
    page = mmap.PAGESIZE
    first = -(-start // page) * page  # whole pages inside the storage only: its neighbours keep theirs
    last = (start + size) // page * page
    if last <= first:
        return 0
    if libc.madvise(ctypes.c_void_p(first), last - first, MADV_DONTNEED) != 0:
        raise OSError(ctypes.get_errno(), f"madvise(MADV_DONTNEED) of {last - first} bytes failed")
    return last - first


TRIM_EVERY = 6  # layers between two trims: each trim costs the pages the next layers write again (below)


def trim_between_layers(layers: list[nn.Module], every: int = TRIM_EVERY) -> list:
    """``trim_heap`` after the forward of every ``every``-th of ``layers`` (a model's decoder layers) that records a
    graph (none under ``no_grad``), and again as the backward reaches it: a hook on the layer's
    output fires as that output's gradient is ready, just before the layer's own backward, once the
    layers above have freed what they kept. A checkpointed layer's recompute in the backward adds none
    (torch stops it once the saved tensors are back; its output would not be in the graph anyway).
    Every trim costs: the free pages it hands back that the next layers write again are faulted in
    again (~0.36 s of CPU per GiB here). Measured on an update of the SmolLM2 preset (4,848 tokens in
    two packs, ``benchmarks/update.py --release-memory 0,1``): a trim at every layer faulted in ~11
    GiB more an update (~4 s of CPU), every 6th layer 3.4 GiB more (~1.2 s, +1.6% of the update)
    for nearly the same peak (docs/real_models.md, "Memory"). Returns the hooks' handles; none off glibc."""
    if _glibc() is None:
        return []
    return [layer.register_forward_hook(_hook_output) for layer in layers[every - 1::every]]


def _hook_output(module: nn.Module, args, output) -> None:
    tensor = output[0] if isinstance(output, (tuple, list)) else output
    if torch.is_grad_enabled() and isinstance(tensor, torch.Tensor) and tensor.requires_grad:
        trim_heap()  # the layer's forward temporaries, freed between the activations it keeps
        tensor.register_hook(_trim_on_grad)


def _trim_on_grad(grad: torch.Tensor) -> None:
    trim_heap()
