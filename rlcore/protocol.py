"""DataProto: the one batch type that travels between the driver and every worker.

A DataProto holds three parts that always agree on length (the batch dimension):

- ``batch``: a ``tensordict.TensorDict`` with exactly one batch dimension (per-row tensors),
- ``non_tensor_batch``: a dict of numpy arrays (object dtype allowed) with one entry per row,
- ``meta_info``: a plain dict for batch-wide values (temperature, global token counts, ...).

Every operation (index, select, chunk, concat, repeat, pad) keeps the three in step; a length
mismatch is an error at once, naming the key and both lengths.

Crossing a process boundary is cheap on purpose: ``__getstate__`` hands tensors to pickle as numpy
arrays, which Ray's serializer moves through the object store out-of-band (zero-copy on the
receiving side), instead of pickling torch storages inline. A consequence worth knowing: tensors of
a DataProto received from another process may share Ray's read-only object-store buffer. Treat
inputs as read-only (clone before an in-place edit), which is what worker code does anyway.

Standard keys (rows are sequences; ``T_p`` prompt length, ``T_r`` response length)::

    key                 part       shape          meaning
    prompts             batch      (B, T_p)       left-padded prompt token ids
    responses           batch      (B, T_r)       right-padded generated token ids
    input_ids           batch      (B, T_p+T_r)   prompts ++ responses
    attention_mask      batch      (B, T_p+T_r)   1 for real tokens
    position_ids        batch      (B, T_p+T_r)   positions that skip left padding
    response_mask       batch      (B, T_r)       1 for tokens the policy generated (and is trained on)
    rollout_log_probs   batch      (B, T_r)       log-probs the sampler reported
    old_log_probs       batch      (B, T_r)       actor log-probs before the update
    ref_log_prob        batch      (B, T_r)       reference-policy log-probs
    values              batch      (B, T_r)       critic values
    token_level_scores  batch      (B, T_r)       reward (usually on the last response token)
    token_level_rewards batch      (B, T_r)       scores minus KL penalty
    advantages          batch      (B, T_r)       advantage estimates
    returns             batch      (B, T_r)       value targets
    uid                 non-tensor (B,)           prompt id shared by the n samples of a prompt
    raw_prompt          non-tensor (B,)           prompt text
    ground_truth        non-tensor (B,)           reference answer for rule rewards

Coming from verl: verl's DataProto operations are here with their meaning (index, select,
select_idxs, slice, pop, rename, union, chunk, split, concat, reorder, repeat, sample_level_repeat,
unfold_column_chunks, make_iterator, padding, to/from_tensordict, save/load_from_disk), and so are
verl's module functions ``union_tensor_dict``, ``union_numpy_dict``, ``serialize_tensordict`` /
``deserialize_tensordict`` (and the single-tensor pair), ``pad_dataproto_to_divisor``,
``fold_batch_dim`` / ``unfold_batch_dim`` and ``DataProtoConfig.auto_padding``; not
``DataProtoFuture`` (a group call's future is ``GroupFuture``) nor ``all_gather_data_proto``. Where verl asserts,
rlcore raises ``DataProtoError``: a ``ValueError`` that is also an ``AssertionError``, so code
written against verl's asserts catches it, and its message names the key and the sizes. Where rlcore
differs on purpose the error says so (``num_batch_dims`` other than 1, ``make_iterator``'s DataLoader
options). One difference is silent: a list of lists given as a non-tensor column is one list per row
(a 1-d object array), where verl's ``np.array(..., dtype=object)`` makes equal-length lists a 2-d
array and ragged ones a 1-d one; ``unfold_column_chunks`` splits such a column as verl's 2-d one.
"""

from __future__ import annotations

import copy
import pickle
import reprlib
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from tensordict import TensorDict

from rlcore.protocol_verl import (
    _NOT_HERE,
    AUTO_PADDING_KEY,
    METRICS_KEY,
    DataProtoConfig,
    DataProtoError,
    VerlMethods,
    _as_numpy_array,
    _merge_metrics,
    _one_batch_dim,
    _same,
    deserialize_single_tensor,
    deserialize_tensordict,
    fold_batch_dim,
    pad_dataproto_to_divisor,
    serialize_single_tensor,
    serialize_tensordict,
    unfold_batch_dim,
    union_numpy_dict,
    union_tensor_dict,
    unpad_dataproto,
)

__all__ = ["DataProto", "DataProtoConfig", "DataProtoError", "DataProtoItem", "deserialize_single_tensor",
           "deserialize_tensordict", "fold_batch_dim", "pad_dataproto_to_divisor", "serialize_single_tensor",
           "serialize_tensordict", "unfold_batch_dim", "union_numpy_dict", "union_tensor_dict", "unpad_dataproto"]


# numpy has no bfloat16: such tensors travel as int16 bit patterns and are viewed back on arrival.
_BITCAST_DTYPES = {torch.bfloat16: torch.int16}


def _tensor_to_wire(t: torch.Tensor) -> tuple[np.ndarray, str | None]:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype in _BITCAST_DTYPES:
        return t.view(_BITCAST_DTYPES[t.dtype]).numpy(), str(t.dtype).removeprefix("torch.")
    return t.numpy(), None


def _tensor_from_wire(arr: np.ndarray, dtype_name: str | None) -> torch.Tensor:
    with warnings.catch_warnings():
        # Arrays from Ray's object store are read-only; sharing them is the point (zero-copy).
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        t = torch.from_numpy(arr)
    return t.view(getattr(torch, dtype_name)) if dtype_name else t


@dataclass
class DataProtoItem:
    """One row of a DataProto (what ``data[i]`` returns)."""

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, Any] = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)


@dataclass
class DataProto(VerlMethods):
    batch: TensorDict | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        non_tensors = {} if self.non_tensor_batch is None else self.non_tensor_batch
        self.non_tensor_batch = {k: _as_numpy_array(k, v) for k, v in non_tensors.items()}
        self.meta_info = {} if self.meta_info is None else self.meta_info
        self.check_consistency()

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Any] | None = None,
        meta_info: dict | None = None,
        num_batch_dims: int = 1,
        auto_padding: bool = False,
    ) -> "DataProto":
        """Build from plain dicts; all tensors must share their first dimension. ``auto_padding``
        marks this batch for padding when a DP dispatch splits it (``DataProtoConfig``)."""
        _one_batch_dim("DataProto.from_dict", num_batch_dims)
        tensors = tensors or {}
        non_tensors = non_tensors or {}
        batch = None
        if tensors:
            sizes = {k: v.shape[0] for k, v in tensors.items()}
            first_key, n = next(iter(sizes.items()))
            for k, size in sizes.items():
                if size != n:
                    raise DataProtoError(
                        f"tensor {k!r} has {size} rows but {first_key!r} has {n}: every tensor needs the same batch size"
                    )
            batch = TensorDict(dict(tensors), batch_size=[n])
        meta = dict(meta_info or {})
        if auto_padding:
            meta[AUTO_PADDING_KEY] = True
        return cls(batch=batch, non_tensor_batch=dict(non_tensors), meta_info=meta)

    # ---------------------------------------------------------------- invariants
    def check_consistency(self) -> None:
        if self.batch is not None and len(self.batch.batch_size) != 1:
            raise DataProtoError(
                f"DataProto.batch must have exactly one batch dimension, got {tuple(self.batch.batch_size)}")
        n = None if self.batch is None else self.batch.batch_size[0]
        ref = "batch"
        for key, value in self.non_tensor_batch.items():
            if value.ndim == 0:
                raise DataProtoError(f"non_tensor_batch[{key!r}] is a 0-d array; it needs one entry per row")
            if n is None:
                n, ref = len(value), f"non_tensor_batch[{key!r}]"
            elif len(value) != n:
                raise DataProtoError(
                    f"length mismatch: non_tensor_batch[{key!r}] has {len(value)} rows but {ref} has {n}")

    def __len__(self) -> int:
        if self.batch is not None:
            return int(self.batch.batch_size[0])
        if self.non_tensor_batch:
            return len(next(iter(self.non_tensor_batch.values())))
        return 0

    # ---------------------------------------------------------------- indexing
    def __getitem__(self, item: int | slice | Sequence[int] | np.ndarray | torch.Tensor) -> "DataProto | DataProtoItem":
        if isinstance(item, (int, np.integer)):
            return DataProtoItem(
                batch=None if self.batch is None else self.batch[int(item)],
                non_tensor_batch={k: v[int(item)] for k, v in self.non_tensor_batch.items()},
                meta_info=self.meta_info,
            )
        if isinstance(item, slice):
            return self._take(item, item)
        if isinstance(item, (list, tuple)):
            item = np.asarray(item)
        if isinstance(item, torch.Tensor):
            item = item.cpu().numpy()
        if isinstance(item, np.ndarray):
            if item.dtype == bool:
                if len(item) != len(self):
                    raise IndexError(f"boolean mask has {len(item)} entries but the DataProto has {len(self)} rows")
                item = np.nonzero(item)[0]
            return self._take(torch.from_numpy(item.astype(np.int64)), item.astype(np.int64))
        raise TypeError(f"cannot index a DataProto with {type(item).__name__}")

    def _take(self, torch_index, numpy_index) -> "DataProto":
        batch = None if self.batch is None else self.batch[torch_index]
        non_tensors = {k: v[numpy_index] for k, v in self.non_tensor_batch.items()}
        return type(self)(batch=batch, non_tensor_batch=non_tensors, meta_info=dict(self.meta_info))

    def select(self, batch_keys=None, non_tensor_batch_keys=None, meta_info_keys=None, deepcopy: bool = False) -> "DataProto":
        """A DataProto with only the named keys (None keeps a part whole). Missing keys are an error."""
        batch = self.batch
        if batch is not None and batch_keys is not None:
            self._require(batch_keys, batch.keys(), "batch")
            batch = batch.select(*batch_keys)
        non_tensors = self.non_tensor_batch
        if non_tensor_batch_keys is not None:
            self._require(non_tensor_batch_keys, non_tensors.keys(), "non_tensor_batch")
            non_tensors = {k: non_tensors[k] for k in non_tensor_batch_keys}
        meta = self.meta_info
        if meta_info_keys is not None:
            self._require(meta_info_keys, meta.keys(), "meta_info")
            meta = {k: meta[k] for k in meta_info_keys}
        out = type(self)(batch=batch, non_tensor_batch=dict(non_tensors), meta_info=dict(meta))
        return copy.deepcopy(out) if deepcopy else out

    def pop(self, batch_keys=None, non_tensor_batch_keys=None, meta_info_keys=None) -> "DataProto":
        """Remove the named keys from this DataProto and return them as a new one."""
        batch_keys, non_tensor_batch_keys, meta_info_keys = (list(keys or ()) for keys in
                                                             (batch_keys, non_tensor_batch_keys, meta_info_keys))
        if batch_keys:
            self._require(batch_keys, [] if self.batch is None else self.batch.keys(), "batch")
        self._require(non_tensor_batch_keys, self.non_tensor_batch.keys(), "non_tensor_batch")
        self._require(meta_info_keys, self.meta_info.keys(), "meta_info")
        tensors = {k: self.batch.pop(k) for k in batch_keys}
        non_tensors = {k: self.non_tensor_batch.pop(k) for k in non_tensor_batch_keys}
        meta = {k: self.meta_info.pop(k) for k in meta_info_keys}
        return DataProto.from_dict(tensors, non_tensors, meta)

    @staticmethod
    def _require(keys, available, part: str) -> None:
        missing = [k for k in keys if k not in set(available)]
        if missing:
            raise KeyError(f"{part} has no key(s) {missing}; available: {sorted(available)}")

    def union(self, other: "DataProto") -> "DataProto":
        """Merge ``other`` into self (in place, also returned). A key present in both must hold equal values."""
        if len(self) and len(other) and len(self) != len(other):
            raise DataProtoError(f"cannot union DataProtos of {len(self)} and {len(other)} rows")
        if other.batch is not None:
            if self.batch is None:
                self.batch = other.batch
            else:
                for key, value in other.batch.items():
                    if key in self.batch.keys():
                        if not _same(self.batch[key], value):
                            raise DataProtoError(f"union conflict: batch[{key!r}] differs between the two DataProtos")
                    else:
                        self.batch[key] = value
        for key, value in other.non_tensor_batch.items():
            if key in self.non_tensor_batch and not _same(self.non_tensor_batch[key], value):
                raise DataProtoError(f"union conflict: non_tensor_batch[{key!r}] differs between the two DataProtos")
            self.non_tensor_batch[key] = value
        for key, value in other.meta_info.items():
            if key in self.meta_info and not _same(self.meta_info[key], value):
                raise DataProtoError(f"union conflict: meta_info[{key!r}] is {self.meta_info[key]!r} vs {value!r}")
            self.meta_info[key] = value
        self.check_consistency()
        return self

    # ---------------------------------------------------------------- split / merge
    def chunk(self, chunks: int) -> list["DataProto"]:
        """Split into ``chunks`` equal parts; the length must divide (see ``pad_to_divisor``)."""
        n = len(self)
        if chunks <= 0 or n % chunks:
            raise DataProtoError(
                f"cannot chunk a DataProto of {n} rows into {chunks} equal parts; "
                f"pad it first (pad_to_divisor, or padding) or choose a batch size divisible by {chunks}"
            )
        return self.split(n // chunks)

    def split(self, split_size: int) -> list["DataProto"]:
        """Consecutive parts of ``split_size`` rows (the last may be shorter). Tensors are views, not copies."""
        if split_size <= 0:
            raise DataProtoError(f"split_size must be positive, got {split_size}")
        return [self[i : i + split_size] for i in range(0, len(self), split_size)]

    @staticmethod
    def concat(data: Sequence["DataProto"], meta_conflicts: str = "raise") -> "DataProto":
        """Concatenate along the batch dimension. ``meta_info`` is the union of the parts': a key
        that two parts hold with different values is an error (verl's rule), or with
        ``meta_conflicts="first"`` keeps the first part's value (rlcore's collects of per-rank
        timings use this); ``meta_info["metrics"]`` is merged into one dict of lists."""
        if not data:
            raise DataProtoError("DataProto.concat needs at least one DataProto")
        if meta_conflicts not in ("raise", "first"):
            raise ValueError(f"meta_conflicts must be 'raise' or 'first', got {meta_conflicts!r}")
        batches = [d.batch for d in data]
        if any(b is None for b in batches) and not all(b is None for b in batches):
            raise DataProtoError("cannot concat DataProtos where some have tensors and some do not")
        batch = None if batches[0] is None else torch.cat(batches, dim=0)
        keys = data[0].non_tensor_batch.keys()
        for i, d in enumerate(data[1:], 1):
            if d.non_tensor_batch.keys() != keys:
                raise DataProtoError(
                    f"non_tensor_batch keys differ at part {i}: {sorted(d.non_tensor_batch)} vs {sorted(keys)}")
        non_tensors = {k: np.concatenate([d.non_tensor_batch[k] for d in data]) for k in keys}
        meta: dict = {}
        first_part: dict[str, int] = {}
        for i, d in enumerate(data):
            for key, value in d.meta_info.items():
                if key == METRICS_KEY:
                    continue
                if key not in meta:
                    meta[key], first_part[key] = value, i
                elif meta_conflicts == "raise" and not _same(meta[key], value):
                    raise DataProtoError(
                        f"Conflicting values for meta_info key {key!r} in DataProto.concat: {reprlib.repr(meta[key])} "
                        f"(part {first_part[key]}) vs {reprlib.repr(value)} (part {i}). Put per-part numbers under "
                        "meta_info['metrics'] (merged into lists), or pass meta_conflicts='first' to keep the first")
        if any(METRICS_KEY in d.meta_info for d in data):
            meta[METRICS_KEY] = _merge_metrics([d.meta_info.get(METRICS_KEY) for d in data])
        return type(data[0])(batch=batch, non_tensor_batch=non_tensors, meta_info=meta)

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> "DataProto":
        """Repeat every row: interleave gives a a b b (samples of one prompt adjacent), else a b a b."""
        n = len(self)
        if interleave:
            index = np.repeat(np.arange(n), repeat_times)
        else:
            index = np.tile(np.arange(n), repeat_times)
        return self[index]

    def make_iterator(self, mini_batch_size: int, epochs: int = 1, seed: int | None = None,
                      dataloader_kwargs: dict | None = None, shuffle: bool | None = None) -> Iterator["DataProto"]:
        """Yield mini-batches for ``epochs`` passes, in row order unless ``shuffle`` (then reshuffled
        every epoch from ``seed``). As in verl, ``dataloader_kwargs={"shuffle": True}`` shuffles too;
        it is no DataLoader, so its other keys are refused by name."""
        extra = sorted(set(dataloader_kwargs or {}) - {"shuffle"})
        if extra:
            raise TypeError(f"make_iterator: dataloader_kwargs {extra} are not supported (rlcore's iterator is no "
                            "torch DataLoader; it takes shuffle only)")
        if shuffle is None:
            shuffle = bool((dataloader_kwargs or {}).get("shuffle", False))
        n = len(self)
        if n % mini_batch_size:
            raise DataProtoError(f"{n} rows do not divide into mini-batches of {mini_batch_size}")
        return self._mini_batches(mini_batch_size, epochs, seed, shuffle)  # the checks above run at the call

    def _mini_batches(self, mini_batch_size: int, epochs: int, seed: int | None, shuffle: bool) -> Iterator["DataProto"]:
        n, generator = len(self), np.random.default_rng(seed)
        for _ in range(epochs):
            order = generator.permutation(n) if shuffle else np.arange(n)
            for start in range(0, n, mini_batch_size):
                yield self[order[start : start + mini_batch_size]]

    def pad_to_divisor(self, divisor: int) -> tuple["DataProto", int]:
        """Append copies of the first rows so the length divides ``divisor``; returns (padded, pad_size)."""
        pad = (-len(self)) % divisor
        if pad == 0:
            return self, 0
        if len(self) == 0:
            raise DataProtoError("cannot pad an empty DataProto")
        index = np.concatenate([np.arange(len(self)), np.arange(pad) % len(self)])
        return self[index], pad

    def unpad(self, pad_size: int) -> "DataProto":
        return self if pad_size == 0 else self[: len(self) - pad_size]

    # ---------------------------------------------------------------- devices and disk
    def to(self, device: str | torch.device) -> "DataProto":
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    def save_to_disk(self, path: str) -> None:
        with open(path, "wb") as f:
            pickle.dump(self, f, protocol=5)

    @staticmethod
    def load_from_disk(path: str) -> "DataProto":
        with open(path, "rb") as f:
            out = pickle.load(f)
        if not isinstance(out, DataProto):
            raise TypeError(f"{path} does not hold a DataProto (found {type(out).__name__})")
        return out

    # ---------------------------------------------------------------- transport
    def __getstate__(self) -> dict:
        tensors = None
        if self.batch is not None:
            tensors = {k: _tensor_to_wire(v) for k, v in self.batch.items()}
            device = str(self.batch.device) if self.batch.device is not None else None
        return {
            "n": len(self),
            "tensors": tensors,
            "device": device if tensors is not None else None,
            "non_tensor_batch": self.non_tensor_batch,
            "meta_info": self.meta_info,
        }

    def __setstate__(self, state: dict) -> None:
        self.batch = None
        if state["tensors"] is not None:
            tensors = {k: _tensor_from_wire(arr, dt) for k, (arr, dt) in state["tensors"].items()}
            self.batch = TensorDict(tensors, batch_size=[state["n"]])
            if state["device"] not in (None, "cpu"):
                self.batch = self.batch.to(state["device"]) if torch.cuda.is_available() else self.batch
        self.non_tensor_batch = state["non_tensor_batch"]
        self.meta_info = state["meta_info"]

    def __repr__(self) -> str:
        lines = [f"DataProto(rows={len(self)}"]
        if self.batch is not None:
            for k, v in self.batch.items():
                lines.append(f"  batch[{k!r}]: {tuple(v.shape)} {str(v.dtype).removeprefix('torch.')} on {v.device}")
        for k, v in self.non_tensor_batch.items():
            lines.append(f"  non_tensor_batch[{k!r}]: {v.shape} {v.dtype}")
        if self.meta_info:
            lines.append(f"  meta_info: {self.meta_info!r}")
        return "\n".join(lines) + ")"


def __getattr__(name: str):
    if name in _NOT_HERE:
        raise ImportError(f"rlcore.protocol has no {name} (a verl name): {_NOT_HERE[name]}")
    raise AttributeError(f"module 'rlcore.protocol' has no attribute {name!r}")
