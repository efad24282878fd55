"""The engine side of a weight sync: named tensors packed into fixed-size buckets and back.

Why buckets: a 7B policy is 14 GB in bf16; gathering it whole on one rank, or shipping it as one
object, doubles the peak memory of both ends. Streaming it as buckets of ``bucket_bytes`` (a few
hundred MiB) bounds the extra memory of a sync to one bucket per engine, and lets the sender gather
the next bucket while the engine loads the last one.

A ``WeightBucket`` is one flat ``uint8`` buffer plus, per tensor, its name, dtype, shape and byte
offset; tensors keep their own dtype (an fp32 router stays fp32). ``pack_buckets`` packs an
iterator of ``(name, tensor)`` lazily, one bucket at a time; ``WeightBucket.tensors()`` gives
views into the buffer (no copy) for the engine's loader. A bucket never splits a decoder layer
(``model.layers.<i>.*`` stay together): vLLM fuses q/k/v and gate/up into one parameter and
processes a layer once all of its weights are in, so half a layer per load would leave the other
half undefined. A layer (or tensor) larger than a bucket travels in a bucket of its own.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

DEFAULT_BUCKET_BYTES = 256 * 2**20


@dataclass
class WeightBucket:
    """Packed tensors: ``buffer`` (uint8, 1-D) and one ``(name, dtype, shape, offset)`` entry per tensor."""

    buffer: torch.Tensor
    entries: list[tuple[str, torch.dtype, tuple[int, ...], int]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return int(self.buffer.numel())

    def names(self) -> list[str]:
        return [name for name, *_ in self.entries]

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` views into the buffer, in packing order (no copy)."""
        out = []
        for name, dtype, shape, offset in self.entries:
            count = int(np.prod(shape, dtype=np.int64)) if shape else 1
            nbytes = count * torch.empty((), dtype=dtype).element_size()
            out.append((name, self.buffer[offset:offset + nbytes].view(dtype).view(shape)))
        return out

    def __reduce__(self):
        # Through Ray / pickle the buffer travels as one numpy array (zero-copy in Ray's object store).
        return _unpickle_bucket, (self.buffer.numpy(), [(n, str(d).removeprefix("torch."), s, o)
                                                        for n, d, s, o in self.entries])


def _unpickle_bucket(buffer: np.ndarray, entries: list) -> WeightBucket:
    with warnings.catch_warnings():  # Ray hands the buffer over read-only (zero-copy); loaders only read it
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.from_numpy(buffer)
    return WeightBucket(tensor, [(n, getattr(torch, d), tuple(s), o) for n, d, s, o in entries])


_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


def layer_of(name: str) -> str:
    """The unit a bucket keeps whole: the decoder layer a parameter belongs to, else the parameter."""
    match = _LAYER.match(name)
    return match.group(1) if match else name


def pack_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]],
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[WeightBucket]:
    """Yield buckets of at most ``bucket_bytes`` (unless one layer is larger), packing lazily: a
    bucket is built only when the iterator asks for it, so the sender holds one bucket at a time.
    Tensors of one layer must come one after another (as a state dict lists them)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    pending: list[tuple[str, torch.Tensor]] = []  # whole layers, ready to pack
    layer: list[tuple[str, torch.Tensor]] = []  # the layer being read
    layer_key, size, layer_size = None, 0, 0
    for name, tensor in named_tensors:
        key = layer_of(name)
        if layer and key != layer_key:
            if pending and size + layer_size > bucket_bytes:
                yield _pack(pending, size)
                pending, size = [], 0
            pending, size, layer, layer_size = pending + layer, size + layer_size, [], 0
        layer_key = key
        layer.append((name, tensor))
        layer_size += _aligned(tensor.numel() * tensor.element_size())
    if pending and size + layer_size > bucket_bytes:
        yield _pack(pending, size)
        pending, size = [], 0
    if pending or layer:
        yield _pack(pending + layer, size + layer_size)


def _aligned(nbytes: int, alignment: int = 8) -> int:
    """Offsets stay 8-byte aligned, so every dtype's view of the buffer is valid."""
    return (nbytes + alignment - 1) // alignment * alignment


def _pack(named: list[tuple[str, torch.Tensor]], size: int) -> WeightBucket:
    buffer = torch.empty(size, dtype=torch.uint8)
    entries, offset = [], 0
    for name, tensor in named:
        flat = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
        buffer[offset:offset + flat.numel()].copy_(flat)
        entries.append((name, tensor.dtype, tuple(tensor.shape), offset))
        offset += _aligned(flat.numel())
    return WeightBucket(buffer, entries)
