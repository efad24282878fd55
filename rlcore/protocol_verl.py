"""The lower half of ``rlcore.protocol``: verl's DataProto vocabulary and the value helpers both halves share.

``rlcore.protocol`` keeps DataProto's own operations (build, index, select, union, chunk, concat,
repeat, pad, transport); what is here exists so that code written against verl's ``verl.protocol``
runs as written: ``VerlMethods`` (the DataProto methods only verl's spelling needs: reorder,
sample_level_repeat, unfold_column_chunks, padding, select_idxs, slice, rename, the TensorDict
round trip, ``torch.cat`` of DataProtos), verl's module functions (``union_tensor_dict``,
``union_numpy_dict``, ``(de)serialize_tensordict``, ``pad_dataproto_to_divisor``, ``fold_batch_dim``
...), ``DataProtoConfig.auto_padding``, and the error type that is an ``AssertionError`` because verl
asserts. It sits below ``rlcore.protocol`` (which imports from here, never the reverse), so it knows
DataProto only through ``self`` and ``type(data)``. Import the names from ``rlcore.protocol``.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

# "DataProto" in the annotations below is rlcore.protocol.DataProto, which cannot be imported here
# (rlcore.protocol imports this module); annotations are never evaluated (``from __future__``).


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


def _as_numpy_array(name: str, value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, (list, tuple)):
        out = np.empty(len(value), dtype=object)
        out[:] = list(value) if not isinstance(value, list) else value
        return out
    raise TypeError(f"non_tensor_batch[{name!r}] must be a numpy array or a list, got {type(value).__name__}")


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


class VerlMethods:
    """DataProto's methods in verl's spelling (DataProto derives from this); each works through what
    DataProto defines on ``self`` (indexing, ``from_dict``, the constructor, ``_require``)."""

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

    def select_idxs(self, idxs: Sequence[int] | np.ndarray | torch.Tensor) -> "DataProto":
        """The rows at ``idxs`` (integer indices or a boolean mask): ``data[idxs]``."""
        if isinstance(idxs, (int, np.integer, slice)):
            raise TypeError(f"select_idxs takes a list, array or tensor of indices, got {type(idxs).__name__}")
        return self[idxs]

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> "DataProto":
        """``data[start:end:step]``, a DataProto (views, not copies)."""
        return self[start:end:step]

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
