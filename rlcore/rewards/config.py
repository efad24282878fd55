"""The ``reward`` config section (``RewardConfig``) and its ``model`` sub-section, read by the reward
manager (rlcore.rewards.manager), the reward-model worker and the trainer's config check."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

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
    """The ``reward`` section: which rule function(s) score each row, how they combine, and where they
    run; ``model``: a learned reward model beside (or instead of) the rule in training."""

    reward_fn: Any = None  # a registered name, "package.module:function" or "/path/file.py:function", or a
    #                        list of them (summed with `weights`); null: the function registered under each
    #                        row's data_source. (Any: OmegaConf has no str-or-list type; checked below.)
    weights: list[float] | None = None  # one per reward_fn entry; null: 1.0 each
    full_score: float | None = None  # a row is correct (reward/frac_correct) at this score or above;
    #                                  null: the sum of max(weight, 0) * the function's full score (1.0 unless
    #                                  it sets .full_score) over the functions that scored the row
    conversational: bool | None = None  # TRL-form functions get chat messages (True) or strings (False);
    #                                     null: messages when the prompts went through the chat template
    reward_fn_by_source: dict[str, str] = field(default_factory=dict)  # data_source -> one function; overrides reward_fn
    reward_kwargs: dict[str, Any] = field(default_factory=dict)  # keyword arguments of every call (e.g. format_score)
    timeout_s: float = 10.0  # seconds one call may take (one row; a TRL-form function: its whole batch)
    num_workers: int | None = None  # forked scoring processes per call; null: min(8, CPUs); 0: in the calling process
    extra_keys: list[str] = field(default_factory=list)  # further data columns passed to the function by name
    model: LearnedRewardConfig = field(default_factory=LearnedRewardConfig)  # a learned reward model (reward.model.*)

    def __post_init__(self) -> None:
        fns = reward_fn_list(self.reward_fn)
        if self.weights is not None:
            if fns is None:
                raise ValueError("reward.weights is set but reward.reward_fn is not: weights go with a list of "
                                 "functions, reward.reward_fn=[a.py:f, b.py:g] reward.weights=[1.0, 0.5]")
            if len(self.weights) != len(fns):
                raise ValueError(f"reward.weights has {len(self.weights)} entries but reward.reward_fn lists "
                                 f"{len(fns)} functions {fns}: give one weight per function")
            bad = [w for w in self.weights if not (isinstance(w, numbers.Real) and math.isfinite(w))]
            if bad:
                raise ValueError(f"reward.weights must be finite numbers, got {list(self.weights)}")
        if self.full_score is not None and not math.isfinite(self.full_score):
            raise ValueError(f"reward.full_score must be a finite number or null, got {self.full_score}")


def reward_fn_list(value: Any) -> list[Any] | None:
    """``reward.reward_fn`` as a list of entries (a single one: a list of one), None when unset; anything
    but a non-empty string, a callable or a non-empty list of them is a ``ValueError`` saying what is
    accepted."""
    if value is None:
        return None
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    bad = [v for v in items if not ((isinstance(v, str) and v.strip()) or callable(v))]
    if not items or bad:
        raise ValueError(f"reward.reward_fn must be a registered name, 'package.module:function', "
                         f"'/path/file.py:function' or a non-empty list of them; got {value!r}")
    return items
