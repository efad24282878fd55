"""Rule rewards: decode each response, score it with a plain Python function, place the score.

``RuleRewardManager`` is a plain class: rule rewards are cheap, so a driver usually calls it
directly (``out = manager(batch); batch.union(out)``). ``rlcore.workers.reward.RewardWorker`` wraps
the same manager as an SPMD worker, for when scoring is heavy enough to spread over a Ray group.

Per row, the response tokens under ``response_mask`` (and only those) are decoded with special
tokens skipped and spaces kept exactly, then each of the row's functions is called as

    fn(response_text, ground_truth, prompt=..., data_source=..., **extra_keys_of_row, **reward_kwargs)

or, for a function with verl's signature (a parameter named ``solution_str``; see
``rlcore.rewards.signatures``), ``fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...,
**extra_keys_of_row, **reward_kwargs)``. ``extra_info`` is the row's ``extra_info`` non-tensor (verl's
data files carry one; None without it) and reaches only functions that name it or take ``**kwargs``.
A TRL-style function (a parameter named ``completions``) is called once for all the rows it scores,
``f(prompts=[...], completions=[...], ground_truth=[...], data_source=[...], ...)``; chat messages
instead of strings when ``conversational`` (default: when the batch carries ``messages``, i.e. the
prompts went through the chat template); see ``rlcore.rewards.signatures``. Any form may return None
for a row: not applicable.
A function may return a number or a dict with a ``score`` and further entries (verl's form): the
numeric entries become metrics ``reward/extra/<key>/mean`` (over the rows that report them).
``prompt`` is the ``raw_prompt`` non-tensor when present, else the decoded ``prompts`` under the
prompt part of ``attention_mask``, else None. ``data_source`` is None when the batch has no such
column. Which functions score a row: ``reward_fn_by_source[data_source]`` (one function) if listed, else
``reward_fn`` if set (one function, or a list whose weighted sum is the row's reward:
``rlcore.rewards.combine``), else the registered function named like the row's ``data_source`` (the
built-in names equal the data sources they score, and the data sources of verl's preprocessing
scripts map to them, "openai/gsm8k" -> gsm8k, "lighteval/MATH" -> math, ...; see
``rlcore.rewards.registry``).

Output (a new DataProto, ready for ``batch.union``):

    key                 part       shape     meaning
    token_level_scores  batch      (B, T_r)  float32; the score on the last token where response_mask
                                             is 1, 0 elsewhere. An empty response (no such token) gets
                                             its score nowhere: the row is all 0.
    reward_scores       batch      (B,)      float32; every row's score, empty responses included
    reward_full_score   batch      (B,)      float32; the score at which the row counts as correct
    response_text       non-tensor (B,)      the decoded text the functions saw
    reward_components   non-tensor (B,)      {function name: its unweighted score, None: not applicable}
    meta_info: reward/mean, reward/std (population, ddof=0), reward/min, reward/max,
               reward/frac_correct (fraction of rows at their full score), reward/<data_source>/mean,
               reward/<function name>/mean (where some row has several functions)

Where the functions run (``rlcore.rewards.running``, which says why): with ``num_workers >= 1`` each
batch scored forks that many worker processes, hands them one call at a time (one row; a TRL-style function:
all its rows) and kills them when the call ends; a call running longer than ``timeout_s`` kills
them and raises ``RewardError`` naming the function and the row at once. Forking costs milliseconds
per call, each row a pipe round trip (1024 rows took 0.25 s on 2 busy cores, 0.1 s in-process).
``num_workers=0`` (the recipes' default: no fork per step) runs the calls in the calling process, in
a daemon thread waited on with the same ``timeout_s``: a function that sleeps, waits or loops in
Python fails the call instead of hanging the run; only forked workers bound a C call that never
releases the GIL. A function marked ``needs_process = True`` (``math_verify``: its time limit is a
SIGALRM timer, which only a process's main thread can set) always runs in forked workers,
``min(8, CPUs)`` of them when ``num_workers=0``; its ``prepare()`` (imports, warm-up) runs once in
this process when the manager resolves it, so each fork starts warm.

Config: the ``reward`` section (``RewardConfig``) and ``model.path`` (the tokenizer's directory).
The section's ``model`` sub-section (``LearnedRewardConfig``) is not read here: it adds a learned
reward model's score in training (``rlcore.trainer.learned_reward``).
"""


from __future__ import annotations

import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from transformers import AutoTokenizer

from rlcore.models.config import ModelConfig
from rlcore.protocol import DataProto
from rlcore.rewards.calls import BatchCall, Call, Component, RowCall, RowResult
from rlcore.rewards.combine import combine, components_column, extra_metrics, reward_metrics, unique_names
from rlcore.rewards.config import LEARNED_COMBINE, LearnedRewardConfig, RewardConfig, reward_fn_list
from rlcore.rewards.registry import RewardFn, get_reward_fn, reward_fn_for_source
from rlcore.rewards.running import RewardError, run_forked, run_in_process
from rlcore.rewards.signatures import reward_call
from rlcore.typed_config import read_section

__all__ = ["LEARNED_COMBINE", "LearnedRewardConfig", "RewardConfig", "RewardError", "RuleRewardManager",
           "reward_metrics"]

RESPONSE_PREVIEW_CHARS = 200
# Keyword arguments the manager itself passes; reward_kwargs and extra_keys may not reuse them.
_ROW_KWARGS = ("prompt", "data_source", "extra_info", "solution_str")
# Columns a TRL-style function gets as lists beside prompts and completions (and the extra_keys).
_BATCH_COLUMNS = ("ground_truth", "data_source", "extra_info", "completion_ids")


def _resolve(fn: str | Callable) -> tuple[str, RewardFn]:
    """(name for messages, callable) of a registered name, an import path or a callable."""
    if isinstance(fn, str):
        return fn, get_reward_fn(fn)
    if callable(fn):
        return getattr(fn, "__qualname__", repr(fn)), fn
    raise TypeError(f"a reward function must be a name, an import path or a callable, got {type(fn).__name__}")


class RuleRewardManager:
    """Scores a rollout DataProto with rule functions; see the module docstring for the contract.

    ``reward_fn`` may be one function or a list (each a name, an import path or a callable), summed
    with ``weights`` (1.0 each by default); or a mapping data_source -> function: shorthand for
    ``reward_fn_by_source`` with no default. ``full_score``: the score at which a row counts as
    correct (None: ``rlcore.rewards.combine``'s default). ``answer_key``: the data's answer column
    name, under which TRL-style functions also get the ground truth (``answer``, ``solution``, ...).
    """

    def __init__(
        self,
        tokenizer: Any,
        reward_fn: str | Callable | Sequence[str | Callable] | Mapping[str, str | Callable] | None = None,
        *,
        reward_fn_by_source: Mapping[str, str | Callable] | None = None,
        reward_kwargs: Mapping[str, Any] | None = None,
        timeout_s: float = 10.0,
        num_workers: int | None = None,
        extra_keys: Sequence[str] = (),
        weights: Sequence[float] | None = None,
        full_score: float | None = None,
        conversational: bool | None = None,
        answer_key: str | None = None,
    ) -> None:
        if isinstance(reward_fn, Mapping):
            if reward_fn_by_source:
                raise ValueError("per-source functions go in reward_fn (a mapping) or reward_fn_by_source, not both")
            reward_fn, reward_fn_by_source = None, reward_fn
        if not (isinstance(timeout_s, numbers.Real) and timeout_s > 0):
            raise ValueError(f"reward timeout_s must be a positive number of seconds, got {timeout_s!r}")
        if num_workers is None:
            num_workers = min(8, os.cpu_count() or 1)
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"reward num_workers must be an integer >= 0, got {num_workers!r}")
        entries = reward_fn_list(reward_fn) or []
        # RewardConfig checks the same for a config; here for a manager built in Python.
        RewardConfig(reward_fn=entries or None, weights=None if weights is None else list(weights),
                     full_score=full_score)
        self.extra_keys = tuple(extra_keys)
        self.reward_kwargs = dict(reward_kwargs or {})
        taken = set(_ROW_KWARGS)
        for key in self.extra_keys:
            if key in taken or key in ("response", "ground_truth", "completion_ids"):
                raise ValueError(f"reward extra_keys may not contain {key!r}: the manager passes it already")
            taken.add(key)
        per_row = taken | {"response", "ground_truth", "prompts", "completions", *_BATCH_COLUMNS}
        clashes = sorted(per_row & set(self.reward_kwargs))
        if clashes:
            raise ValueError(f"reward_kwargs {clashes} clash with per-row arguments {sorted(per_row)}")
        self.tokenizer = tokenizer
        self.timeout_s = float(timeout_s)
        self.num_workers = num_workers
        self.full_score = full_score
        self.conversational = conversational
        free = answer_key not in (None, *taken, *_BATCH_COLUMNS, *self.reward_kwargs, "prompts", "completions")
        self.answer_alias = answer_key if free else None
        self._keywords = (*self.extra_keys, *self.reward_kwargs)
        self._batch_keywords = (*_BATCH_COLUMNS, *([self.answer_alias] if self.answer_alias else []))
        by_source = dict(reward_fn_by_source or {})
        names = unique_names([*entries, *by_source.values()])
        weights = list(weights) if weights is not None else [1.0] * len(entries)
        self._default = tuple(self._component(names[i], *_resolve(fn), weight=float(w))
                              for i, (fn, w) in enumerate(zip(entries, weights))) or None
        self._by_source = {source: (self._component(name, *_resolve(fn), f" (reward_fn_by_source[{source!r}])"),)
                           for name, (source, fn) in zip(names[len(entries):], by_source.items())}
        self._registered: dict[str, tuple[Component, ...]] = {}

    def _component(self, name: str, label: str, fn: RewardFn, where: str = "", weight: float = 1.0) -> Component:
        """The checked call, as a term of a row's reward: a signature matching no form fails here, naming
        the function. A function's ``prepare()``, if it has one, runs now: in this process, before any fork."""
        call = reward_call(fn, label + where, self._keywords, self._batch_keywords)
        prepare = getattr(fn, "prepare", None)
        if callable(prepare):
            prepare()
        return Component(name, call, weight, label)

    @classmethod
    def from_config(cls, config: Mapping | Any) -> "RuleRewardManager":
        """Build from a recipe config (sections ``model`` and ``reward``, see the module docstring; the
        ``data`` section's ``answer_key``, when there is one, names the ground truth for TRL-style functions)."""
        model_path = read_section(config, "model", ModelConfig).require_local_dir()
        data = config.get("data") if isinstance(config, Mapping) else getattr(config, "data", None)
        answer_key = data.get("answer_key", "answer") if isinstance(data, Mapping) else None
        return cls.from_reward_config(AutoTokenizer.from_pretrained(model_path),
                                      read_section(config, "reward", RewardConfig), answer_key=answer_key)

    @classmethod
    def from_reward_config(cls, tokenizer: Any, cfg: RewardConfig, *, num_workers: int | None = None,
                           answer_key: str | None = None) -> "RuleRewardManager":
        """From a ``reward`` section; ``num_workers`` (when given) overrides the section's."""
        return cls(tokenizer, cfg.reward_fn, reward_fn_by_source=cfg.reward_fn_by_source,
                   reward_kwargs=cfg.reward_kwargs, timeout_s=cfg.timeout_s,
                   num_workers=cfg.num_workers if num_workers is None else num_workers,
                   extra_keys=cfg.extra_keys, weights=cfg.weights, full_score=cfg.full_score,
                   conversational=cfg.conversational, answer_key=answer_key)

    def __call__(self, data: DataProto) -> DataProto:
        out = self.score(data)
        out.meta_info.update(reward_metrics(out.batch["reward_scores"], data.non_tensor_batch.get("data_source"),
                                            out.batch["reward_full_score"], out.non_tensor_batch["reward_components"]))
        return out

    def score(self, data: DataProto, index_offset: int = 0) -> DataProto:
        """Scores without metrics; ``index_offset`` shifts the row numbers in error messages."""
        self._check_input(data)
        responses, mask = data.batch["responses"], data.batch["response_mask"].bool()
        token_ids = [row[keep].tolist() for row, keep in zip(responses.cpu(), mask.cpu())]
        texts = self.tokenizer.batch_decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        n = len(data)
        cols = data.non_tensor_batch
        sources = cols.get("data_source", np.full(n, None, dtype=object))
        row_components = [self._fns_for(sources[i], i + index_offset) for i in range(n)]
        calls = self._calls(data, texts, token_ids, row_components)
        forked = self.num_workers > 0 or any(getattr(c.call.fn, "needs_process", False) for c in calls)
        fail = self._failure(texts, sources, index_offset)
        if forked:
            outcomes = run_forked(calls, self.timeout_s, self.num_workers or min(8, os.cpu_count() or 1), fail)
        else:
            outcomes = run_in_process(calls, self.timeout_s, fail)
        results: list[dict[str, tuple[Component, RowResult]]] = [{} for _ in range(n)]
        for call, outcome in zip(calls, outcomes):
            for row, result in zip(call.rows, outcome):
                results[row][call.component.name] = (call.component, result)
        totals = combine([[results[i][c.name] for c in row_components[i]] for i in range(n)], self.full_score)
        if totals.unscored:
            i = totals.unscored[0]
            raise RewardError(
                f"every reward function of sample {i + index_offset} (data_source={sources[i]!r}: "
                f"{[c.name for c in row_components[i]]}) returned None (not applicable), so it has no reward; "
                f"{len(totals.unscored)} such rows. Add a function that scores them (a reward.reward_fn list "
                f"entry or reward.reward_fn_by_source)", i + index_offset, sources[i], texts[i])

        scores = torch.tensor(totals.scores, dtype=torch.float32, device=responses.device)
        positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
        last = torch.where(mask, positions, -1).amax(dim=1)
        rows = torch.nonzero(last >= 0).squeeze(1)
        token_level_scores = torch.zeros(mask.shape, dtype=torch.float32, device=responses.device)
        token_level_scores[rows, last[rows]] = scores[rows]
        full = torch.tensor(totals.full_scores, dtype=torch.float32, device=responses.device)
        return DataProto.from_dict(
            {"token_level_scores": token_level_scores, "reward_scores": scores, "reward_full_score": full},
            {"response_text": texts, "reward_components": components_column(totals.components)},
            extra_metrics(totals.extras),
        )

    def _calls(self, data: DataProto, texts: list[str], token_ids: list[list[int]],
               row_components: list[tuple[Component, ...]]) -> list[Call]:
        """One call per (row, function) of the per-row forms, one per TRL-style function for all its rows."""
        n, cols = len(data), data.non_tensor_batch
        prompts = self._prompts(data)
        sources = cols.get("data_source", np.full(n, None, dtype=object))
        truths = cols["ground_truth"]
        infos = cols.get("extra_info", np.full(n, None, dtype=object))
        calls: list[Call] = []
        batched: dict[str, tuple[Component, list[int]]] = {}
        for i, components in enumerate(row_components):
            kwargs = {**{k: cols[k][i] for k in self.extra_keys}, **self.reward_kwargs}
            for c in components:
                if c.call.batched:
                    batched.setdefault(c.name, (c, []))[1].append(i)
                else:
                    calls.append(RowCall(c, i, texts[i], truths[i], prompts[i], sources[i], infos[i], kwargs))
        chat = self.conversational if self.conversational is not None else "messages" in cols
        for c, rows in batched.values():
            columns = {"ground_truth": [truths[i] for i in rows], "data_source": [sources[i] for i in rows],
                       "extra_info": [infos[i] for i in rows], "completion_ids": [token_ids[i] for i in rows],
                       **{k: [cols[k][i] for i in rows] for k in self.extra_keys}}
            if self.answer_alias:
                columns[self.answer_alias] = columns["ground_truth"]
            if chat:
                prompt_list = [_messages(cols["messages"][i] if "messages" in cols else prompts[i]) for i in rows]
                completions = [[{"role": "assistant", "content": texts[i]}] for i in rows]
            else:
                prompt_list, completions = [prompts[i] for i in rows], [texts[i] for i in rows]
            calls.append(BatchCall(c, tuple(rows), prompt_list, completions, {**columns, **self.reward_kwargs}))
        return calls

    def _failure(self, texts: list[str], sources: np.ndarray, offset: int) -> Callable[..., RewardError]:
        """The ``RewardError`` of a failed call, naming the function and the row (for a TRL-style call
        that failed as a whole: how many rows it had, from which)."""
        def fail(call: Call, what: str, position: int | None, detail: str) -> RewardError:
            row = call.rows[position or 0]
            where = f"on sample {row + offset}"
            if isinstance(call, BatchCall):
                where = (f"in its call for {len(call.rows)} samples (from sample {row + offset})" if position is None
                         else f"for sample {row + offset} (completion {position} of its call)")
            whole = isinstance(call, BatchCall) and position is None  # no one response to show
            preview = "" if whole else (f"; response (first {RESPONSE_PREVIEW_CHARS} chars): "
                                        f"{texts[row][:RESPONSE_PREVIEW_CHARS]!r}")
            return RewardError(f"reward function {call.component.label!r} {what} {where} (data_source="
                               f"{sources[row]!r}){preview}{detail}", row + offset, sources[row], texts[row])
        return fail

    # ------------------------------------------------------------------ inputs
    def _check_input(self, data: DataProto) -> None:
        if len(data) == 0:
            raise ValueError("RuleRewardManager got an empty batch")
        have = [] if data.batch is None else list(data.batch.keys())
        missing = [k for k in ("responses", "response_mask") if k not in have]
        missing += [k for k in ("ground_truth", *self.extra_keys) if k not in data.non_tensor_batch]
        if missing:
            raise KeyError(f"reward scoring needs {missing}; the batch has tensors {sorted(have)} "
                           f"and non-tensors {sorted(data.non_tensor_batch)}")

    def _prompts(self, data: DataProto) -> list[Any]:
        if "raw_prompt" in data.non_tensor_batch:
            return list(data.non_tensor_batch["raw_prompt"])
        if data.batch is not None and {"prompts", "attention_mask"} <= set(data.batch.keys()):
            prompt_ids, mask = data.batch["prompts"], data.batch["attention_mask"].bool()
            rows = [row[keep].tolist() for row, keep in zip(prompt_ids.cpu(), mask[:, : prompt_ids.shape[1]].cpu())]
            return self.tokenizer.batch_decode(rows, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return [None] * len(data)

    def check_sources(self, sources: Sequence[Any]) -> None:
        """A ``ValueError`` listing the data sources no function scores: checked before generating."""
        unknown = [s for s in dict.fromkeys(sources) if s not in self._by_source and self._default is None
                   and (not isinstance(s, str) or ":" in s or reward_fn_for_source(s) is None)]
        if unknown:
            raise ValueError(f"no reward function for data_source {unknown}: not a registered name nor a verl data "
                             f"source mapped to one, no reward_fn given, reward_fn_by_source lists "
                             f"{sorted(map(str, self._by_source))}")

    def _fns_for(self, source: Any, index: int) -> tuple[Component, ...]:
        if source in self._by_source:
            return self._by_source[source]
        if self._default is not None:
            return self._default
        if source not in self._registered:
            self._registered[source] = (self._registered_fn(source, index),)
        return self._registered[source]

    def _registered_fn(self, source: Any, index: int) -> Component:
        """The function registered under the row's data_source (or the built-in a verl data source maps
        to): the last resort, so no import paths."""
        missing = ValueError(
            f"no reward function for sample {index} (data_source={source!r}): it is not a registered reward name "
            f"nor a verl data source mapped to one (rlcore.rewards.registry.VERL_DATA_SOURCES), "
            f"reward_fn is not set and reward_fn_by_source lists only {sorted(map(str, self._by_source))}"
        )
        if not isinstance(source, str) or ":" in source:
            raise missing
        name = reward_fn_for_source(source)
        if name is None:
            raise missing
        taken = {c.name for c in self._by_source_components()}
        return self._component(name if name not in taken else f"{name}_registered", name, get_reward_fn(name))

    def _by_source_components(self) -> list[Component]:
        return [c for components in self._by_source.values() for c in components]


def _messages(prompt: Any) -> list[dict[str, Any]]:
    """A prompt as chat messages: its own list, or a string as one user message."""
    if isinstance(prompt, str) or prompt is None:
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]
