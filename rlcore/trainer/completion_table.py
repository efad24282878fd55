"""Every ``trainer.completion_table.every`` steps, a table of sampled completions in the trackers.

Why: the inspector (``python -m rlcore.inspect``) shows a run's trajectories token by token from its
folder; a team that watches runs in W&B, TensorBoard, MLflow or trackio wants to read what the model
writes there too, beside the curves. So at every ``every``-th step (0: never) up to
``completion_table.rows`` rows of the trained batch (whole prompt groups, evenly spread over the
batch: ``pick_groups``, cut at ``rows``) become the table ``completions`` with the columns

    step, data_source, policy_version, prompt, response, reward, reward/<component>..., advantage

logged by ``Tracker.log_table`` to the backends that show tables (a ``wandb.Table``, TensorBoard
markdown text, an MLflow JSON artifact, a ``trackio.Table``); with none of them in
``trainer.loggers`` nothing is built. The fields are the trajectory sample's
(``rlcore.trainer.trajectories.trajectory_rows``): reward = the sum of the row's token_level_scores,
advantage = its mean over the loss mask, policy_version = the oldest policy that sampled one of the
response's tokens (step - 1 in a synchronous run), prompt and response decoded whole, special tokens
kept (the chat template is part of what the model saw), padding dropped.

Reward components: when the batch has the non-tensor column ``reward_components`` (one mapping per row,
component name -> value, from the reward function), each name found in the table's rows is a
``reward/<name>`` column (numbers as floats, anything else as text, empty where a row lacks it), where
some row has two or more (one function's score would only repeat the reward column).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from rlcore.protocol import DataProto
from rlcore.trainer.trajectories import TokenPieces, pick_groups, trajectory_rows
from rlcore.trainer.trajectory_files import ENV_VERSION

TABLE_NAME = "completions"
REWARD_COMPONENTS = "reward_components"  # the non-tensor column read for per-row reward components
BASE_COLUMNS = ("step", "data_source", "policy_version", "prompt", "response", "reward")


def pick_rows(uids: Sequence[Any], n: int) -> list[int]:
    """Up to ``n`` row indices: whole groups (rows sharing a uid) evenly spread over the batch, enough of
    them to fill ``n`` rows at the batch's mean group size, the last one cut."""
    if n <= 0 or not len(uids):
        return []
    groups = len(set(uids))
    per_group = len(uids) / groups
    picked = pick_groups(uids, max(1, math.ceil(n / per_group)))
    return [i for group in picked for i in group][:n]


def _component(value: Any) -> float | str | None:
    if value is None:
        return None
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else None
    return str(value)


def reward_components(column: Any, rows: Sequence[int]) -> tuple[list[str], list[dict[str, Any]]]:
    """The component names found in ``rows`` of a ``reward_components`` column (sorted) and each row's
    mapping; rows whose cell is not a mapping (None, a bare number) have no components. No names where
    no row has two or more (a single function's score is the row's reward: no column repeats it)."""
    if column is None:
        return [], [{} for _ in rows]
    cells = [column[i] for i in rows]
    per_row = [{str(k): _component(v) for k, v in c.items()} if isinstance(c, Mapping) else {} for c in cells]
    if not any(len(c) > 1 for c in per_row):  # one function per row: its score is the reward column already
        return [], per_row
    names = sorted({k for c in per_row for k in c})
    return names, per_row


def table_of(batch: DataProto, step: int, n: int, pieces: TokenPieces, eos_id: int | None,
             default_source: str | None = None) -> tuple[list[str], list[list[Any]]]:
    """The table (module docstring) of ``n`` rows of ``batch``: (columns, rows)."""
    uids = batch.non_tensor_batch.get("uid")
    if uids is None:
        uids = np.arange(len(batch))  # every row its own group
    rows = pick_rows(list(uids), n)
    records = trajectory_rows(batch, step, rows, pieces, eos_id, default_source)
    tokenizer = pieces.tokenizer
    prompts = tokenizer.batch_decode([r["prompt_ids"] for r in records], skip_special_tokens=False)
    responses = tokenizer.batch_decode([r["ids"] for r in records], skip_special_tokens=False)
    names, components = reward_components(batch.non_tensor_batch.get(REWARD_COMPONENTS), rows)
    columns = [*BASE_COLUMNS, *(f"reward/{name}" for name in names), "advantage"]
    table = []
    for record, prompt, response, parts in zip(records, prompts, responses, components):
        sampled = [v for v in record["versions"] if v != ENV_VERSION]
        version = min(sampled) if sampled else step - 1
        table.append([step, record["data_source"], version, prompt, response, record["reward"],
                      *(parts.get(name) for name in names), record["advantage"]])
    return columns, table


class CompletionTable:
    """Logs the table at every ``every``-th step (0: off) through ``tracker`` when it has a backend that
    shows tables. ``token_pieces`` gives the run's decoder and eos id (loaded at its first call, so a
    run that never logs a table never loads a tokenizer)."""

    def __init__(self, every: int, rows: int, tracker: Any,
                 token_pieces: Callable[[], tuple[TokenPieces, int | None]], default_source: str | None = None) -> None:
        if every < 0 or rows < 1:
            raise ValueError(f"trainer.completion_table: every must be >= 0 (0: off) and rows >= 1, "
                             f"got every={every}, rows={rows}")
        self.every, self.rows, self.tracker = every, rows, tracker
        self.token_pieces, self.default_source = token_pieces, default_source

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0 and self.tracker.shows_tables

    def log(self, step: int, batch: DataProto | None) -> int:
        """Log ``step``'s table when due; the number of rows logged (0 when not due, or when the batch
        holds no sampled responses, e.g. a reward model's pairs)."""
        keys = batch.batch.keys() if batch is not None else ()
        if not self.due(step) or "responses" not in keys or "prompts" not in keys:
            return 0
        pieces, eos = self.token_pieces()
        columns, rows = table_of(batch, step, self.rows, pieces, eos, self.default_source)
        self.tracker.log_table(TABLE_NAME, columns, rows, step)
        return len(rows)
