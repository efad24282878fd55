"""Preference pairs for reward-model training: files of (prompt, chosen, rejected) rows, checked row
by row and tokenized into the pair layout a reward model trains on, and pairs built from the
synthetic arithmetic task so the default reward-model run needs no download.

File format (``.jsonl`` / ``.json`` lines or ``.parquet``, as the prompt files): columns ``prompt``
(a string, the text the policy sees), ``chosen`` and ``rejected`` (strings: the two responses,
without the prompt) and optionally ``kind`` (a string naming what is wrong with the rejected one;
held-out accuracy is also reported per kind). A bad row is an error naming its file and row when
the file is read, not a crash many steps into training.

Arithmetic pairs (``make_arithmetic_pairs``): for each problem of ``rlcore.data.arithmetic``, chosen
is its answer and rejected a wrong one of each kind in ``PAIR_KINDS``:

    digit      one digit of the answer off by one ("15" -> "16" or "25"): the near miss a policy makes
    random     another number from the range of the answers
    malformed  not an answer at all: empty, trailing junk ("15+"), a leading zero ("015"), the sum echoed ("12+3")

one of each kind per problem (the held-out pairs: accuracy per kind on equal counts), or with
``dense=True`` every one of them the problem has: each off-by-one-digit variant, ``n_random``
distinct other numbers and all four malformed forms (~17 per problem; the training pairs). Dense
pairs are what make the reward model usable as an RL reward: a policy samples many wrong answers
per prompt and the reward model must rank the right one above all of them, not above one of each
kind. Trained on one pair per kind, the tiny reward model reached 0.83 held-out pair accuracy yet
RL on it drove the rule reward down (the policy found the wrong answers it scored high); trained
on dense pairs it reached 0.90 and RL on it raises the rule reward (README, "Reward model").

The rule reward ("arithmetic") scores every chosen response 1 and every rejected one 0, so a reward
model that ranks these pairs agrees with the rule on them.

Pair layout (``collate_pairs``): one pair per row, sequence 0 the chosen, 1 the rejected, each the
prompt's tokens, then the response's, then eos, right-padded to a common width T::

    input_ids, attention_mask, position_ids, response_mask    (B, 2, T)

A pair per row because shuffling, mini-batches, the DP split and micro-batches all cut between rows:
a pair can never be split. The eos because the policy's responses end with one and the reward model
scores a sequence at its last token: training sequences must end the way scored ones do. Right
padding is harmless: the reward model reads the position the attention mask marks last, with
position ids counted over real tokens, so the padding side does not change a score.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from rlcore.data.dataset import read_records, use_chat_template

logger = logging.getLogger(__name__)

PAIR_COLUMNS = ("prompt", "chosen", "rejected", "kind")
PAIR_KINDS = ("digit", "random", "malformed")


# ----------------------------------------------------------------------------- arithmetic pairs
def _off_by_one_digit(answer: str, rng: random.Random) -> str:
    """The answer with one of its digits moved one up or down, never gaining a leading zero."""
    sign, digits = ("-", answer[1:]) if answer.startswith("-") else ("", answer)
    i = rng.randrange(len(digits))
    d = int(digits[i])
    step = rng.choice((-1, 1))
    lowest = 1 if (i == 0 and len(digits) > 1) else 0
    if not lowest <= d + step <= 9:
        step = -step
    return sign + digits[:i] + str(d + step) + digits[i + 1:]


def _random_number(answer: str, low: int, high: int, rng: random.Random) -> str:
    if high - low < 1:
        high = low + 9
    while True:
        value = str(rng.randint(low, high))
        if value != answer:
            return value


def _malformed(answer: str, prompt: str, rng: random.Random) -> str:
    choice = rng.randrange(4)
    if choice == 0:
        return ""
    if choice == 1:
        return answer + rng.choice("+-=")
    if choice == 2:
        return "0" + answer
    return prompt.rstrip("=")


def _digit_variants(answer: str) -> list[str]:
    """Every string that is the answer with one digit moved one up or down (no new leading zero)."""
    sign, digits = ("-", answer[1:]) if answer.startswith("-") else ("", answer)
    out = []
    for i, ch in enumerate(digits):
        lowest = 1 if (i == 0 and len(digits) > 1) else 0
        out += [sign + digits[:i] + str(int(ch) + step) + digits[i + 1:]
                for step in (-1, 1) if lowest <= int(ch) + step <= 9]
    return list(dict.fromkeys(out))


def _all_malformed(answer: str, prompt: str, rng: random.Random) -> list[str]:
    return ["", answer + rng.choice("+-="), "0" + answer, prompt.rstrip("=")]


def _dense_rejections(answer: str, prompt: str, low: int, high: int, n_random: int,
                      rng: random.Random) -> list[tuple[str, str]]:
    digits = _digit_variants(answer)
    pool = [str(v) for v in range(low, high + 1) if str(v) != answer and str(v) not in digits]
    randoms = rng.sample(pool, min(n_random, len(pool)))
    return ([(v, "digit") for v in digits] + [(v, "random") for v in randoms]
            + [(v, "malformed") for v in _all_malformed(answer, prompt, rng)])


def make_arithmetic_pairs(rows: Sequence[dict[str, str]], seed: int, kinds: Sequence[str] = PAIR_KINDS,
                          dense: bool = False, n_random: int = 10) -> list[dict[str, str]]:
    """Pairs of arithmetic rows (``make_split``'s), the same for the same seed: {"prompt", "chosen":
    the answer, "rejected": a wrong response, "kind"}; one per (problem, kind), or with ``dense``
    every wrong response of those kinds the module docstring lists (``n_random`` random numbers)."""
    unknown = sorted(set(kinds) - set(PAIR_KINDS))
    if unknown or not kinds:
        raise ValueError(f"pair kinds must come from {PAIR_KINDS}, got {list(kinds)}")
    if not rows:
        raise ValueError("make_arithmetic_pairs got no rows")
    if n_random < 0:
        raise ValueError(f"n_random must be >= 0, got {n_random}")
    rng = random.Random(seed)
    answers = [int(r["answer"]) for r in rows]
    low, high = min(min(answers), 0), max(answers)
    pairs = []
    for row in rows:
        answer, prompt = str(row["answer"]), row["prompt"]
        if dense:
            rejections = [(v, k) for v, k in _dense_rejections(answer, prompt, low, high, n_random, rng) if k in kinds]
        else:
            rejections = []
            for kind in kinds:
                if kind == "digit":
                    rejections.append((_off_by_one_digit(answer, rng), kind))
                elif kind == "random":
                    rejections.append((_random_number(answer, low, high, rng), kind))
                else:
                    rejections.append((_malformed(answer, prompt, rng), kind))
        pairs += [{"prompt": prompt, "chosen": answer, "rejected": v, "kind": k} for v, k in rejections]
    return pairs


def write_pairs_jsonl(path: str | Path, pairs: Sequence[dict[str, str]]) -> Path:
    """One JSON object per line with the keys prompt, chosen, rejected (and kind when given)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        f.writelines(json.dumps({c: p[c] for c in PAIR_COLUMNS if c in p}) + "\n" for p in pairs)
    return path


def write_pairs_parquet(path: str | Path, pairs: Sequence[dict[str, str]]) -> Path:
    """A parquet table with string columns prompt, chosen, rejected (and kind when every pair has one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = [c for c in PAIR_COLUMNS if all(c in p for p in pairs)]
    pq.write_table(pa.table({c: pa.array([p[c] for p in pairs], type=pa.string()) for c in columns}), path)
    return path


# ----------------------------------------------------------------------------- the dataset
class PairDataset(torch.utils.data.Dataset):
    """Tokenized preference pairs read from one or more files (format in the module docstring).

    Each item holds the chosen and the rejected sequence (prompt + response + eos token ids), the
    prompt's length, the prompt text and the pair's ``kind`` ("" when the file has none). The prompt
    is tokenized exactly as ``PromptDataset`` tokenizes it for the RL recipes (the chat template
    when ``apply_chat_template``, else the plain text), so the reward model trains on the token ids
    it will later score. Pairs whose prompt is longer than ``max_prompt_length`` are dropped and
    counted, as the RL recipes drop such prompts.
    """

    def __init__(self, files: str | Path | Sequence[str | Path], tokenizer: Any, prompt_key: str = "prompt",
                 max_prompt_length: int = 512, apply_chat_template: bool | str | None = False) -> None:
        if max_prompt_length <= 0:
            raise ValueError(f"max_prompt_length must be positive, got {max_prompt_length}")
        if tokenizer.eos_token_id is None:
            raise ValueError("PairDataset needs a tokenizer with an eos token: responses end with it")
        self.use_chat_template = use_chat_template(apply_chat_template, tokenizer)
        self.tokenizer = tokenizer
        files = [files] if isinstance(files, (str, Path)) else list(files)
        if not files:
            raise ValueError("PairDataset needs at least one file")
        rows = []
        for path in files:
            records, columns = read_records(path)
            for i, row in enumerate(records):
                rows.append(self._checked(row, prompt_key, path, i, columns))
        if not rows:
            raise ValueError(f"no rows in {[str(f) for f in files]}")
        prompt_ids = tokenizer([r["raw_prompt"] for r in rows], add_special_tokens=not self.use_chat_template)["input_ids"]
        self.items: list[dict[str, Any]] = []
        eos = [tokenizer.eos_token_id]
        for ids, row in zip(prompt_ids, rows):
            if len(ids) > max_prompt_length:
                continue
            chosen, rejected = (tokenizer(row[k], add_special_tokens=False)["input_ids"] + eos for k in ("chosen", "rejected"))
            self.items.append({"chosen": torch.tensor(ids + chosen), "rejected": torch.tensor(ids + rejected),
                               "prompt_length": len(ids), "raw_prompt": row["raw_prompt"], "kind": row["kind"]})
        self.num_filtered = len(rows) - len(self.items)
        if self.num_filtered:
            logger.warning("PairDataset: dropped %d of %d pairs with prompts longer than %d tokens",
                           self.num_filtered, len(rows), max_prompt_length)
        if not self.items:
            raise ValueError(f"no pairs left: every prompt of {len(rows)} is longer than max_prompt_length={max_prompt_length}")

    def _checked(self, row: dict[str, Any], prompt_key: str, path: str | Path, i: int, columns: list[str]) -> dict[str, Any]:
        for key in (prompt_key, "chosen", "rejected"):
            if key not in row:
                raise ValueError(f"column {key!r} missing in {path} (row {i}); columns present: {columns}")
        prompt = row[prompt_key]
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"{path} row {i}: {prompt_key!r} must be a non-empty string, got {prompt!r}")
        for key in ("chosen", "rejected"):
            if not isinstance(row[key], str):
                raise ValueError(f"{path} row {i}: {key!r} must be a string (the response after the prompt), got "
                                 f"{type(row[key]).__name__} {row[key]!r}")
        if row["chosen"] == row["rejected"]:
            raise ValueError(f"{path} row {i}: chosen and rejected are the same response ({row['chosen']!r}): "
                             "the pair states no preference")
        kind = row.get("kind", "")
        if not isinstance(kind, str):
            raise ValueError(f"{path} row {i}: 'kind' must be a string, got {type(kind).__name__} {kind!r}")
        raw = prompt
        if self.use_chat_template:
            raw = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                     add_generation_prompt=True)
        return {"raw_prompt": raw, "chosen": row["chosen"], "rejected": row["rejected"], "kind": kind}

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, idx: int) -> dict[str, Any]:
        return self.items[idx]


def collate_pairs(items: Sequence[dict[str, Any]], pad_token_id: int) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """``PairDataset`` items as the pair layout (module docstring) plus the non-tensor columns
    ``raw_prompt`` and ``kind``, for ``DataProto.from_dict``."""
    if not items:
        raise ValueError("collate_pairs got an empty list of items")
    if pad_token_id is None:
        raise ValueError("collate_pairs needs a pad_token_id (the tokenizer has none set)")
    width = max(len(item[side]) for item in items for side in ("chosen", "rejected"))
    input_ids = torch.full((len(items), 2, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(items), 2, width), dtype=torch.long)
    response_mask = torch.zeros((len(items), 2, width), dtype=torch.long)
    for row, item in enumerate(items):
        for side, key in enumerate(("chosen", "rejected")):
            n = len(item[key])
            input_ids[row, side, :n] = item[key]
            attention_mask[row, side, :n] = 1
            response_mask[row, side, item["prompt_length"]:n] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    non_tensors = {}
    for key in ("raw_prompt", "kind"):
        column = np.empty(len(items), dtype=object)
        column[:] = [item[key] for item in items]
        non_tensors[key] = column
    return ({"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
             "response_mask": response_mask}, non_tensors)
