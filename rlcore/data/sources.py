"""Prompt sources: prompts produced on the fly by code (a generator, a procedural task library, an
environment's dataset), not read from files up front, each bringing its own verifier as the reward.

``data.source`` names one:

- ``reasoning_gym:<task>``: a reasoning-gym procedural dataset (rlcore.data.reasoning_gym_source);
- ``verifiers:<environment id>``: a verifiers environment (rlcore.data.verifiers_source);
- ``package.module:function`` or ``path/to/file.py:function``: a function of yours.

The function is called ``fn(seed=<int>, split="train" | "val", **data.source_kwargs)`` (``seed`` and
``split`` only when its signature takes them) and returns an iterable of rows (a generator, a list, a
dataset) or a ``PromptSource``: the rows plus the verifier that scores them. A row is a dict:

    prompt       a non-empty string, or a list of {"role", "content"} chat messages
    answer       the ground truth; any value when the source brings its reward, else a string or a
                 number (or a list of them) as in data files
    data_source  optional (default: the source's name); routes the row to its reward function
    extra_info   optional dict, passed to the reward function (which names ``extra_info``)

The next source plugs in here (an entry in ``ADAPTERS`` and one short module, or no change at all for a
function given by path): the builder and the recipes read every source through ``SourceLoader``.

Seeded and resumable. The rows are a pure function of the seed: pass 0 of the training stream is the
source opened with ``data.seed``; a finite source, once exhausted, is opened again for pass k with
``seed + k * PASS_SEED_STRIDE`` (new problems from a procedural task; the same rows again from a source
that takes no seed). The loader's state is (pass, rows drawn in that pass, batches): a resumed run opens
that pass and skips the rows drawn, so it sees exactly the rows the uninterrupted run would have.

Validation is held out. Its rows are the first ``data.source_val_size`` of the source opened with
``split="val"`` and ``data.source_val_seed`` (default: ``seed + VAL_SEED_OFFSET``), and the training
stream skips every row whose prompt is one of them, so the two never overlap even where two seeds can
produce the same problem (reasoning-gym's item i of seed s is item i-1 of seed s+1) or where the source
ignores the seed (then validation is simply the first rows and training the rest).
"""

from __future__ import annotations

import inspect
import itertools
import json
import logging
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlcore.data.dataset import PromptDataset, check_answer, collate_prompts
from rlcore.data.verl_schema import check_messages
from rlcore.registry import load_named

logger = logging.getLogger(__name__)

ADAPTERS = {  # data.source "<name>:<argument>" -> the adapter module's factory (imported only when named)
    "reasoning_gym": "rlcore.data.reasoning_gym_source:reasoning_gym_source",
    "verifiers": "rlcore.data.verifiers_source:verifiers_source",
}
SPLITS = ("train", "val")
PASS_SEED_STRIDE = 100_003  # pass k of a finite source is opened with seed + k * this
VAL_SEED_OFFSET = 1_000_003  # validation's default seed: data.seed + this
ROW_KEYS = ("prompt", "answer", "data_source", "extra_info")


@dataclass
class PromptSource:
    """Rows and the verifier that scores them.

    ``reward``: ``fn(response, ground_truth, *, extra_info=None, **extra) -> float`` (rlcore's reward
    signature), bound to ``data_source`` when the run loads its data; None leaves the rows to the reward
    function registered under their data_source (or ``reward.reward_fn``). ``rows`` is iterated once.
    """

    rows: Iterable[Mapping[str, Any]]
    reward: Callable[..., Any] | None = None
    data_source: str | None = None


def open_source(spec: str, kwargs: Mapping[str, Any], seed: int, split: str) -> PromptSource:
    """The source of ``spec`` opened for ``split`` with ``seed`` (see the module docstring)."""
    if split not in SPLITS:
        raise ValueError(f"a source's split is one of {SPLITS}, got {split!r}")
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"data.source must be one of {sorted(f'{name}:<name>' for name in ADAPTERS)}, "
                         f"'package.module:function' or 'path/to/file.py:function', got {spec!r}")
    kwargs = dict(kwargs)
    for key in ("seed", "split"):
        if key in kwargs:
            raise ValueError(f"data.source_kwargs may not set {key!r}: the loader passes it (data.seed for training, "
                             "data.source_val_seed for validation)")
    name, _, argument = spec.partition(":")
    if name in ADAPTERS:
        if not argument:
            raise ValueError(f"data.source={spec!r} names no {name} task or environment after the ':'")
        made = load_named(ADAPTERS[name], "data.source adapter")(argument, seed=seed, split=split, **kwargs)
        default_source = f"{name}/{argument}"
    else:
        fn = load_named(spec, "data.source")
        if fn is None:
            where, attr = spec.rsplit(":", 1)
            raise ValueError(f"{where!r} defines no {attr!r} (from data.source={spec!r})")
        if not callable(fn):
            raise TypeError(f"data.source={spec!r} is a {type(fn).__name__}: give a function that returns the rows "
                            "(called once per pass, so a resumed run can open it again)")
        made = fn(**_accepted(fn, {"seed": seed, "split": split}, spec), **kwargs)
        default_source = getattr(fn, "__name__", "source")
    if isinstance(made, PromptSource):
        source = made
    elif isinstance(made, Iterable) and not isinstance(made, (str, bytes, Mapping)):
        source = PromptSource(rows=made)
    else:
        raise TypeError(f"data.source={spec!r} returned a {type(made).__name__}: expected an iterable of row dicts "
                        "(a generator, a list, a dataset) or a rlcore.data.sources.PromptSource")
    if source.data_source is None:
        source.data_source = default_source
    return source


def _accepted(fn: Callable, offered: Mapping[str, Any], spec: str) -> dict[str, Any]:
    """The keyword arguments of ``offered`` that ``fn``'s signature takes (all with ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return dict(offered)
    return {k: v for k, v in offered.items() if k in params}


def check_row(row: Any, index: int, origin: str, default_source: str, own_reward: bool) -> dict[str, Any]:
    """A produced row in the loader's layout (prompt, answer, data_source, extra_info), or a ValueError
    naming the source, the row's index in its pass and the key that is wrong."""
    where = f"{origin} row {index}"
    if not isinstance(row, Mapping):
        raise ValueError(f"{where}: a source must yield dicts with {list(ROW_KEYS[:2])}, got {type(row).__name__}")
    for key in ("prompt", "answer"):
        if key not in row:
            raise ValueError(f"{where}: key {key!r} missing; the row has {sorted(map(str, row))}")
    prompt = row["prompt"]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError(f"{where}: key 'prompt' is an empty string")
    else:
        check_messages(prompt, origin, index)
    if not own_reward:
        check_answer(row["answer"], "answer", origin, index)
    source = row.get("data_source", default_source)
    if not isinstance(source, str) or not source or ":" in source:
        raise ValueError(f"{where}: key 'data_source' must be a non-empty string without ':', got {source!r}")
    info = row.get("extra_info")
    if info is not None and not isinstance(info, Mapping):
        raise ValueError(f"{where}: key 'extra_info' must be a dict or absent, got {type(info).__name__}")
    return {"prompt": prompt if isinstance(prompt, str) else [dict(m) for m in prompt], "answer": row["answer"],
            "data_source": source, "extra_info": dict(info) if info is not None else None}


def prompt_key(prompt: Any) -> str:
    """A prompt as a comparable string: held-out validation prompts are skipped in training by it."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


class RowStream:
    """The checked rows of one split, pass after pass, with a position that can be saved and restored."""

    def __init__(self, spec: str, kwargs: Mapping[str, Any], seed: int, split: str) -> None:
        self.spec, self.kwargs, self.seed, self.split = spec, dict(kwargs), seed, split
        self.pass_index, self.offset = 0, 0
        self._rows: Iterator | None = None
        self.first: PromptSource | None = self._open(0)  # opened at once: a bad spec or task fails at load time
        self.reward, self.data_source = self.first.reward, self.first.data_source

    def _open(self, pass_index: int) -> PromptSource:
        return open_source(self.spec, self.kwargs, self.seed + pass_index * PASS_SEED_STRIDE, self.split)

    def origin(self) -> str:
        return f"data.source={self.spec} ({self.split}, pass {self.pass_index})"

    def seek(self, pass_index: int, offset: int) -> None:
        """Continue at row ``offset`` of pass ``pass_index`` (opened again on the next row)."""
        self.pass_index, self.offset, self._rows = int(pass_index), int(offset), None

    def __next__(self) -> tuple[int, dict[str, Any]]:
        """(the row's index in its pass, the checked row); StopIteration at the end of a pass."""
        if self._rows is None:
            source = self.first if (self.pass_index == 0 and self.first is not None) else self._open(self.pass_index)
            self.first = None  # a PromptSource's rows are iterated once
            self.reward, self.data_source = source.reward, source.data_source
            self._rows = itertools.islice(iter(source.rows), self.offset, None)
        try:
            row = next(self._rows)
        except StopIteration:
            self._rows = None
            raise
        index = self.offset
        self.offset += 1
        return index, check_row(row, index, self.origin(), self.data_source, self.reward is not None)

    def next_pass(self) -> None:
        self.seek(self.pass_index + 1, 0)


class RowEncoder:
    """Checked rows -> dataset items (tokenized as files' rows are, through PromptDataset)."""

    def __init__(self, tokenizer: Any, max_prompt_length: int, apply_chat_template: Any, own_reward: bool) -> None:
        self.tokenizer, self.max_len = tokenizer, max_prompt_length
        self.template, self.own_reward = apply_chat_template, own_reward

    def __call__(self, row: dict[str, Any], origin: str) -> dict[str, Any] | None:
        """The item, or None for a prompt longer than ``max_prompt_length`` (dropped, as files' are)."""
        dataset = PromptDataset((), self.tokenizer, max_prompt_length=sys.maxsize, records=[(origin, [row])],
                                apply_chat_template=self.template, extra_keys=("data_source", "extra_info"),
                                check_truth=not self.own_reward)
        item = dataset[0]
        return item if len(item["input_ids"]) <= self.max_len else None


def collate_items(items: list[dict[str, Any]], pad_token_id: int) -> tuple[dict, dict]:
    """``collate_prompts``, every item given the chat form when any has it (a batch mixing string and
    chat prompts without a chat template)."""
    if any("messages" in item for item in items):
        items = [item if "messages" in item else {**item, "messages": PromptDataset._messages(item["raw_prompt"])}
                 for item in items]
    return collate_prompts(items, pad_token_id)


class SourceLoader:
    """Training batches drawn from a source as they are needed: the ``PromptLoader`` interface (iterate
    for (tensors, non_tensors); ``state_dict``/``load_state_dict``), endless, with no epochs (``epoch``
    is always 0, so a batch's index in the run is ``position``)."""

    def __init__(self, stream: RowStream, encode: RowEncoder, batch_size: int, pad_token_id: int,
                 held_out: set[str]) -> None:
        if batch_size <= 0:
            raise ValueError(f"data.train_batch_size must be positive, got {batch_size}")
        if pad_token_id is None:
            raise ValueError("the tokenizer has no pad_token_id")
        self.stream, self.encode, self.batch_size = stream, encode, batch_size
        self.pad_token_id, self.held_out = pad_token_id, held_out
        self.position = 0  # batches handed out
        self.skipped = {"held_out": 0, "too_long": 0}

    def __len__(self) -> int:
        """1: a stream has no epochs (see the class docstring)."""
        return 1

    @property
    def total_steps(self) -> None:
        return None

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]]:
        while True:
            items = self._next_items()
            self.position += 1  # counted before handing out, so a checkpoint after this batch resumes with the next
            yield collate_items(items, self.pad_token_id)

    def _next_items(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        barren, at_pass_end = 0, -1  # passes in a row that added no item: two mean none ever will
        while len(items) < self.batch_size:
            try:
                _, row = next(self.stream)
            except StopIteration:
                barren, at_pass_end = (barren + 1 if len(items) == at_pass_end else 0), len(items)
                if self.stream.offset == 0 or barren > 1:
                    raise ValueError(f"{self.stream.origin()}: the source yields no usable rows (none, or all held "
                                     f"out for validation or too long: {self.skipped})") from None
                self.stream.next_pass()
                continue
            if prompt_key(row["prompt"]) in self.held_out:
                self.skipped["held_out"] += 1
                continue
            item = self.encode(row, self.stream.origin())
            if item is None:
                self.skipped["too_long"] += 1
                continue
            items.append(item)
        return items

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": 0, "position": self.position, "pass": self.stream.pass_index, "offset": self.stream.offset,
                "seed": self.stream.seed, "source": self.stream.spec}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for key, have in (("seed", self.stream.seed), ("source", self.stream.spec)):
            if state.get(key) != have:
                raise ValueError(f"the checkpoint's data loader has {key}={state.get(key)!r} but this run has "
                                 f"{have!r}; resuming would change the rows")
        self.position = int(state["position"])
        self.stream.seek(state["pass"], state["offset"])


def check_first_rows(spec: str, kwargs: Mapping[str, Any], seed: int, count: int, encode: RowEncoder) -> None:
    """Draw, check and encode the first ``count`` training rows in a stream of their own: a source whose
    rows are wrong fails at load time, naming the row and the key, not at its first step. (Later rows are
    checked as they are drawn: an endless stream cannot be read up front.)"""
    stream = RowStream(spec, kwargs, seed, "train")
    for _ in range(count):
        try:
            _, row = next(stream)
        except StopIteration:
            return
        encode(row, stream.origin())


def validation_items(stream: RowStream, encode: RowEncoder, size: int) -> tuple[list[dict[str, Any]], set[str]]:
    """The first ``size`` usable rows of the validation stream's first pass, encoded, and their prompts
    (``prompt_key``: what the training stream skips)."""
    if size <= 0:
        raise ValueError(f"data.source_val_size must be positive, got {size}")
    items, prompts = [], set()
    while len(items) < size:
        try:
            _, row = next(stream)
        except StopIteration:
            break
        item = encode(row, stream.origin())
        if item is not None:
            items.append(item)
            prompts.add(prompt_key(row["prompt"]))
    if not items:
        raise ValueError(f"{stream.origin()}: no validation rows (the source yields none, or all are too long)")
    if len(items) < size:
        logger.warning("%s: %d validation rows, fewer than data.source_val_size=%d", stream.origin(), len(items), size)
    return items, prompts
