"""Prompt datasets and a resumable batch loader for RL drivers.

RL post-training only needs prompts (plus whatever the reward function needs to score an answer):
the responses come from the rollout. So a dataset item is a tokenized prompt, the string the
policy saw, a ground truth for rule-based rewards and a few pass-through fields (`data_source`
routes a sample to its reward function).

verl's data files are read as they are (rlcore.data.verl_schema): a row with a `reward_model` column
and no answer column takes its ground truth from `reward_model.ground_truth` and carries its
`extra_info` dict to the reward function; its chat-message prompt goes through the chat template.

Prompts are tokenized once, up front: that lets overlong prompts be filtered (and counted) before
training starts instead of crashing a rollout hours in. Batches are LEFT-padded because generation
appends tokens on the right; `position_ids` skip the padding so a left-padded row gets the same
positions as the unpadded prompt.

The loader's state is two integers (epoch, batches consumed in that epoch). Because each epoch's
order is a pure function of (seed, epoch), a run restored from a checkpoint yields exactly the
batches the interrupted run would have yielded next.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch

from rlcore.data.verl_schema import (
    GROUND_TRUTH_KEY,
    check_messages,
    is_verl_row,
    verl_extra_info,
    verl_ground_truth,
)
from rlcore.errors import DataError, MissingFileError, close_file

logger = logging.getLogger(__name__)


def read_records(path: str | Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Read a `.jsonl`/`.json` (one JSON object per line) or `.parquet` file.

    Returns the rows and the file's column names (for error messages that show what exists).
    """
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"dataset file not found: {path}{close_file(path)}")
    if path.suffix in (".jsonl", ".json"):
        rows = []
        with path.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{line_no}: not a JSON object per line ({e})") from e
                if not isinstance(row, dict):
                    raise DataError(f"{path}:{line_no}: expected a JSON object, got "
                                     f"{type(row).__name__}")
                rows.append(row)
        columns = sorted({k for row in rows for k in row})
        return rows, columns
    if path.suffix == ".parquet":
        table = pq.read_table(path)
        return table.to_pylist(), table.column_names
    raise DataError(f"unsupported dataset file type {path.suffix!r} for {path}; "
                     f"use .jsonl, .json (JSON lines) or .parquet")


def use_chat_template(apply_chat_template: bool | str | None, tokenizer: Any) -> bool:
    """Whether plain-string prompts go through ``tokenizer``'s chat template: True/False as given,
    None or "auto" when the tokenizer has one. True without a template is an error."""
    if not (apply_chat_template is None or isinstance(apply_chat_template, bool) or apply_chat_template == "auto"):
        raise ValueError(f"apply_chat_template must be true, false, null or 'auto', got {apply_chat_template!r}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if apply_chat_template is True and not has_template:
        raise ValueError("apply_chat_template=True but the tokenizer has no chat_template")
    return has_template if apply_chat_template in (None, "auto") else apply_chat_template


def first_record(path: str | Path) -> dict[str, Any]:
    """The first row of a `.jsonl`/`.json` or `.parquet` file, reading no more of it than that: what a
    pre-flight check reads to find a missing file, a wrong format or a missing column at once."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"dataset file not found: {path}{close_file(path)}")
    if path.suffix in (".jsonl", ".json"):
        with path.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if line.strip():
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{path}:{line_no}: not a JSON object per line ({e})") from e
                    if not isinstance(row, dict):
                        raise DataError(f"{path}:{line_no}: expected a JSON object, got {type(row).__name__}")
                    return row
        raise DataError(f"no rows in {path}")
    if path.suffix == ".parquet":
        try:
            batch = next(pq.ParquetFile(path).iter_batches(batch_size=1), None)
        except Exception as e:  # pyarrow's own error types: a file that is not parquet
            raise DataError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from e
        if batch is None or batch.num_rows == 0:
            raise DataError(f"no rows in {path}")
        return batch.to_pylist()[0]
    raise DataError(f"unsupported dataset file type {path.suffix!r} for {path}; "
                     f"use .jsonl, .json (JSON lines) or .parquet")


def check_answer(value: Any, key: str, path: str | Path, row: int) -> None:
    """A ground truth a reward function can compare against: a non-empty string or a number (a
    list of them for several right answers). Checked when the file is read, so a bad row is an
    error naming it, not a crash deep in a reward function many steps into training."""
    items = value if isinstance(value, list) else [value]
    for item in items:
        if item is None or (isinstance(item, float) and item != item):
            raise DataError(f"{path} row {row}: {key!r} is null; every row needs a ground truth "
                             f"(or set data.answer_key=null for reward-model scoring)")
        if isinstance(item, bool) or not isinstance(item, (str, int, float)):
            raise DataError(f"{path} row {row}: {key!r} must be a string or a number (or a list of them), "
                             f"got {type(item).__name__} {item!r}")
        if isinstance(item, str) and not item.strip():
            raise DataError(f"{path} row {row}: {key!r} is an empty string")
    if not items:
        raise DataError(f"{path} row {row}: {key!r} is an empty list")


class PromptDataset(torch.utils.data.Dataset):
    """Tokenized prompts with their ground truths, read from one or more files.

    The prompt column holds either a string or a chat list of {"role", "content"} messages.
    A chat list always goes through the tokenizer's chat template (`add_generation_prompt=True`), as
    verl renders it: it has no other text. `apply_chat_template` decides for string prompts: None or
    "auto" templates them whenever the tokenizer has a chat template, as a single user message (what
    a chat model expects); True always (an error without a template); False never. Templated
    text is tokenized without extra special tokens (the template writes them); plain text gets the
    tokenizer's usual ones.

    `answer_key=None` is for prompt sets scored by a reward model (no ground truth);
    `ground_truth` is then None. Every column in `extra_keys` must exist. Rows in verl's layout (a
    `reward_model` column, no `answer_key` column) take `reward_model.ground_truth` as the ground
    truth and keep `extra_info` (None for the other rows of a dataset that has any).

    `records` replaces the files with rows already in memory, as (name for messages, rows) pairs: what
    a prompt source (rlcore.data.sources) produces; `check_truth=False` lets a row's ground truth be
    anything (a source with its own verifier decides what it needs).
    """

    def __init__(
        self,
        files: str | Path | Sequence[str | Path],
        tokenizer: Any,
        prompt_key: str = "prompt",
        answer_key: str | None = "answer",
        max_prompt_length: int = 512,
        apply_chat_template: bool | str | None = None,
        filter_overlong: bool = True,
        extra_keys: Sequence[str] = ("data_source",),
        records: Sequence[tuple[str, list[dict[str, Any]]]] | None = None,
        check_truth: bool = True,
    ) -> None:
        if max_prompt_length <= 0:
            raise ValueError(f"max_prompt_length must be positive, got {max_prompt_length}")
        self.use_chat_template = use_chat_template(apply_chat_template, tokenizer)
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.extra_keys = tuple(extra_keys)

        files = [files] if isinstance(files, (str, Path)) else list(files)
        if not files and records is None:
            raise ValueError("PromptDataset needs at least one file")
        # (where the rows came from, the rows, their columns): files, or rows a prompt source made in memory
        inputs = ([(str(path), rows, sorted({k for row in rows for k in row})) for path, rows in records]
                  if records is not None else [(path, *read_records(path)) for path in files])
        raw_prompts: list[str] = []
        templated: list[bool] = []
        plain: list[bool] = []
        records: list[dict[str, Any]] = []
        for path, rows, columns in inputs:
            for i, row in enumerate(rows):
                verl = is_verl_row(row, answer_key)
                wanted = [prompt_key, *([answer_key] if answer_key and not verl else []), *self.extra_keys]
                missing = [k for k in wanted if k not in row]
                if missing:
                    hint = (" (or verl's 'reward_model' column holding the ground truth)"
                            if missing[0] == answer_key else "")
                    raise DataError(f"column {missing[0]!r}{hint} missing in {path} (row {i}); "
                                     f"columns present: {columns}")
                truth = None
                if answer_key:
                    truth = verl_ground_truth(row, path, i) if verl else row[answer_key]
                    if check_truth:
                        check_answer(truth, GROUND_TRUTH_KEY if verl else answer_key, path, i)
                text, with_template = self._render(row[prompt_key], path, i)
                raw_prompts.append(text)
                templated.append(with_template)
                plain.append(isinstance(row[prompt_key], str))
                records.append({
                    "ground_truth": truth,
                    "messages": self._messages(row[prompt_key]),
                    **{k: row[k] for k in self.extra_keys},
                    **({"extra_info": verl_extra_info(row, path, i)} if verl else {}),
                })

        if not raw_prompts:
            raise DataError(f"no rows in {[str(f) for f in files] or [name for name, _ in records or ()]}")
        if not any(templated):  # plain text only: no chat form to keep
            records = [{k: v for k, v in rec.items() if k != "messages"} for rec in records]
        if any("extra_info" in rec for rec in records):  # every row needs the column to collate
            records = [{**rec, "extra_info": rec.get("extra_info")} for rec in records]
        encoded = self._tokenize(raw_prompts, templated)
        self.items: list[dict[str, Any]] = []
        for i, (ids, text, rec) in enumerate(zip(encoded, raw_prompts, records)):
            if len(ids) > max_prompt_length:
                if not filter_overlong:
                    raise DataError(f"prompt {i} has {len(ids)} tokens > max_prompt_length="
                                     f"{max_prompt_length} (set filter_overlong=True to drop it)")
                continue
            self.items.append({"input_ids": torch.tensor(ids, dtype=torch.long),
                               "raw_prompt": text, **rec})
        self.num_filtered = len(raw_prompts) - len(self.items)
        self.num_plain = sum(plain)  # string prompts (chat lists are always templated)
        if self.num_filtered:
            logger.warning("PromptDataset: dropped %d of %d prompts longer than %d tokens",
                           self.num_filtered, len(raw_prompts), max_prompt_length)
        if not self.items:
            raise DataError(f"no prompts left: all {len(raw_prompts)} are longer than "
                             f"max_prompt_length={max_prompt_length}")

    def describe(self) -> str:
        """One line on what the policy is fed: how many prompts, and whether the plain-string ones went
        through the chat template (a chat model fed raw text answers worse; printed at load)."""
        chats = len(self.items) + self.num_filtered - self.num_plain
        parts = []
        if self.num_plain:
            how = "through the tokenizer's chat template" if self.use_chat_template else "as plain text, no chat template"
            parts.append(f"{self.num_plain} plain-string prompts {how}")
        if chats:
            parts.append(f"{chats} chat-message prompts through the chat template")
        dropped = f", {self.num_filtered} dropped as too long" if self.num_filtered else ""
        return f"{len(self.items)} prompts ({'; '.join(parts)}{dropped})"

    @staticmethod
    def _messages(prompt: Any) -> list[dict[str, Any]]:
        """The prompt as chat messages, before the template (what a chat agent sends)."""
        return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]

    def _render(self, prompt: Any, path: str | Path, row: int) -> tuple[str, bool]:
        """(the exact text the policy sees, whether the chat template wrote it)."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise DataError(f"{path} row {row}: the prompt is empty")
            if not self.use_chat_template:
                return prompt, False
            prompt = [{"role": "user", "content": prompt}]
        else:
            check_messages(prompt, path, row)
            if not getattr(self.tokenizer, "chat_template", None):
                raise DataError(f"{path} row {row}: prompt is a chat list but the tokenizer has no "
                                 f"chat_template to render it")
        text = self.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        return text, True

    def _tokenize(self, texts: list[str], templated: list[bool]) -> list[list[int]]:
        """Token ids of each text: templated ones without added special tokens (the template wrote them)."""
        ids: list[list[int]] = [[] for _ in texts]
        for with_template in (True, False):
            rows = [i for i, t in enumerate(templated) if t is with_template]
            if rows:
                encoded = self.tokenizer([texts[i] for i in rows], add_special_tokens=not with_template)["input_ids"]
                for i, row_ids in zip(rows, encoded):
                    ids[i] = row_ids
        return ids

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, idx: int) -> dict[str, Any]:
        return self.items[idx]


def collate_prompts(
    items: Sequence[dict[str, Any]], pad_token_id: int
) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """Left-pad a list of dataset items into (tensors, non_tensors) for `DataProto.from_dict`.

    tensors: input_ids, attention_mask, position_ids, all (B, max_len). non_tensors: every other
    field as a numpy object array of length B.
    """
    if not items:
        raise ValueError("collate_prompts got an empty list of items")
    if pad_token_id is None:
        raise ValueError("collate_prompts needs a pad_token_id (the tokenizer has none set)")
    max_len = max(len(item["input_ids"]) for item in items)
    input_ids = torch.full((len(items), max_len), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(items), max_len), dtype=torch.long)
    for row, item in enumerate(items):
        n = len(item["input_ids"])
        if n:
            input_ids[row, max_len - n:] = item["input_ids"]
            attention_mask[row, max_len - n:] = 1
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    tensors = {"input_ids": input_ids, "attention_mask": attention_mask,
               "position_ids": position_ids}

    non_tensors = {}
    for key in items[0]:
        if key == "input_ids":
            continue
        column = np.empty(len(items), dtype=object)
        for row, item in enumerate(items):  # element-wise: a list value stays one object
            column[row] = item[key]
        non_tensors[key] = column
    return tensors, non_tensors


class ResumableBatchSampler:
    """Index batches over `num_epochs` epochs (None: forever), resumable mid-epoch.

    Epoch e's order is `default_rng((seed, e)).permutation(n)` (or 0..n-1 without shuffling), so
    it depends on nothing but (seed, e). Iterating continues from the current state; the state
    counts batches handed out, so a checkpoint taken after a batch resumes with the next one.
    """

    def __init__(self, num_items: int, batch_size: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True, num_epochs: int | None = None) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if drop_last and num_items < batch_size:
            raise ValueError(f"{num_items} items cannot fill one batch of {batch_size} "
                             f"with drop_last=True")
        if num_items <= 0:
            raise ValueError("cannot sample batches from an empty dataset")
        if num_epochs is not None and num_epochs <= 0:
            raise ValueError(f"num_epochs must be positive or None, got {num_epochs}")
        self.num_items, self.batch_size = num_items, batch_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.num_epochs = num_epochs
        self.epoch, self.position = 0, 0

    def batches_per_epoch(self) -> int:
        if self.drop_last:
            return self.num_items // self.batch_size
        return math.ceil(self.num_items / self.batch_size)

    def __len__(self) -> int:
        """Batches per epoch (an infinite sampler has no total)."""
        return self.batches_per_epoch()

    def epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_items)
        return np.random.default_rng((self.seed, epoch)).permutation(self.num_items)

    def __iter__(self) -> Iterator[list[int]]:
        per_epoch = self.batches_per_epoch()
        while self.num_epochs is None or self.epoch < self.num_epochs:
            order = self.epoch_order(self.epoch)
            while self.position < per_epoch:
                start = self.position * self.batch_size
                batch = order[start:start + self.batch_size].tolist()
                self.position += 1
                yield batch
            self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        # The identity fields let load_state_dict refuse a state from a different setup.
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_items": self.num_items, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key in ("seed", "num_items", "batch_size"):
            if state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]} but this sampler has "
                                 f"{key}={getattr(self, key)}; resuming would change the order")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


class PromptLoader:
    """Batches of collated prompts: yields (tensors, non_tensors) as `collate_prompts` returns.

    A thin pairing of a `PromptDataset` with a `ResumableBatchSampler`; prompts are already
    tokenized, so no worker processes are needed. Checkpoint it with `state_dict()`. `collate`
    replaces `collate_prompts` for datasets of other items (preference pairs: `collate_pairs`), so
    they get the same resumable order.
    """

    def __init__(self, dataset: PromptDataset, batch_size: int, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = True, num_epochs: int | None = None,
                 pad_token_id: int | None = None, collate: Callable[..., Any] = collate_prompts) -> None:
        self.dataset = dataset
        self.collate = collate
        self.pad_token_id = (pad_token_id if pad_token_id is not None
                             else dataset.tokenizer.pad_token_id)
        if self.pad_token_id is None:
            raise ValueError("PromptLoader needs a pad_token_id: the tokenizer has none; pass "
                             "pad_token_id=...")
        self.sampler = ResumableBatchSampler(len(dataset), batch_size, shuffle=shuffle, seed=seed,
                                             drop_last=drop_last, num_epochs=num_epochs)

    def __len__(self) -> int:
        return len(self.sampler)

    @property
    def total_steps(self) -> int | None:
        """Total batches over all epochs, or None for an endless loader."""
        if self.sampler.num_epochs is None:
            return None
        return self.sampler.num_epochs * len(self.sampler)

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]]:
        for indices in self.sampler:
            yield self.collate([self.dataset[i] for i in indices], self.pad_token_id)

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.load_state_dict(state)
