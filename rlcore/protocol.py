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
import os
import pickle
import reprlib
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from tensordict import TensorDict

__all__ = ["DataProto", "DataProtoConfig", "DataProtoError", "DataProtoItem", "deserialize_single_tensor",
           "deserialize_tensordict", "fold_batch_dim", "pad_dataproto_to_divisor", "serialize_single_tensor",
           "serialize_tensordict", "unfold_batch_dim", "union_numpy_dict", "union_tensor_dict", "unpad_dataproto"]


class DataProtoError(ValueError, AssertionError):
    """A DataProto operation refused: parts of different lengths, a conflicting key, a batch that
    does not chunk. A ValueError, and an AssertionError too because verl asserts in these places:
    ``except AssertionError`` written for verl still catches it."""


AUTO_PADDING_KEY = "_verl_auto_padding"  # meta_info flag of one DataProto (verl's key, so it round-trips)


class _AutoPaddingSwitch(type):
    @property
    def auto_padding(cls) -> bool:
        return cls._auto_padding or os.environ.get("VERL_AUTO_PADDING", "").upper() in ("1", "TRUE")

    @auto_padding.setter
    def auto_padding(cls, enabled: bool) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"DataProtoConfig.auto_padding must be a bool, got {enabled!r}")
        cls._auto_padding = enabled


class DataProtoConfig(metaclass=_AutoPaddingSwitch):
    """verl's process-wide switch: ``DataProtoConfig.auto_padding = True`` (or ``VERL_AUTO_PADDING=1``)
    lets a DP-dispatched call take a batch that does not divide the group's ranks: the rows are
    padded on the way in and the padding dropped from the result. One DataProto asks for it alone
    with ``DataProto.from_dict(..., auto_padding=True)``; rlcore's own spelling is
    ``group.method.options(pad=True)(data)``."""

    auto_padding_key = AUTO_PADDING_KEY
    _auto_padding = False

# numpy has no bfloat16: such tensors travel as int16 bit patterns and are viewed back on arrival.
_BITCAST_DTYPES = {torch.bfloat16: torch.int16}


def _as_numpy_array(name: str, value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, (list, tuple)):
        out = np.empty(len(value), dtype=object)
        out[:] = list(value) if not isinstance(value, list) else value
        return out
    raise TypeError(f"non_tensor_batch[{name!r}] must be a numpy array or a list, got {type(value).__name__}")


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
class DataProto:
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

    @classmethod
    def from_single_dict(cls, data: dict[str, Any], meta_info: dict | None = None,
                         auto_padding: bool = False) -> "DataProto":
        """Split one dict into tensors and non-tensors by value type."""
        tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        non_tensors = {k: v for k, v in data.items() if not isinstance(v, torch.Tensor)}
        return cls.from_dict(tensors, non_tensors, meta_info, auto_padding=auto_padding)

    @classmethod
    def from_tensordict(cls, tensor_dict: TensorDict, meta_info: dict | None = None,
                        num_batch_dims: int = 1) -> "DataProto":
        """The inverse of ``to_tensordict``: tensors become ``batch``, a ``NonTensorStack`` (one value
        per row) a ``non_tensor_batch`` column, a ``NonTensorData`` (one value) a ``meta_info`` entry."""
        from tensordict import NonTensorData, NonTensorStack

        _one_batch_dim("DataProto.from_tensordict", num_batch_dims)
        meta, tensors, non_tensors = dict(meta_info or {}), {}, {}
        for key, value in tensor_dict.items():
            if isinstance(value, NonTensorStack):
                non_tensors[key] = _as_numpy_array(key, value.tolist())
            elif isinstance(value, NonTensorData):
                meta[key] = value.data
            elif isinstance(value, torch.Tensor):
                tensors[key] = value
            else:
                raise DataProtoError(f"from_tensordict: {key!r} holds a {type(value).__name__}; a DataProto's batch "
                                     "has flat tensor keys (nested TensorDicts have no place in it)")
        batch = None
        if tensors:
            n = tensor_dict.batch_size[0] if tensor_dict.batch_dims else next(iter(tensors.values())).shape[0]
            batch = TensorDict(tensors, batch_size=[n], device=tensor_dict.device)
        return cls(batch=batch, non_tensor_batch=non_tensors, meta_info=meta)

    def to_tensordict(self) -> TensorDict:
        """One TensorDict of ``len(self)`` rows: the tensors as they are, each non-tensor column as a
        ``NonTensorStack`` of its rows' values (lists and dicts kept whole), each meta_info entry as a
        ``NonTensorData``. ``DataProto.from_tensordict`` gives the DataProto back."""
        from tensordict import NonTensorData, NonTensorStack

        tensor_keys = set() if self.batch is None else set(self.batch.keys())
        for part, keys in (("non_tensor_batch", set(self.non_tensor_batch)), ("meta_info", set(self.meta_info))):
            clash = sorted(tensor_keys & keys)
            tensor_keys |= keys
            if clash:
                raise DataProtoError(f"to_tensordict: {part} keys {clash} are also keys of another part; "
                                     "one TensorDict has one value per key")
        device = None if self.batch is None else self.batch.device
        out = TensorDict({} if self.batch is None else dict(self.batch.items()), batch_size=[len(self)], device=device)
        for key, column in self.non_tensor_batch.items():
            out[key] = NonTensorStack.from_list([NonTensorData(value) for value in column])
        for key, value in self.meta_info.items():
            out[key] = NonTensorData(value)
        return out

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

    def select_idxs(self, idxs: Sequence[int] | np.ndarray | torch.Tensor) -> "DataProto":
        """The rows at ``idxs`` (integer indices or a boolean mask): ``data[idxs]``."""
        if isinstance(idxs, (int, np.integer, slice)):
            raise TypeError(f"select_idxs takes a list, array or tensor of indices, got {type(idxs).__name__}")
        return self[idxs]

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> "DataProto":
        """``data[start:end:step]``, a DataProto (views, not copies)."""
        return self[start:end:step]

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

    def rename(self, old_keys: str | Sequence[str] | None = None, new_keys: str | Sequence[str] | None = None) -> "DataProto":
        """Rename ``batch`` keys in place (``old_keys[i]`` becomes ``new_keys[i]``); returns self."""
        old = [old_keys] if isinstance(old_keys, str) else list(old_keys or ())
        new = [new_keys] if isinstance(new_keys, str) else list(new_keys or ())
        if len(old) != len(new):
            raise DataProtoError(f"rename: {len(old)} old keys but {len(new)} new keys")
        self._require(old, [] if self.batch is None else self.batch.keys(), "batch")
        if not old:
            return self
        mapping = dict(zip(old, new))
        renamed = [mapping.get(k, k) for k in self.batch.keys()]
        if len(set(renamed)) != len(renamed):
            raise DataProtoError(f"rename {mapping} would give two tensors one key: {renamed}")
        self.batch = TensorDict(dict(zip(renamed, self.batch.values())), batch_size=self.batch.batch_size,
                                device=self.batch.device)
        return self

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

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """``torch.cat(list_of_dataprotos)`` is ``DataProto.concat`` with a group collect's rule for
        meta_info (the first part's value): verl's tutorial collects a dispatched call's outputs so."""
        if func is torch.cat and not kwargs and len(args) == 1:
            return cls.concat(list(args[0]), meta_conflicts="first")
        return NotImplemented

    def reorder(self, indices: torch.Tensor | np.ndarray | Sequence[int]) -> None:
        """Put the rows in the order ``indices`` gives, in place (verl's semantics: returns None).
        ``data.reorder(idx)`` leaves ``data`` equal to ``data[idx]``."""
        index = np.asarray(indices.detach().cpu() if isinstance(indices, torch.Tensor) else indices)
        index = index.astype(np.int64) if index.size == 0 else index
        if index.ndim != 1 or not np.issubdtype(index.dtype, np.integer):
            raise ValueError(f"reorder needs a 1-d sequence of integer row indices, got {index.dtype} of shape {index.shape}")
        if len(index) and (index.min() < -len(self) or index.max() >= len(self)):
            raise IndexError(f"reorder: indices must lie in [0, {len(self)}), got {index.min()}..{index.max()}")
        taken = self[index]
        self.batch, self.non_tensor_batch = taken.batch, taken.non_tensor_batch

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> "DataProto":
        """Repeat every row: interleave gives a a b b (samples of one prompt adjacent), else a b a b."""
        n = len(self)
        if interleave:
            index = np.repeat(np.arange(n), repeat_times)
        else:
            index = np.tile(np.arange(n), repeat_times)
        return self[index]

    def unfold_column_chunks(self, n_split: int, split_keys: Sequence[str] | None = None) -> "DataProto":
        """Every row becomes ``n_split`` rows. A key in ``split_keys`` (B, C, ...) is cut along its
        second dimension into ``n_split`` pieces (B * n_split, C // n_split, ...), row i's pieces
        adjacent; every other key is repeated ``n_split`` times, copies adjacent, to stay aligned.
        A non-tensor column of one list per row (what from_dict makes of a list of lists) is split
        as the (B, C) array verl's from_dict would have made of it; its lists must have one length."""
        if not isinstance(n_split, (int, np.integer)) or n_split < 1:
            raise DataProtoError(f"unfold_column_chunks: n_split must be a positive int, got {n_split!r}")
        split = list(split_keys or ())
        tensor_keys = [] if self.batch is None else list(self.batch.keys())
        self._require(split, [*tensor_keys, *self.non_tensor_batch], "batch or non_tensor_batch")

        def cut(part: str, key: str, value):
            if part == "non_tensor_batch" and value.ndim == 1:
                value = _rows_as_2d(key, value)
            if value.ndim < 2 or value.shape[1] % n_split:
                raise DataProtoError(f"unfold_column_chunks: {part}[{key!r}] of shape {tuple(value.shape)} has no second "
                                     f"dimension divisible by {n_split}")
            return value.reshape(value.shape[0] * n_split, value.shape[1] // n_split, *value.shape[2:])

        batch = None
        if self.batch is not None:
            tensors = {k: cut("batch", k, v) if k in split else v.repeat_interleave(n_split, dim=0)
                       for k, v in self.batch.items()}
            batch = TensorDict(tensors, batch_size=[len(self) * n_split], device=self.batch.device)
        non_tensors = {k: cut("non_tensor_batch", k, v) if k in split else np.repeat(v, n_split, axis=0)
                       for k, v in self.non_tensor_batch.items()}
        return type(self)(batch=batch, non_tensor_batch=non_tensors, meta_info=dict(self.meta_info))

    def sample_level_repeat(self, repeat_times: Sequence[int] | np.ndarray | torch.Tensor) -> "DataProto":
        """Repeat row i ``repeat_times[i]`` times, copies adjacent (a a a b c c for [3, 1, 2]); a count
        of 0 drops the row. The per-row form of ``repeat(n, interleave=True)``."""
        counts = np.asarray(repeat_times.detach().cpu() if isinstance(repeat_times, torch.Tensor) else list(repeat_times))
        if counts.ndim != 1 or len(counts) != len(self):
            raise DataProtoError(f"sample_level_repeat needs one count per row ({len(self)}), got shape {counts.shape}")
        counts = counts.astype(np.int64) if counts.size == 0 else counts
        if len(counts) and (not np.issubdtype(counts.dtype, np.integer) or counts.min() < 0):
            raise DataProtoError(f"sample_level_repeat counts must be non-negative integers, got {counts.tolist()}")
        return self[np.repeat(np.arange(len(self)), counts.astype(np.int64))]

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

    def is_padding_enabled(self) -> bool:
        """Whether a DP dispatch may pad this batch: ``from_dict(..., auto_padding=True)`` or
        ``DataProtoConfig.auto_padding``."""
        return bool(self.meta_info.get(AUTO_PADDING_KEY, False)) or DataProtoConfig.auto_padding

    def padding(self, padding_size: int, padding_candidate: str = "") -> None:
        """Append ``padding_size`` copies of the last row (``padding_candidate="first"``: the first),
        in place, as verl's ``padding`` does."""
        if padding_candidate not in ("", "last", "first"):
            raise ValueError(f"padding_candidate must be 'first' or 'last', got {padding_candidate!r}")
        if padding_size < 0:
            raise DataProtoError(f"padding_size must be >= 0, got {padding_size}")
        if padding_size == 0:
            return
        if len(self) == 0:
            raise DataProtoError("cannot pad an empty DataProto")
        row = 0 if padding_candidate == "first" else len(self) - 1
        padded = self[np.concatenate([np.arange(len(self)), np.full(padding_size, row)])]
        self.batch, self.non_tensor_batch = padded.batch, padded.non_tensor_batch

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


def _same(a: Any, b: Any, _pairs: set | None = None) -> bool:
    """Whether two values are equal, as union and concat compare them: tensors and arrays by shape
    and elements, NaN equal to NaN (a missing score in both is no conflict), object arrays, lists,
    tuples and dicts element by element; a structure that contains itself is compared once."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
            return False
        if torch.equal(a, b):
            return True
        if not (a.is_floating_point() or a.is_complex()) or not (b.is_floating_point() or b.is_complex()):
            return False
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype != object and b.dtype != object:
        if a.shape != b.shape:
            return False
        nan_aware = a.dtype.kind in "fc" and b.dtype.kind in "fc"
        return bool(np.array_equal(a, b, equal_nan=nan_aware))
    containers = (np.ndarray, list, tuple, dict)
    if isinstance(a, containers) or isinstance(b, containers):
        if isinstance(a, np.ndarray) != isinstance(b, np.ndarray) or isinstance(a, dict) != isinstance(b, dict):
            return False
        pair = (id(a), id(b))
        _pairs = set() if _pairs is None else _pairs
        if pair in _pairs:
            return True  # already being compared further up: a cycle
        _pairs.add(pair)
        try:
            if isinstance(a, dict):
                return a.keys() == b.keys() and all(_same(a[k], b[k], _pairs) for k in a)
            if isinstance(a, np.ndarray):
                return a.shape == b.shape and all(_same(x, y, _pairs) for x, y in zip(a.flat, b.flat))
            if not isinstance(b, (list, tuple)) or len(a) != len(b):
                return False
            return all(_same(x, y, _pairs) for x, y in zip(a, b))
        finally:
            _pairs.discard(pair)
    if isinstance(a, (float, np.floating)) and isinstance(b, (float, np.floating)) and a != a and b != b:
        return True  # NaN and NaN
    try:
        return bool(a == b)
    except Exception:  # an ambiguous or failing comparison is no equality
        return False


def _rows_as_2d(key: str, column: np.ndarray) -> np.ndarray:
    """A 1-d column of equal-length sequences as a (rows, length) object array."""
    lengths = {len(r) if isinstance(r, (list, tuple, np.ndarray)) else -1 for r in column}
    if len(lengths) != 1 or -1 in lengths:
        raise DataProtoError(f"non_tensor_batch[{key!r}] needs one sequence of one length per row to be split, got "
                             f"lengths {sorted(lengths)} (-1: not a sequence)")
    flat = np.empty(sum(len(r) for r in column), dtype=object)
    flat[:] = [x for r in column for x in r]
    return flat.reshape(len(column), -1)


def _one_batch_dim(where: str, num_batch_dims: int) -> None:
    if num_batch_dims != 1:
        raise DataProtoError(
            f"{where}(num_batch_dims={num_batch_dims}): a DataProto has exactly one batch dimension (verl's refuses "
            "more too, when it checks consistency); to group rows, fold them with fold_batch_dim(data, new_batch_size)")


def union_tensor_dict(tensor_dict1: TensorDict, tensor_dict2: TensorDict) -> TensorDict:
    """Add ``tensor_dict2``'s keys to ``tensor_dict1`` (in place, also returned); a key in both must
    hold equal tensors, and the batch sizes must agree."""
    if tensor_dict1.batch_size != tensor_dict2.batch_size:
        raise DataProtoError(f"union_tensor_dict: batch sizes {tuple(tensor_dict1.batch_size)} and "
                             f"{tuple(tensor_dict2.batch_size)} differ")
    for key, value in tensor_dict2.items():
        if key not in tensor_dict1.keys():
            tensor_dict1[key] = value
        elif not _same(tensor_dict1[key], value):
            raise DataProtoError(f"union_tensor_dict: {key} in tensor_dict1 and tensor_dict2 are not the same object "
                                 "(their values differ)")
    return tensor_dict1


def union_numpy_dict(tensor_dict1: dict[str, np.ndarray], tensor_dict2: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Add ``tensor_dict2``'s arrays to ``tensor_dict1`` (in place, also returned); a key in both must
    hold equal arrays (NaN equal to NaN, object arrays compared element by element)."""
    for key, value in tensor_dict2.items():
        if key in tensor_dict1:
            if not isinstance(value, np.ndarray) or not isinstance(tensor_dict1[key], np.ndarray):
                raise DataProtoError(f"union_numpy_dict: `{key}` must be a numpy array in both dicts, got "
                                     f"{type(tensor_dict1[key]).__name__} and {type(value).__name__}")
            if not _same(tensor_dict1[key], value):
                raise DataProtoError(f"union_numpy_dict: `{key}` in tensor_dict1 and tensor_dict2 are not the same "
                                     "object. (their values differ)")
        tensor_dict1[key] = value
    return tensor_dict1


def serialize_single_tensor(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], np.ndarray]:
    """``(dtype name, shape, bytes)``: the tensor's bytes as a flat uint8 numpy array (of any dtype,
    bfloat16 and float8 included), which pickle and Ray move out-of-band."""
    t = tensor.detach().cpu().contiguous()
    return str(t.dtype).removeprefix("torch."), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy()


def deserialize_single_tensor(encoded: tuple[str, Sequence[int], Any]) -> torch.Tensor:
    """The tensor ``serialize_single_tensor`` encoded, in memory of its own."""
    dtype_name, shape, data = encoded
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise DataProtoError(f"deserialize_single_tensor: {dtype_name!r} is not a torch dtype")
    raw = np.array(data, dtype=np.uint8, copy=True).reshape(-1) if isinstance(data, np.ndarray) else \
        np.frombuffer(bytearray(data), dtype=np.uint8)
    if raw.size == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.from_numpy(raw).view(dtype).reshape(tuple(shape))


def serialize_tensordict(batch: TensorDict) -> tuple[tuple[int, ...], str | None, dict[str, tuple]]:
    """``(batch_size, device, {key: encoded})``: each tensor as ``serialize_single_tensor`` encodes
    it, a nested tensor as ``(layout, [its components, encoded])``."""
    items: dict[str, tuple] = {}
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor):
            raise DataProtoError(f"serialize_tensordict: {key!r} holds a {type(value).__name__}, not a tensor")
        if value.is_nested:
            items[key] = (str(value.layout).removeprefix("torch."), [serialize_single_tensor(c) for c in value.unbind()])
        else:
            items[key] = serialize_single_tensor(value)
    return tuple(batch.batch_size), None if batch.device is None else str(batch.device), items


def deserialize_tensordict(encoded: tuple) -> TensorDict:
    """The TensorDict ``serialize_tensordict`` encoded."""
    batch_size, device, items = encoded
    tensors: dict[str, torch.Tensor] = {}
    for key, value in items.items():
        if len(value) == 3:
            tensors[key] = deserialize_single_tensor(value)
        elif len(value) == 2:
            layout, parts = value
            tensors[key] = torch.nested.as_nested_tensor([deserialize_single_tensor(p) for p in parts],
                                                         layout=getattr(torch, layout))
        else:
            raise DataProtoError(f"deserialize_tensordict: {key!r} is encoded as {len(value)} fields; "
                                 "a tensor has 3 (dtype, shape, bytes), a nested tensor 2 (layout, parts)")
    return TensorDict(tensors, batch_size=batch_size, device=device)


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """verl's name (and keyword) for ``data.pad_to_divisor(size_divisor)``: (padded, pad_size)."""
    return data.pad_to_divisor(size_divisor)


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    return data.unpad(pad_size)


def fold_batch_dim(data: DataProto, new_batch_size: int) -> DataProto:
    """Rows (B, ...) as ``new_batch_size`` groups of B // new_batch_size consecutive rows: every tensor
    becomes (new_batch_size, B // new_batch_size, ...), every non-tensor array likewise. ``data`` is
    left as it was (verl's version also reshapes its non_tensor_batch in place)."""
    n = len(data)
    if new_batch_size <= 0 or n % new_batch_size:
        raise DataProtoError(f"fold_batch_dim: {n} rows do not fold into {new_batch_size} equal groups")
    group = n // new_batch_size
    batch = None
    if data.batch is not None:
        folded = {k: v.reshape(new_batch_size, group, *v.shape[1:]) for k, v in data.batch.items()}
        batch = TensorDict(folded, batch_size=[new_batch_size], device=data.batch.device)
    non_tensors = {k: v.reshape(new_batch_size, group, *v.shape[1:]) for k, v in data.non_tensor_batch.items()}
    return type(data)(batch=batch, non_tensor_batch=non_tensors, meta_info=dict(data.meta_info))


def unfold_batch_dim(data: DataProto, batch_dims: int = 2) -> DataProto:
    """The inverse of ``fold_batch_dim``: the first ``batch_dims`` dimensions of every tensor and
    non-tensor array become one batch dimension; they must agree across all keys."""
    if batch_dims < 1:
        raise DataProtoError(f"unfold_batch_dim: batch_dims must be >= 1, got {batch_dims}")
    parts = [*(("batch", k, tuple(v.shape)) for k, v in (data.batch.items() if data.batch is not None else ())),
             *(("non_tensor_batch", k, v.shape) for k, v in data.non_tensor_batch.items())]
    leading = {shape[:batch_dims] for _, _, shape in parts}
    if len(leading) > 1 or any(len(shape) < batch_dims for _, _, shape in parts):
        listed = ", ".join(f"{part}[{k!r}] {shape}" for part, k, shape in parts)
        raise DataProtoError(f"unfold_batch_dim: the first {batch_dims} dimensions must agree across keys, got {listed}")
    rows = int(np.prod(leading.pop())) if leading else 0
    batch = None
    if data.batch is not None:
        flat = {k: v.reshape(rows, *v.shape[batch_dims:]) for k, v in data.batch.items()}
        batch = TensorDict(flat, batch_size=[rows], device=data.batch.device)
    non_tensors = {k: v.reshape(rows, *v.shape[batch_dims:]) for k, v in data.non_tensor_batch.items()}
    return type(data)(batch=batch, non_tensor_batch=non_tensors, meta_info=dict(data.meta_info))


METRICS_KEY = "metrics"


def _merge_metrics(parts: list) -> dict[str, list]:
    """meta_info["metrics"] of concatenated parts as one dict of lists, as verl merges the metrics each
    worker reports: a part holds a dict (one entry per key) or a list of such dicts (several), or
    None / nothing. {"loss": 1} and {"loss": 2} merge to {"loss": [1, 2]}."""
    records = []
    for i, part in enumerate(parts):
        if part is None:
            continue
        if isinstance(part, dict):
            part = [part]
        if not isinstance(part, (list, tuple)) or not all(isinstance(r, dict) for r in part):
            raise TypeError(f'meta_info["metrics"] of part {i} must be a dict or a list of dicts, got {type(part).__name__}')
        records.extend(part)
    merged: dict[str, list] = {}
    for record in records:
        for key, value in record.items():
            merged.setdefault(key, []).append(value)
    return merged


# verl names rlcore.protocol has not, and what to use instead (refused by name, not a bare ImportError).
_NOT_HERE = {
    "DataProtoFuture": "a non-blocking group call (register(..., blocking=False), or group.method.options("
                       "blocking=False)(data)) returns a rlcore.single_controller.GroupFuture: pass it to another "
                       "group's call, or .get() the DataProto",
    "all_gather_data_proto": "gather inside a worker with torch.distributed.all_gather_object, or let a DP "
                             "collect (Dispatch.DP_COMPUTE_PROTO) concatenate the ranks' DataProtos on the driver",
}


def __getattr__(name: str):
    if name in _NOT_HERE:
        raise ImportError(f"rlcore.protocol has no {name} (a verl name): {_NOT_HERE[name]}")
    raise AttributeError(f"module 'rlcore.protocol' has no attribute {name!r}")
