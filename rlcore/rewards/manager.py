"""Rule rewards: decode each response, score it with a plain Python function, place the score.

``RuleRewardManager`` is a plain class: rule rewards are cheap, so a driver usually calls it
directly (``out = manager(batch); batch.union(out)``). ``rlcore.workers.reward.RewardWorker`` wraps
the same manager as an SPMD worker, for when scoring is heavy enough to spread over a Ray group.

Per row, the response tokens under ``response_mask`` (and only those) are decoded with special
tokens skipped and spaces kept exactly, then the row's function is called as

    fn(response_text, ground_truth, prompt=..., data_source=..., **extra_keys_of_row, **reward_kwargs)

or, for a function with verl's signature (a parameter named ``solution_str``; see
``rlcore.rewards.signatures``), ``fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...,
**extra_keys_of_row, **reward_kwargs)``. ``extra_info`` is the row's ``extra_info`` non-tensor (verl's
data files carry one; None without it) and reaches only functions that name it or take ``**kwargs``.
A function may return a number or a dict with a ``score`` and further entries (verl's form): the
numeric entries become metrics ``reward/extra/<key>/mean`` (over the rows that report them).
``prompt`` is the ``raw_prompt`` non-tensor when present, else the decoded ``prompts`` under the
prompt part of ``attention_mask``, else None. ``data_source`` is None when the batch has no such
column. Which function scores a row: ``reward_fn_by_source[data_source]`` if listed, else
``reward_fn`` if set, else the registered function named like the row's ``data_source`` (the
built-in names equal the data sources they score, and the data sources of verl's preprocessing
scripts map to them, "openai/gsm8k" -> gsm8k, "lighteval/MATH" -> math, ...; see
``rlcore.rewards.registry``).

Output (a new DataProto, ready for ``batch.union``):

    key                 part       shape     meaning
    token_level_scores  batch      (B, T_r)  float32; the score on the last token where response_mask
                                             is 1, 0 elsewhere. An empty response (no such token) gets
                                             its score nowhere: the row is all 0.
    reward_scores       batch      (B,)      float32; every row's score, empty responses included
    response_text       non-tensor (B,)      the decoded text the function saw
    meta_info: reward/mean, reward/std (population, ddof=0), reward/min, reward/max,
               reward/frac_correct (fraction of scores > 0), reward/<data_source>/mean

Where the functions run, and why. A reward function is user code; the failure that matters is
one that never returns (a catastrophic regex, a symbolic simplification that explodes). A thread
cannot be stopped, and a regex that never releases the GIL would even starve the thread that waits
for it. So with ``num_workers >= 1`` each call forks that many worker processes (``fork``: they
inherit the resolved functions, lambdas and functions loaded from files included, so nothing is
pickled but row indices and scores), hands them one row at a time, and kills them when the call
ends. A row running longer than ``timeout_s`` (measured from the moment it is handed out) makes
the call kill the workers and raise ``RewardError`` at once. Forking costs milliseconds per call,
each row a pipe round trip (1024 rows took 0.25 s on 2 busy cores, 0.1 s in-process).
The known risk of ``fork`` in a multi-threaded parent (a lock held by another thread at fork time)
concerns code that the child runs; rule functions are pure Python string work. ``num_workers=0``
(the recipes' default: no fork per step) runs the functions in the calling process instead, one
after another, in a daemon thread the call waits on with the same per-row ``timeout_s``: a function
that sleeps, waits or loops in Python fails the call (naming the row) instead of hanging the run.
The thread cannot be killed, so it is abandoned (a daemon: it does not keep the process alive), and
a C call that never releases the GIL (a catastrophic regex) still blocks the waiting thread too:
only ``num_workers >= 1`` bounds that. A function marked ``needs_process = True`` (``math_verify``:
its time limit is a SIGALRM timer, which only a process's main thread can set) always runs in forked
workers, ``min(8, CPUs)`` of them when ``num_workers=0``; its ``prepare()`` (imports, warm-up) runs
once in this process when the manager resolves it, so each fork starts warm.

Config: the ``reward`` section (``RewardConfig``) and ``model.path`` (the tokenizer's directory).
The section's ``model`` sub-section (``LearnedRewardConfig``) is not read here: it adds a learned
reward model's score in training (``rlcore.trainer.learned_reward``).
"""

from __future__ import annotations

import math
import multiprocessing
import numbers
import os
import pickle
import queue
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_connections
from typing import Any

import numpy as np
import torch
from transformers import AutoTokenizer

from rlcore.models.config import ModelConfig
from rlcore.protocol import DataProto
from rlcore.rewards.registry import RewardFn, get_reward_fn, reward_fn_for_source
from rlcore.rewards.signatures import RewardCall, reward_call
from rlcore.typed_config import read_section


LEARNED_COMBINE = ("rm", "sum")


@dataclass(frozen=True)
class LearnedRewardConfig:
    """The ``reward.model`` sub-section: a learned reward model scoring the training responses
    (``rlcore.workers.reward_model.RewardModelWorker``, role "rm"). Validation always scores with
    the rule, so a run is judged by the same number with or without a reward model."""

    path: str | None = None  # a HF sequence-classification directory (recipes.reward_model writes one); null: rule only
    combine: str = "rm"  # "rm": score = weight * the model's score; "sum": the rule's score + weight * the model's
    weight: float = 1.0  # factor on the model's score
    micro_batch_size_per_gpu: int = 4  # rows per reward-model forward on one rank
    use_dynamic_bsz: bool = False  # micro-batches packed by token count instead
    max_token_len_per_gpu: int = 16384  # token budget of a dynamic micro-batch

    def __post_init__(self) -> None:
        if self.combine not in LEARNED_COMBINE:
            raise ValueError(f"reward.model.combine must be one of {LEARNED_COMBINE}, got {self.combine!r}")
        if not math.isfinite(self.weight):
            raise ValueError(f"reward.model.weight must be a finite number, got {self.weight}")
        for key in ("micro_batch_size_per_gpu", "max_token_len_per_gpu"):
            if getattr(self, key) <= 0:
                raise ValueError(f"reward.model.{key} must be > 0, got {getattr(self, key)}")


@dataclass(frozen=True)
class RewardConfig:
    """The ``reward`` section: which rule function scores each row, and where it runs; ``model``:
    a learned reward model beside (or instead of) the rule in training."""

    reward_fn: str | None = None  # a registered name, "package.module:function" or "/path/file.py:function";
    #                               null: the function registered under each row's data_source
    reward_fn_by_source: dict[str, str] = field(default_factory=dict)  # data_source -> function; overrides reward_fn
    reward_kwargs: dict[str, Any] = field(default_factory=dict)  # keyword arguments of every call (e.g. format_score)
    timeout_s: float = 10.0  # seconds one row may take before the call fails
    num_workers: int | None = None  # forked scoring processes per call; null: min(8, CPUs); 0: in the calling process
    extra_keys: list[str] = field(default_factory=list)  # further non-tensor columns passed to the function by name
    model: LearnedRewardConfig = field(default_factory=LearnedRewardConfig)  # a learned reward model (reward.model.*)
RESPONSE_PREVIEW_CHARS = 200
# Keyword arguments the manager itself passes; reward_kwargs and extra_keys may not reuse them.
_ROW_KWARGS = ("prompt", "data_source", "extra_info", "solution_str")


class RewardError(RuntimeError):
    """A reward function failed on one row: raised, hung past the timeout, or returned a non-number.

    ``index`` is the row's position in the batch given to the manager (or to the worker group).
    """

    def __init__(self, message: str, index: int, data_source: Any, response: str) -> None:
        super().__init__(message)
        self.index, self.data_source, self.response = index, data_source, response


@dataclass(frozen=True)
class _Job:
    """One row's call, prepared in the parent so that forked workers only need its index."""

    fn_name: str
    call: RewardCall
    response: str
    ground_truth: Any
    prompt: Any
    data_source: Any
    extra_info: Any
    kwargs: dict[str, Any]

    def run(self) -> tuple[float, dict[str, float]]:
        """(score, the dict form's further numeric entries)."""
        return _as_score(self.call(self.response, self.ground_truth, prompt=self.prompt, data_source=self.data_source,
                                   extra_info=self.extra_info, kwargs=self.kwargs))


def _as_score(value: Any) -> tuple[float, dict[str, float]]:
    """A reward must be one finite real number, alone or as a dict's ``score`` (verl's form: the other
    numeric entries come back as extra metrics, the rest is dropped); anything else would poison the
    advantages."""
    extras: dict[str, float] = {}
    if isinstance(value, Mapping):
        if "score" not in value:
            raise TypeError(f"the reward function returned a dict without a 'score' entry: {sorted(map(str, value))}")
        extras = {str(k): float(v) for k, v in value.items()
                  if k != "score" and isinstance(v, numbers.Real) and math.isfinite(v)}
        value = value["score"]
    if not isinstance(value, numbers.Real):
        raise TypeError(f"the reward function returned {value!r} ({type(value).__name__}), expected a real number")
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"the reward function returned {score}, expected a finite number")
    return score, extras


def _resolve(fn: str | Callable) -> tuple[str, RewardFn]:
    """(name for messages, callable) of a registered name, an import path or a callable."""
    if isinstance(fn, str):
        return fn, get_reward_fn(fn)
    if callable(fn):
        return getattr(fn, "__qualname__", repr(fn)), fn
    raise TypeError(f"a reward function must be a name, an import path or a callable, got {type(fn).__name__}")


class RuleRewardManager:
    """Scores a rollout DataProto with rule functions; see the module docstring for the contract.

    ``reward_fn`` may also be a mapping data_source -> function: shorthand for
    ``reward_fn_by_source`` with no default.
    """

    def __init__(
        self,
        tokenizer: Any,
        reward_fn: str | Callable | Mapping[str, str | Callable] | None = None,
        *,
        reward_fn_by_source: Mapping[str, str | Callable] | None = None,
        reward_kwargs: Mapping[str, Any] | None = None,
        timeout_s: float = 10.0,
        num_workers: int | None = None,
        extra_keys: Sequence[str] = (),
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
        self.extra_keys = tuple(extra_keys)
        self.reward_kwargs = dict(reward_kwargs or {})
        taken = set(_ROW_KWARGS)
        for key in self.extra_keys:
            if key in taken or key in ("response", "ground_truth"):
                raise ValueError(f"reward extra_keys may not contain {key!r}: the manager passes it already")
            taken.add(key)
        clashes = sorted(taken & set(self.reward_kwargs))
        if clashes:
            raise ValueError(f"reward_kwargs {clashes} clash with per-row arguments {sorted(taken)}")
        self.tokenizer = tokenizer
        self.timeout_s = float(timeout_s)
        self.num_workers = num_workers
        self._keywords = (*self.extra_keys, *self.reward_kwargs)
        self._default = None if reward_fn is None else self._callable(*_resolve(reward_fn))
        self._by_source = {source: self._callable(*_resolve(fn), f" (reward_fn_by_source[{source!r}])")
                           for source, fn in (reward_fn_by_source or {}).items()}
        self._registered: dict[str, tuple[str, RewardCall]] = {}

    def _callable(self, name: str, fn: RewardFn, where: str = "") -> tuple[str, RewardCall]:
        """(name, the checked call): a signature matching neither form fails here, naming the function.
        A function's ``prepare()``, if it has one, runs now: in this process, before any fork."""
        call = reward_call(fn, name + where, self._keywords)
        prepare = getattr(fn, "prepare", None)
        if callable(prepare):
            prepare()
        return name, call

    @classmethod
    def from_config(cls, config: Mapping | Any) -> "RuleRewardManager":
        """Build from a recipe config (sections ``model`` and ``reward``, see the module docstring)."""
        model_path = read_section(config, "model", ModelConfig).require_local_dir()
        cfg = read_section(config, "reward", RewardConfig)
        return cls(
            AutoTokenizer.from_pretrained(model_path),
            cfg.reward_fn,
            reward_fn_by_source=cfg.reward_fn_by_source,
            reward_kwargs=cfg.reward_kwargs,
            timeout_s=cfg.timeout_s,
            num_workers=cfg.num_workers,
            extra_keys=cfg.extra_keys,
        )

    def __call__(self, data: DataProto) -> DataProto:
        out = self.score(data)
        out.meta_info.update(reward_metrics(out.batch["reward_scores"], data.non_tensor_batch.get("data_source")))
        return out

    def score(self, data: DataProto, index_offset: int = 0) -> DataProto:
        """Scores without metrics; ``index_offset`` shifts the row numbers in error messages."""
        self._check_input(data)
        responses, mask = data.batch["responses"], data.batch["response_mask"].bool()
        texts = self._decode(responses, mask)
        prompts = self._prompts(data)
        n = len(data)
        sources = data.non_tensor_batch.get("data_source", np.full(n, None, dtype=object))
        truths = data.non_tensor_batch["ground_truth"]
        infos = data.non_tensor_batch.get("extra_info", np.full(n, None, dtype=object))
        jobs = []
        for i in range(n):
            source = sources[i]
            fn_name, call = self._fn_for(source, i + index_offset)
            kwargs = {**{k: data.non_tensor_batch[k][i] for k in self.extra_keys}, **self.reward_kwargs}
            jobs.append(_Job(fn_name, call, texts[i], truths[i], prompts[i], source, infos[i], kwargs))
        forked = self.num_workers > 0 or any(getattr(job.call.fn, "needs_process", False) for job in jobs)
        results = (self._run_forked if forked else self._run_in_process)(jobs, sources, index_offset)
        scores = torch.tensor([score for score, _ in results], dtype=torch.float32, device=responses.device)

        positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
        last = torch.where(mask, positions, -1).amax(dim=1)
        rows = torch.nonzero(last >= 0).squeeze(1)
        token_level_scores = torch.zeros(mask.shape, dtype=torch.float32, device=responses.device)
        token_level_scores[rows, last[rows]] = scores[rows]
        return DataProto.from_dict(
            {"token_level_scores": token_level_scores, "reward_scores": scores}, {"response_text": texts},
            _extra_metrics([extras for _, extras in results]),
        )

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

    def _decode(self, ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
        rows = [row[keep].tolist() for row, keep in zip(ids.cpu(), mask.cpu())]
        return self.tokenizer.batch_decode(rows, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _prompts(self, data: DataProto) -> list[Any]:
        if "raw_prompt" in data.non_tensor_batch:
            return list(data.non_tensor_batch["raw_prompt"])
        if data.batch is not None and {"prompts", "attention_mask"} <= set(data.batch.keys()):
            prompt_ids = data.batch["prompts"]
            return self._decode(prompt_ids, data.batch["attention_mask"][:, : prompt_ids.shape[1]].bool())
        return [None] * len(data)

    def check_sources(self, sources: Sequence[Any]) -> None:
        """A ``ValueError`` listing the data sources no function scores: checked before generating."""
        unknown = [s for s in dict.fromkeys(sources) if s not in self._by_source and self._default is None
                   and (not isinstance(s, str) or ":" in s or reward_fn_for_source(s) is None)]
        if unknown:
            raise ValueError(f"no reward function for data_source {unknown}: not a registered name nor a verl data "
                             f"source mapped to one, no reward_fn given, reward_fn_by_source lists "
                             f"{sorted(map(str, self._by_source))}")

    def _fn_for(self, source: Any, index: int) -> tuple[str, RewardCall]:
        if source in self._by_source:
            return self._by_source[source]
        if self._default is not None:
            return self._default
        if source not in self._registered:
            self._registered[source] = self._registered_fn(source, index)
        return self._registered[source]

    def _registered_fn(self, source: Any, index: int) -> tuple[str, RewardCall]:
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
        return self._callable(name, get_reward_fn(name))

    # ------------------------------------------------------------------ running the functions
    def _run_in_process(self, jobs: list[_Job], sources: np.ndarray, offset: int) -> list[tuple[float, dict]]:
        """The rows one after another in a daemon thread; a row past ``timeout_s`` fails the call."""
        results: queue.Queue = queue.Queue()

        def work() -> None:
            for job in jobs:
                try:
                    results.put((True, job.run()))
                except Exception as exc:
                    results.put((False, exc))
                    return

        threading.Thread(target=work, name="reward-scoring", daemon=True).start()
        scores = []
        for i, job in enumerate(jobs):
            try:
                ok, value = results.get(timeout=self.timeout_s)  # the thread starts row i as row i-1 lands
            except queue.Empty:
                raise _error(job, i + offset, sources[i], f"did not return within timeout_s={self.timeout_s:g}s "
                             "(num_workers=0: its thread is abandoned; num_workers >= 1 kills hung rows)") from None
            if not ok:
                raise _error(job, i + offset, sources[i], f"raised {type(value).__name__}: {value}") from value
            scores.append(value)
        return scores

    def _run_forked(self, jobs: list[_Job], sources: np.ndarray, offset: int) -> list[tuple[float, dict]]:
        """Forked workers, one row at a time each; a row past its deadline kills them all."""
        context = multiprocessing.get_context("fork")
        scores: list[tuple[float, dict]] = [(math.nan, {})] * len(jobs)
        num_workers = self.num_workers or min(8, os.cpu_count() or 1)  # 0: functions that need a process
        todo = iter(range(len(jobs)))
        workers: dict[Connection, multiprocessing.Process] = {}
        busy: dict[Connection, tuple[int, float]] = {}  # connection -> (row, deadline)

        def hand_out(conn: Connection) -> None:
            i = next(todo, None)
            if i is not None:
                conn.send(i)
                busy[conn] = (i, time.monotonic() + self.timeout_s)

        try:
            for _ in range(min(num_workers, len(jobs))):
                conn, child_conn = context.Pipe()
                process = context.Process(target=_serve, args=(child_conn, jobs), daemon=True)
                process.start()
                child_conn.close()
                workers[conn] = process
                hand_out(conn)
            while busy:
                earliest = min(deadline for _, deadline in busy.values())
                ready = wait_for_connections(list(busy), timeout=max(0.0, earliest - time.monotonic()))
                if not ready:
                    now = time.monotonic()
                    for i, deadline in busy.values():
                        if deadline <= now:
                            raise _error(jobs[i], i + offset, sources[i], f"did not return within timeout_s="
                                         f"{self.timeout_s:g}s (its worker process was killed)")
                    continue
                for conn in ready:
                    i, _ = busy.pop(conn)
                    try:
                        ok, payload = conn.recv()
                    except EOFError:
                        workers[conn].join(timeout=5)
                        raise _error(jobs[i], i + offset, sources[i], "ended its worker process "
                                     f"(exit code {workers[conn].exitcode})") from None
                    if not ok:
                        exc_bytes, summary, remote_tb = payload
                        raise _error(jobs[i], i + offset, sources[i], f"raised {summary}",
                                     f"\nremote traceback:\n{remote_tb}") from _unpickled(exc_bytes)
                    scores[i] = payload
                    hand_out(conn)
        finally:
            for conn, process in workers.items():
                process.kill()  # idle ones wait in recv(); a hung one must go anyway
                process.join()
                conn.close()
        return scores


def _serve(conn: Connection, jobs: list[_Job]) -> None:
    """Worker process loop: receive a row index, reply (True, score) or (False, failure)."""
    while True:
        try:
            i = conn.recv()
        except EOFError:
            return
        try:
            reply = (True, jobs[i].run())
        except Exception as exc:
            try:
                exc_bytes = pickle.dumps(exc)
            except Exception:  # noqa: BLE001 - an unpicklable exception still travels as text
                exc_bytes = None
            reply = (False, (exc_bytes, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        conn.send(reply)


def _unpickled(exc_bytes: bytes | None) -> BaseException | None:
    """The worker's original exception, when it survives a pickle round trip (custom __init__s may not)."""
    if exc_bytes is None:
        return None
    try:
        exc = pickle.loads(exc_bytes)
    except Exception:  # noqa: BLE001 - the message already carries its type, text and traceback
        return None
    return exc if isinstance(exc, BaseException) else None


def _error(job: _Job, index: int, source: Any, what: str, detail: str = "") -> RewardError:
    preview = job.response[:RESPONSE_PREVIEW_CHARS]
    return RewardError(
        f"reward function {job.fn_name!r} {what} on sample {index} (data_source={source!r}); "
        f"response (first {RESPONSE_PREVIEW_CHARS} chars): {preview!r}{detail}",
        index, source, job.response,
    )


def _extra_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    """``reward/extra/<key>/mean`` of each numeric entry the dict-returning functions gave, over the rows
    that gave it (keys in order of appearance)."""
    values: dict[str, list[float]] = {}
    for extras in rows:
        for key, value in extras.items():
            values.setdefault(key, []).append(value)
    return {f"reward/extra/{key}/mean": sum(v) / len(v) for key, v in values.items()}


def reward_metrics(scores: torch.Tensor, data_sources: np.ndarray | None = None) -> dict[str, float]:
    """Batch statistics of the scores, plus the mean score of each data source (in order of appearance)."""
    s = scores.detach().double().cpu()
    metrics = {
        "reward/mean": s.mean().item(),
        "reward/std": s.std(unbiased=False).item(),
        "reward/min": s.min().item(),
        "reward/max": s.max().item(),
        "reward/frac_correct": (s > 0).double().mean().item(),
    }
    if data_sources is not None:
        listed = data_sources.tolist()
        for source in dict.fromkeys(listed):
            rows = torch.tensor([x == source for x in listed], dtype=torch.bool)
            metrics[f"reward/{source}/mean"] = s[rows].mean().item()
    return metrics
