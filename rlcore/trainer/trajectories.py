"""A bounded sample of each step's trajectories in the run folder, for ``python -m rlcore.inspect``.

Why: metrics say *that* a run goes wrong; the tokens say *why* (a response cut at the length limit,
a reward on the wrong token, sampler and trainer disagreeing on one token, a stale episode). Every
step, ``trainer.trajectory_groups`` prompt groups of the trained batch (evenly spread over it, 0: off)
are written, one JSON object per response, to ``<run>/trajectories/step_<step:06d>.jsonl``:

    step, row, group (the uid), episode (chat agents: one episode's segments share it), data_source,
    ground_truth, reward (sum of token_level_scores), advantage (mean over the loss mask), truncated,
    num_turns, length, policy_version (the policy this step trains from: step - 1),
    prompt_ids, prompt_pieces,
    ids, pieces (each token decoded alone), sampler_logprob (rollout_log_probs),
    trainer_logprob (the trainer's log-prob of the token: the batch's TRAINER_LOG_PROB_KEYS, or, after a
      single-step update, what its own first forward scored: rlcore.workers.sampled_rows),
    advantages, versions (the policy version that sampled each token: token_versions (counted from the
      step's policy when a turn-lockstep rollout says they count per call), else the row's
      policy_version column, else step - 1; -1: env/tool tokens), mask (loss mask),
    segments ([kind, start, end): "policy" or "env" runs of tokens: a multi-turn episode's turns)

Cost: one gather and list conversion per tensor for the picked rows, and one tokenizer decode per
token id never seen before in the run (pieces are cached); measured in docs/inspector.md.
A resumed run deletes the files of the steps it runs again.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoTokenizer

from rlcore.engines.layout import PER_CALL_VERSIONS
from rlcore.protocol import DataProto
from rlcore.trainer.trajectory_files import ENV_VERSION, TRAJECTORY_DIR, file_step, step_file
from rlcore.workers.sampled_rows import pick_groups

__all__ = ["TRAJECTORY_DIR", "TrajectoryWriter", "file_step", "pick_groups", "segments", "step_file", "trajectory_rows"]

TRAINER_LOG_PROB_KEYS = ("trainer_log_probs", "old_log_probs")  # the first one a batch has


KeptLogProbs = dict[tuple[str, tuple[int, ...]], list[float]]  # (uid, response ids) -> the trainer's log-probs


def kept_log_probs(rows: Sequence[dict] | None) -> KeptLogProbs:
    """The actor's ``take_sampled_log_probs`` rows (all ranks') by (uid, response ids)."""
    return {(str(r["uid"]), tuple(r["ids"])): r["log_probs"] for r in rows or ()}


def sample_rows(uids: Sequence[Any], groups: int, kept: KeptLogProbs) -> list[int]:
    """The rows of the step's sample: ``groups`` groups evenly spread (``pick_groups``). When the actor
    kept the trainer's log-probs of some (a single-step update), those groups first, then others
    up to ``groups`` (rows the update skipped have none: ``actor.skip_zero_advantage_rows``)."""
    def spread(among: list[int], n: int) -> list[int]:
        if n <= 0 or not among:
            return []
        return [among[j] for group in pick_groups([uids[i] for i in among], n) for j in group]

    if not kept:
        return spread(list(range(len(uids))), groups)
    with_trainer = {uid for uid, _ in kept}
    have = [i for i in range(len(uids)) if str(uids[i]) in with_trainer]
    first = spread(have, groups)
    rest = [i for i in range(len(uids)) if str(uids[i]) not in with_trainer]
    return sorted(first + spread(rest, groups - len({str(uids[i]) for i in first})))


def segments(mask: Sequence[int], versions: Sequence[int] | None) -> list[list]:
    """Runs of policy and env tokens as ``[kind, start, end]``. A token is the env's when its version
    is ENV_VERSION (an episode's token_versions), else, without versions, when it is out of the loss
    mask. Versions first: a policy token masked for staleness is still the policy's."""
    out: list[list] = []
    for j, m in enumerate(mask):
        env = versions[j] == ENV_VERSION if versions is not None else not m
        kind = "env" if env else "policy"
        if out and out[-1][0] == kind:
            out[-1][2] = j + 1
        else:
            out.append([kind, j, j + 1])
    return out


class TokenPieces:
    """Token id -> its text decoded alone, cached: a run decodes each id at most once."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, ids: Sequence[int]) -> list[str]:
        new = sorted({i for i in ids if i not in self.cache})
        if new:
            texts = self.tokenizer.batch_decode([[i] for i in new], skip_special_tokens=False)
            self.cache.update(zip(new, texts))
        return [self.cache[i] for i in ids]


def _rounded(values: Sequence[float]) -> list[float | None]:
    """Floats with 5 decimals (a log-prob's useful precision); non-finite values as null (JSON has none)."""
    return [round(v, 5) if math.isfinite(v) else None for v in values]


def _cell(column: np.ndarray | None, i: int) -> Any:
    if column is None:
        return None
    value = column[i]
    return value.item() if isinstance(value, np.generic) else value


TENSOR_KEYS = ("prompts", "responses", "attention_mask", "response_mask", "token_versions", "rollout_log_probs",
               "advantages", "token_level_scores", *TRAINER_LOG_PROB_KEYS)


def trajectory_rows(batch: DataProto, step: int, rows: Sequence[int], pieces: TokenPieces, eos_id: int | None,
                    default_source: str | None = None, kept: KeptLogProbs | None = None) -> list[dict]:
    """The records (module docstring) of ``rows`` of ``batch``; ``kept``: the trainer's log-probs of
    rows of a batch without TRAINER_LOG_PROB_KEYS (``kept_log_probs``)."""
    b, nt = batch.batch, batch.non_tensor_batch
    width_p, width_r = b["prompts"].shape[1], b["responses"].shape[1]
    index = torch.as_tensor(list(rows), dtype=torch.long)
    # the rows' tensors as Python lists, one gather and one conversion per key
    cols = {k: b[k][index].double().tolist() if b[k].is_floating_point() else b[k][index].tolist()
            for k in TENSOR_KEYS if k in b.keys()}
    trainer_key = next((k for k in TRAINER_LOG_PROB_KEYS if k in cols), None)
    per_call = bool(batch.meta_info.get(PER_CALL_VERSIONS))
    tasks = nt.get("task")
    out = []
    for k, i in enumerate(rows):
        attention = cols["attention_mask"][k]
        n = sum(attention[width_p:])
        ids = cols["responses"][k][:n]
        prompt_ids = [t for t, a in zip(cols["prompts"][k], attention[:width_p]) if a]
        mask = cols["response_mask"][k][:n] if "response_mask" in cols else [1] * n
        versions = cols["token_versions"][k][:n] if "token_versions" in cols else None
        if versions is not None and per_call:  # turn-lockstep: the step's policy sampled every policy token
            versions = [v if v == ENV_VERSION else step - 1 for v in versions]
        row_version = _cell(nt.get("policy_version"), i)  # async GRPO: the version that sampled the row
        sampled_by = step - 1 if row_version is None else int(row_version)
        advantages = cols["advantages"][k][:n] if "advantages" in cols else None
        in_loss = [a for a, m in zip(advantages or [], mask) if m]
        truncated = _cell(nt.get("truncated"), i)
        if truncated is None:  # single turn: cut at the length limit, not ended by eos
            truncated = n == width_r and n > 0 and ids[-1] != eos_id
        task = _cell(tasks, i) if tasks is not None else None
        ground_truth = _cell(nt.get("ground_truth"), i)
        if ground_truth is None and isinstance(task, dict):
            ground_truth = task.get("answer")
        reward = sum(cols["token_level_scores"][k]) if "token_level_scores" in cols else None
        trainer = cols[trainer_key][k][:n] if trainer_key else (kept or {}).get((str(_cell(nt.get("uid"), i)), tuple(ids)))
        out.append({
            "step": step, "row": int(i), "group": str(_cell(nt.get("uid"), i)),
            "episode": None if "episode" not in nt else str(_cell(nt["episode"], i)),
            "data_source": _cell(nt.get("data_source"), i) or default_source,
            "ground_truth": None if ground_truth is None else str(ground_truth),
            "reward": reward if reward is None or math.isfinite(reward) else None,
            "advantage": sum(in_loss) / len(in_loss) if in_loss and all(map(math.isfinite, in_loss)) else None,
            "truncated": bool(truncated), "num_turns": _cell(nt.get("num_turns"), i), "length": n,
            "policy_version": step - 1,
            "prompt_ids": prompt_ids, "prompt_pieces": pieces(prompt_ids),
            "ids": ids, "pieces": pieces(ids),
            "sampler_logprob": _rounded(cols["rollout_log_probs"][k][:n]) if "rollout_log_probs" in cols else None,
            "trainer_logprob": _rounded(trainer) if trainer is not None else None,
            "advantages": _rounded(advantages) if advantages is not None else None,
            "versions": versions if versions is not None else [sampled_by] * n,
            "mask": mask,
            "segments": segments(mask, versions),
        })
    return out


class TrajectoryWriter:
    """Writes each step's sample (``write``); off when ``groups`` is 0. The tokenizer (``tokenizer_path``,
    the run's model) is loaded at the first write, so a run with the sample off never loads it. Rows
    without a ``data_source`` column (episodes) get ``default_source`` (the env's or agent's name)."""

    def __init__(self, folder: Path, groups: int, tokenizer_path: str | None, start_step: int = 0,
                 default_source: str | None = None) -> None:
        if groups < 0:
            raise ValueError(f"trainer.trajectory_groups must be >= 0 (0: off), got {groups}")
        self.folder, self.groups, self.default_source = folder, groups, default_source
        self.tokenizer_path = tokenizer_path
        self._pieces: TokenPieces | None = None
        self._eos: int | None = None
        if folder.is_dir():  # a resumed run writes these steps again; a fresh run deletes earlier runs' files
            for path in folder.iterdir():
                found = file_step(path)
                if found is not None and found > start_step:
                    path.unlink()

    def token_pieces(self) -> tuple[TokenPieces, int | None]:
        """The run's token decoder and eos id, the tokenizer loaded at the first call (shared with the
        completion table, ``rlcore.trainer.completion_table``)."""
        if self._pieces is None:
            if not self.tokenizer_path:
                raise ValueError("the trajectory sample and the completion table decode tokens with the run's tokenizer: "
                                 "model.path is not set (set it, or trainer.trajectory_groups=0 and "
                                 "trainer.completion_table.every=0)")
            tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
            self._pieces, self._eos = TokenPieces(tokenizer), tokenizer.eos_token_id
        return self._pieces, self._eos

    def wants(self, batch: DataProto | None) -> bool:
        """Whether ``write`` would write a sample of ``batch``: on, and the batch holds sampled responses."""
        return bool(self.groups) and batch is not None and {"responses", "prompts"} <= set(batch.batch.keys())

    def write(self, step: int, batch: DataProto | None, kept: Sequence[dict] | None = None) -> int:
        """Write ``step``'s sample of ``batch``; the number of responses written (0 when off, or when the
        batch holds no sampled responses, e.g. a reward model's pairs). ``kept``: the actor's
        ``take_sampled_log_probs`` after a single-step update (the sample is picked among its rows)."""
        if not self.wants(batch):
            return 0
        pieces, eos = self.token_pieces()
        uids = batch.non_tensor_batch.get("uid")
        if uids is None:
            uids = np.arange(len(batch))  # every row its own group
        trainer = kept_log_probs(kept)
        rows = sample_rows(list(uids), self.groups, trainer)
        records = trajectory_rows(batch, step, rows, pieces, eos, self.default_source, trainer)
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = step_file(self.folder, step).with_suffix(".tmp")
        with open(tmp, "w") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n")
        tmp.replace(step_file(self.folder, step))  # a reader never sees half a file
        return len(records)
