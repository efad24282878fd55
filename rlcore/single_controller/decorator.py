"""`@register`: how a worker method's arguments are split across ranks and its results gathered.

A dispatch mode is a pair of plain functions:

    dispatch_fn(ctx, args, kwargs) -> list of (args, kwargs), one entry per rank that runs
    collect_fn(ctx, outputs)       -> the value the driver gets back

``ctx`` (a ``CallContext``) carries the group's world size, the call options (``pad``,
``balance``) and a scratch dict the two functions share (e.g. how many padding rows to drop). The
built-in modes below are such pairs; users register their own with
``register(dispatch_mode=DispatchMode(...))``. A plain dict ``{"dispatch_fn": f, "collect_fn": g}``
is verl's convention instead, ``f(worker_group, *args, **kwargs) -> (args, kwargs)`` and
``g(worker_group, outputs)``, and is adapted to a DispatchMode (``verl_dispatch_mode``): the type
tells the two apart, a dict is always verl's.

Balanced DP split. The DP modes hand rank r the r-th contiguous chunk of a batch. For a method
registered with ``balance=True`` (its rows are independent and cost about their token count: a
forward or an update over them), the group first reorders the rows so each chunk holds about the
same number of tokens (``attention_mask`` ones; Karmarkar-Karp, ``balance``), and the collect
puts the results back in the caller's row order, so the caller never sees the reordering. Without
it a rank that got the long responses sets the pace while the others wait at FSDP's collectives.
Rows that share a ``uid`` (a prompt's samples) move as one where the groups allow it
(``_balanced_order``): a packed forward holds their prompt once only if they share a rank.
"""

from __future__ import annotations

import enum
import functools
import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from rlcore.protocol import DataProto
from rlcore.single_controller.balance import balanced_permutation, chunk_loads

REGISTER_ATTR = "_rlcore_register"


# verl's Dispatch / Execute names that rlcore does not have, and what to write instead.
_NOT_HERE = {
    **dict.fromkeys(
        ["MEGATRON_COMPUTE", "MEGATRON_PP_AS_DP", "MEGATRON_PP_ONLY", "MEGATRON_COMPUTE_PROTO", "MEGATRON_PP_AS_DP_PROTO"],
        "for workers whose ranks form (data-parallel x tensor/pipeline-parallel) groups use "
        "register(dispatch_mode=mesh_dispatch(\"actor\")) and self.register_mesh(\"actor\", dp_rank, dp_size, is_collect) "
        "in the worker",
    ),
    "DIRECT_ROLLOUT_METHOD": "call the rollout's methods through its own worker group (Dispatch.ONE_TO_ALL or a DP mode)",
}


class _ModeNames(enum.EnumMeta):
    """Makes ``Dispatch.MEGATRON_COMPUTE`` (a verl name rlcore has not) fail saying what to write instead."""

    def __getattr__(cls, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in _NOT_HERE:
                raise AttributeError(f"{cls.__name__}.{name} is a verl mode rlcore does not have: {_NOT_HERE[name]}") from None
            raise


class Dispatch(enum.Enum, metaclass=_ModeNames):
    ONE_TO_ALL = "one_to_all"  # same arguments to every rank; list of results
    ALL_TO_ALL = "all_to_all"  # every argument is a list with one entry per rank; list of results
    RANK_ZERO = "rank_zero"  # only rank 0 runs; its result
    DP_COMPUTE = "dp_compute"  # like ALL_TO_ALL, for data-parallel shards the caller already split
    DP_COMPUTE_PROTO = "dp_compute_proto"  # split DataProto args by rank; concat the DataProto results
    DP_COMPUTE_PROTO_WITH_FUNC = "dp_compute_proto_with_func"  # first arg (a function) to all ranks, rest as above
    DP_COMPUTE_METRIC = "dp_compute_metric"  # split DataProto args by rank; list of per-rank results (metrics)
    COLLECTIVE_RANK_ZERO = "collective_rank_zero"  # every rank runs (e.g. a gather collective); rank 0's result


class Execute(enum.Enum, metaclass=_ModeNames):
    ALL = "all"
    RANK_ZERO = "rank_zero"


@dataclass
class CallContext:
    """What a dispatch/collect pair knows about one call."""

    world_size: int
    group: Any
    role: str = "default"
    pad: bool = False  # pad a batch that does not divide the DP size (and drop the padding afterwards)
    balance: bool = False  # reorder rows so every rank gets about as many tokens (results come back in order)
    scratch: dict = field(default_factory=dict)


@dataclass(frozen=True)
class DispatchMode:
    dispatch_fn: Callable[[CallContext, tuple, dict], list[tuple[tuple, dict]]]
    collect_fn: Callable[[CallContext, list], Any]
    name: str = "custom"


class Deferred(ABC):
    """A pending result of another group's call (``GroupFuture`` is the one implementation) as the
    dispatch functions see it. Declared here, where it is consumed, so that this module needs
    nothing from the group module that implements it."""

    @property
    @abstractmethod
    def single_result_ref(self) -> Any:
        """An object ref every rank can read (a pending rank-0 result), or None."""

    @abstractmethod
    def get(self) -> Any:
        """Wait for the result and collect it."""

    @abstractmethod
    def split_for(self, ctx: "CallContext", world_size: int, what: str) -> list:
        """Per-rank parts of the DataProto result, for a consumer call of ``world_size`` ranks."""


# ------------------------------------------------------------------ built-in dispatch / collect
def _one_to_all(ctx: CallContext, args: tuple, kwargs: dict) -> list[tuple[tuple, dict]]:
    args = tuple(_broadcastable(ctx, a) for a in args)
    kwargs = {k: _broadcastable(ctx, v) for k, v in kwargs.items()}
    return [(args, kwargs)] * ctx.world_size


def _broadcastable(ctx: CallContext, value: Any) -> Any:
    """A future of another group's RANK_ZERO result reaches every rank straight from Ray's object store."""
    if not isinstance(value, Deferred):
        return value
    if value.single_result_ref is not None and ctx.group.passes_object_refs:
        return value.single_result_ref
    return value.get()


def _per_rank_lists(ctx: CallContext, args: tuple, kwargs: dict) -> list[tuple[tuple, dict]]:
    def check(name, value):
        if not isinstance(value, (list, tuple)) or len(value) != ctx.world_size:
            got = f"a {type(value).__name__} of length {len(value)}" if isinstance(value, (list, tuple)) else type(value).__name__
            raise ValueError(f"argument {name} must be a list with one entry per rank ({ctx.world_size}), got {got}")
        return value

    args = [check(f"#{i}", a) for i, a in enumerate(args)]
    kwargs = {k: check(repr(k), v) for k, v in kwargs.items()}
    return [(tuple(a[r] for a in args), {k: v[r] for k, v in kwargs.items()}) for r in range(ctx.world_size)]


def _rank_zero(ctx: CallContext, args: tuple, kwargs: dict) -> list[tuple[tuple, dict]]:
    return [(args, kwargs)]


def _collect_list(ctx: CallContext, outputs: list) -> list:
    return list(outputs)


def _collect_first(ctx: CallContext, outputs: list) -> Any:
    return outputs[0]


_collect_first.returns_rank_zero = True  # a future of it can be broadcast as one object ref


def split_for_ranks(ctx: CallContext, value: Any, world_size: int, what: str) -> list:
    """Split one DataProto (or a future of one) into ``world_size`` parts, padding if allowed, and
    balanced by token count with ``ctx.balance``."""
    if isinstance(value, Deferred):
        if not ctx.balance:
            return value.split_for(ctx, world_size, what)
        value = value.get()  # the balanced split needs the rows' token counts here
    if not isinstance(value, DataProto):
        return [value] * world_size
    if len(value) % world_size:
        if not (ctx.pad or value.is_padding_enabled()):  # verl's spelling: DataProtoConfig.auto_padding
            raise ValueError(
                f"{what}: batch of {len(value)} rows does not divide across {world_size} ranks; "
                f"use a batch size divisible by {world_size} or call with .options(pad=True) "
                "(verl's spelling: DataProtoConfig.auto_padding = True, or DataProto.from_dict(..., auto_padding=True))"
            )
        value, pad = value.pad_to_divisor(world_size)
        ctx.scratch["chunk_rows"] = len(value) // world_size
        previous = ctx.scratch.get("pad_size")
        if previous not in (None, pad):
            raise ValueError(f"{what}: DataProto arguments need different padding ({previous} vs {pad})")
        ctx.scratch["pad_size"] = pad
    order = _split_order(ctx, value, world_size, what)
    return (value if order is None else value[order]).chunk(world_size)


def _split_order(ctx: CallContext, value: DataProto, world_size: int, what: str) -> np.ndarray | None:
    """The row order whose contiguous chunks the ranks get: balanced by token count with
    ``ctx.balance``, else None (as given). The first DataProto argument of a call decides it and
    every other one follows, so rows stay aligned across arguments. Also records in
    ``ctx.scratch["balance"]`` the per-rank token counts of the plain and of the used split."""
    if "order" in ctx.scratch:
        order = ctx.scratch["order"]
        if order is not None and len(order) != len(value):
            raise ValueError(f"{what}: {len(value)} rows, but the call's first DataProto argument has {len(order)}: "
                             "a balanced split needs every DataProto argument to have the same rows")
        return order
    mask = None if value.batch is None or world_size == 1 else value.batch.get("attention_mask", None)
    if mask is None or len(value) == 0:
        if ctx.balance and world_size > 1:
            raise ValueError(f"{what}: a balanced split weighs rows by their attention_mask, which this batch has "
                             "not; call with .options(balance=False)")
        ctx.scratch["order"] = None
        return None
    tokens = mask.reshape(len(value), -1).sum(-1).tolist()  # a row may hold several sequences (pairs)
    order = _balanced_order(value, tokens, world_size) if ctx.balance else None
    ctx.scratch["order"] = order
    before, after = chunk_loads(tokens, world_size), chunk_loads(tokens, world_size, order)
    ctx.scratch["balance"] = {"tokens_max_before": max(before), "tokens_min_before": min(before),
                              "tokens_max_after": max(after), "tokens_min_after": min(after)}
    return order


def _balanced_order(value: DataProto, tokens: list[int], world_size: int) -> np.ndarray:
    """Rows balanced by token count over the ranks, keeping the rows of one ``uid`` (a prompt's
    samples) on one rank where every uid has as many rows and the uids divide evenly: a trained
    role then packs each prompt once per rank (``model.pack_shared_prompts``). Else row by row."""
    uids = value.non_tensor_batch.get("uid") if value.non_tensor_batch else None
    if uids is not None:
        _, group, sizes = np.unique(np.asarray(uids).astype(str), return_inverse=True, return_counts=True)
        if len(sizes) % world_size == 0 and sizes.min() == sizes.max() > 1:
            members = np.argsort(group, kind="stable").reshape(len(sizes), -1)  # row g: uid g's rows
            weights = np.asarray(tokens)[members].sum(1).tolist()
            return members[balanced_permutation(weights, world_size)].reshape(-1)
    return np.asarray(balanced_permutation(tokens, world_size))


def _dp_proto(ctx: CallContext, args: tuple, kwargs: dict) -> list[tuple[tuple, dict]]:
    ws = ctx.world_size
    split_args = [split_for_ranks(ctx, a, ws, f"argument #{i}") for i, a in enumerate(args)]
    split_kwargs = {k: split_for_ranks(ctx, v, ws, f"argument {k!r}") for k, v in kwargs.items()}
    return [(tuple(a[r] for a in split_args), {k: v[r] for k, v in split_kwargs.items()}) for r in range(ws)]


def _dp_proto_with_func(ctx: CallContext, args: tuple, kwargs: dict) -> list[tuple[tuple, dict]]:
    if not args or not callable(args[0]):
        raise TypeError("DP_COMPUTE_PROTO_WITH_FUNC expects a function as the first argument")
    fn, rest = args[0], args[1:]
    return [((fn, *a), kw) for a, kw in _dp_proto(ctx, rest, kwargs)]


def collect_dp_proto(ctx: CallContext, outputs: list) -> Any:
    """Concatenate per-rank DataProtos, put the rows back in the caller's order (after a balanced
    split) and drop the padding rows the dispatch added."""
    if not all(isinstance(o, DataProto) for o in outputs):
        kinds = sorted({type(o).__name__ for o in outputs})
        raise TypeError(f"a DP_COMPUTE_PROTO method must return a DataProto on every rank, got {kinds}")
    out = DataProto.concat(outputs, meta_conflicts="first")  # per-rank values (timings): rank 0's
    order = ctx.scratch.get("order")
    if order is not None:
        # k outputs per input row (adjacent) travel together: input row order[j] gave rows j*k .. j*k+k-1
        per_row, rest = divmod(len(out), len(order))
        if rest or not per_row:
            raise ValueError(f"a balanced call returned {len(out)} rows for {len(order)} input rows: it must return "
                             "the same number of rows for each; call it with .options(balance=False)")
        inverse = np.argsort(order)
        out = out[(inverse[:, None] * per_row + np.arange(per_row)).ravel()]
    pad = ctx.scratch.get("pad_size", 0)
    if pad:
        # A method may return k rows per input row (e.g. n samples per prompt, adjacent): the
        # padding rows sit at the end of the batch, so their k outputs do too.
        rows_per_input = max(1, len(outputs[-1]) // ctx.scratch["chunk_rows"])
        out = out.unpad(pad * rows_per_input)
    return out


collect_dp_proto.concatenates_chunks = True  # results are rank-ordered chunks of one batch

_BUILTIN: dict[Dispatch, DispatchMode] = {
    Dispatch.ONE_TO_ALL: DispatchMode(_one_to_all, _collect_list, "one_to_all"),
    Dispatch.ALL_TO_ALL: DispatchMode(_per_rank_lists, _collect_list, "all_to_all"),
    Dispatch.RANK_ZERO: DispatchMode(_rank_zero, _collect_first, "rank_zero"),
    Dispatch.DP_COMPUTE: DispatchMode(_per_rank_lists, _collect_list, "dp_compute"),
    Dispatch.DP_COMPUTE_PROTO: DispatchMode(_dp_proto, collect_dp_proto, "dp_compute_proto"),
    Dispatch.DP_COMPUTE_PROTO_WITH_FUNC: DispatchMode(_dp_proto_with_func, collect_dp_proto, "dp_compute_proto_with_func"),
    Dispatch.DP_COMPUTE_METRIC: DispatchMode(_dp_proto, _collect_list, "dp_compute_metric"),
    Dispatch.COLLECTIVE_RANK_ZERO: DispatchMode(_one_to_all, _collect_first, "collective_rank_zero"),
}


def resolve_dispatch_mode(mode: Dispatch | DispatchMode | dict, materialize_futures: bool = True) -> DispatchMode:
    """The DispatchMode a ``register(dispatch_mode=...)`` argument names.

    The two conventions are told apart by type, never by guessing: a ``DispatchMode`` holds
    rlcore's functions ``(ctx, args, kwargs)``; a dict ``{"dispatch_fn", "collect_fn"}`` always
    holds verl's ``dispatch_fn(worker_group, *args, **kwargs) -> (args, kwargs)`` and
    ``collect_fn(worker_group, outputs)`` (see ``verl_dispatch_mode``)."""
    if isinstance(mode, DispatchMode):
        return mode
    if isinstance(mode, Dispatch):
        return _BUILTIN[mode]
    if isinstance(mode, dict) and {"dispatch_fn", "collect_fn"} <= mode.keys():
        return verl_dispatch_mode(mode["dispatch_fn"], mode["collect_fn"], mode.get("name"), materialize_futures)
    raise TypeError(f"dispatch_mode must be a Dispatch, a DispatchMode or a dict with dispatch_fn/collect_fn, got {mode!r}")


# ------------------------------------------------------------------ verl's dict dispatch modes
def verl_dispatch_mode(dispatch_fn: Callable, collect_fn: Callable, name: str | None = None,
                       materialize_futures: bool = True) -> DispatchMode:
    """A dispatch/collect pair written to verl's convention, as a DispatchMode.

    ``dispatch_fn(worker_group, *args, **kwargs)`` returns ``(args, kwargs)``; as in verl, when every
    one of those arguments is a list with one entry per rank, rank r gets entry r, and otherwise
    every rank gets all of them unchanged. It may also return one argument per rank, as verl's
    tutorial writes it (``return data.chunk(worker_group.world_size)``): rank r gets entry r. ``collect_fn(worker_group, outputs)`` gets the list of
    per-rank results. With ``materialize_futures`` (verl's default) a ``GroupFuture`` argument is
    waited for before ``dispatch_fn`` sees it."""
    for role, fn in (("dispatch_fn", dispatch_fn), ("collect_fn", collect_fn)):
        if not callable(fn):
            raise TypeError(f"{role} of a dict dispatch mode must be callable, got {fn!r}")
    if _takes_rlcore_arguments(dispatch_fn):
        raise TypeError(
            f"{dispatch_fn.__name__}(ctx, args, kwargs) is written to rlcore's convention, but a dict dispatch mode holds "
            "verl's dispatch_fn(worker_group, *args, **kwargs) -> (args, kwargs); wrap rlcore's functions in "
            "DispatchMode(dispatch_fn, collect_fn) instead"
        )
    label = name or f"verl:{getattr(dispatch_fn, '__name__', 'dispatch')}"

    def dispatch(ctx: CallContext, args: tuple, kwargs: dict) -> list[tuple[tuple, dict]]:
        if materialize_futures:
            args = tuple(a.get() if isinstance(a, Deferred) else a for a in args)
            kwargs = {k: v.get() if isinstance(v, Deferred) else v for k, v in kwargs.items()}
        result = dispatch_fn(ctx.group, *args, **kwargs)
        if isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[0], (tuple, list)) \
                and isinstance(result[1], dict):
            return per_rank_calls(ctx.world_size, tuple(result[0]), dict(result[1]))
        if isinstance(result, (tuple, list)) and len(result) == ctx.world_size:
            # verl's tutorial writes `return data.chunk(worker_group.world_size)`: one argument per rank
            return [((part,), {}) for part in result]
        raise TypeError(
            f"{label}: a dict dispatch_fn must return (args, kwargs), a tuple of per-rank argument lists and a dict, "
            f"or one argument per rank ({ctx.world_size}), got {type(result).__name__}"
            f"{f' of {len(result)}' if isinstance(result, (tuple, list)) else ''}; to hand rank r the r-th chunk "
            "of one argument write `return (data.chunk(worker_group.world_size),), {}`"
        )

    def collect(ctx: CallContext, outputs: list) -> Any:
        return collect_fn(ctx.group, outputs)

    return DispatchMode(dispatch, collect, label)


def per_rank_calls(world_size: int, args: tuple, kwargs: dict) -> list[tuple[tuple, dict]]:
    """verl's rule for a dispatched call: split when every argument is a per-rank list, else broadcast."""
    values = [*args, *kwargs.values()]
    if all(isinstance(v, list) and len(v) == world_size for v in values):
        return [(tuple(a[r] for a in args), {k: v[r] for k, v in kwargs.items()}) for r in range(world_size)]
    return [(args, kwargs)] * world_size


def _takes_rlcore_arguments(fn: Callable) -> bool:
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    return names == ["ctx", "args", "kwargs"]


# ------------------------------------------------------------------ mesh-aware DP dispatch
def mesh_dispatch(mesh_name: str) -> DispatchMode:
    """DP dispatch for workers whose ranks form (data-parallel x model-parallel) groups.

    Each worker declares its place with ``self.register_mesh(mesh_name, dp_rank, dp_size, is_collect)``
    (typically in ``init_model``). The batch is split into ``dp_size`` chunks; every rank receives the
    chunk of its DP rank (so tensor-parallel peers see the same data), and the output is gathered
    only from the ranks marked ``is_collect`` (one per DP group), in DP-rank order.
    """

    def dispatch(ctx: CallContext, args: tuple, kwargs: dict) -> list[tuple[tuple, dict]]:
        info = ctx.group.mesh_info(mesh_name, ctx.role)
        dp_size = info["dp_size"]
        split_args = [split_for_ranks(ctx, a, dp_size, f"argument #{i}") for i, a in enumerate(args)]
        split_kwargs = {k: split_for_ranks(ctx, v, dp_size, f"argument {k!r}") for k, v in kwargs.items()}
        out = []
        for dp_rank in info["dp_ranks"]:
            out.append((tuple(a[dp_rank] for a in split_args), {k: v[dp_rank] for k, v in split_kwargs.items()}))
        return out

    def collect(ctx: CallContext, outputs: list) -> Any:
        info = ctx.group.mesh_info(mesh_name, ctx.role)
        picked = sorted(
            (dp_rank, out) for dp_rank, keep, out in zip(info["dp_ranks"], info["is_collect"], outputs) if keep
        )
        return collect_dp_proto(ctx, [out for _, out in picked])

    return DispatchMode(dispatch, collect, f"mesh:{mesh_name}")


# ------------------------------------------------------------------ the decorator
def register(
    dispatch_mode: Dispatch | DispatchMode | dict = Dispatch.ALL_TO_ALL,
    execute_mode: Execute = Execute.ALL,
    blocking: bool = True,
    pad: bool = False,
    balance: bool = False,
    materialize_futures: bool = True,
) -> Callable:
    """Mark a worker method as callable on the whole group.

    dispatch_mode: how arguments are split and results gathered (see ``Dispatch``).
    execute_mode: ``Execute.ALL`` runs every rank; ``Execute.RANK_ZERO`` only rank 0.
    blocking: False makes the group call return a ``GroupFuture`` at once.
    pad: default for DP modes when the batch does not divide the DP size (False: a clear error).
    balance: DP modes may reorder the rows so every rank gets about as many ``attention_mask``
        tokens (the results come back in the caller's order). Declare it where rows are independent
        and cost their token count; the group's ``balance_dp`` (``trainer.balance_batch``) and
        ``.options(balance=...)`` switch it off.
    materialize_futures: for a verl dict mode, wait for ``GroupFuture`` arguments before its
        ``dispatch_fn`` runs (verl's default); rlcore's own modes pass futures on as they see fit.
    """
    mode = resolve_dispatch_mode(dispatch_mode, materialize_futures)
    if not isinstance(execute_mode, Execute):
        raise TypeError(f"execute_mode must be an Execute, got {execute_mode!r}")

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            return fn(*args, **kwargs)

        setattr(inner, REGISTER_ATTR, {"mode": mode, "execute": execute_mode, "blocking": blocking, "pad": pad,
                                      "balance": balance})
        return inner

    return decorate
