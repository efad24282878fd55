"""Several reward functions on one row: their names, the weighted sum, the row's full score, and the
batch metrics (``reward/frac_correct`` at full score, ``reward/<name>/mean`` per function).

A row is scored by one or more *components* (a function with its weight). Each returns a number or
None ("not applicable to this row", TRL's convention). The row's reward is the weighted sum over the
components that returned a number; a row for which every component returned None is an error (the
manager names the row and the functions): a silent 0 (what TRL's NaN-aware sum gives, with a warning)
would train the policy towards whatever that row's responses did. The row's *full score*, what
``reward/frac_correct`` counts as correct, is ``reward.full_score`` when set, else the sum of
``max(weight, 0) * fn.full_score`` over the components that scored it; a function's ``full_score``
attribute defaults to 1.0, the most every built-in gives (a negative weight is a penalty whose best
case is 0, assuming scores >= 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlcore.rewards.calls import Component, RowResult

FULL_SCORE_TOLERANCE = 1e-6  # relative: 0.1 + 0.2 + 0.7 is still a full 1.0


def base_name(entry: str | Callable) -> str:
    """A function's name for metrics and columns: the part after ':' of an import path, a registered
    name as it is, a callable's ``__name__``."""
    if isinstance(entry, str):
        return entry.rpartition(":")[2]
    return getattr(entry, "__name__", None) or type(entry).__name__


def unique_names(entries: Sequence[str | Callable]) -> list[str]:
    """One distinct name per entry: ``f``; two ``f`` from different files become ``a.f`` and ``b.f``
    (their file or module stem), and what still clashes gets ``_2``, ``_3``."""
    names = [base_name(e) for e in entries]
    for name in {n for n in names if names.count(n) > 1}:
        for i, entry in enumerate(entries):
            if names[i] == name and isinstance(entry, str) and ":" in entry:
                where = entry.rpartition(":")[0]
                stem = Path(where).stem if where.endswith(".py") else where.rpartition(".")[2]
                names[i] = f"{stem}.{name}"
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            names[i] = f"{name}_{seen[name]}"
    return names


@dataclass
class Combined:
    """Per-row totals of a batch: ``scores`` and ``full_scores`` (B,), ``components`` ({name: score or
    None} per row), ``extras`` (the dict forms' further entries per row), ``unscored`` (rows that no
    component scored)."""

    scores: list[float]
    full_scores: list[float]
    components: list[dict[str, float | None]]
    extras: list[dict[str, float]]
    unscored: list[int]


def combine(rows: Sequence[Sequence[tuple[Component, RowResult]]], full_score: float | None) -> Combined:
    """The weighted sum of each row's components (see the module docstring)."""
    out = Combined([], [], [], [], [])
    for i, results in enumerate(rows):
        scored = [(c, s) for c, (s, _) in results if s is not None]
        if not scored:
            out.unscored.append(i)
        out.scores.append(math.fsum(c.weight * s for c, s in scored))
        out.full_scores.append(full_score if full_score is not None
                               else math.fsum(max(c.weight, 0.0) * c.full_score for c, _ in scored))
        out.components.append({c.name: s for c, (s, _) in results})
        out.extras.append({k: v for _, (_, extras) in results for k, v in extras.items()})
    return out


def is_correct(scores: torch.Tensor, full_scores: torch.Tensor | None = None) -> torch.Tensor:
    """Rows at their full score (1.0 where not given), within a relative float tolerance."""
    s = scores.detach().double().cpu()
    full = torch.ones_like(s) if full_scores is None else full_scores.detach().double().cpu()
    return s >= full - FULL_SCORE_TOLERANCE * full.abs().clamp(min=1.0)


def reward_metrics(scores: torch.Tensor, data_sources: np.ndarray | None = None,
                   full_scores: torch.Tensor | None = None, components: np.ndarray | None = None) -> dict[str, float]:
    """Batch statistics of the scores: mean, std (population), min, max, ``frac_correct`` (rows at
    their full score, 1.0 where ``full_scores`` is not given), the mean score of each data source (in
    order of appearance), and where some row had several functions the mean of each function's own
    (unweighted) score over the rows it scored, ``reward/<name>/mean`` (``reward/<name>_fn/mean`` where
    a data source has that name)."""
    s = scores.detach().double().cpu()
    metrics = {
        "reward/mean": s.mean().item(),
        "reward/std": s.std(unbiased=False).item(),
        "reward/min": s.min().item(),
        "reward/max": s.max().item(),
        "reward/frac_correct": is_correct(s, full_scores).double().mean().item(),
    }
    if data_sources is not None:
        listed = data_sources.tolist()
        for source in dict.fromkeys(listed):
            rows = torch.tensor([x == source for x in listed], dtype=torch.bool)
            metrics[f"reward/{source}/mean"] = s[rows].mean().item()
    if components is not None and any(len(c) > 1 for c in components):
        values: dict[str, list[float]] = {}
        for row in components:
            for name, value in row.items():
                values.setdefault(name, [])
                if value is not None:
                    values[name].append(value)
        for name, v in values.items():
            key = f"reward/{name}/mean"
            key = f"reward/{name}_fn/mean" if key in metrics else key
            if v:  # a function that scored no row of this batch has no mean here
                metrics[key] = math.fsum(v) / len(v)
    return metrics


def extra_metrics(rows: Sequence[dict[str, float]]) -> dict[str, float]:
    """``reward/extra/<key>/mean`` of each numeric entry the dict-returning functions gave, over the rows
    that gave it (keys in order of appearance)."""
    values: dict[str, list[float]] = {}
    for extras in rows:
        for key, value in extras.items():
            values.setdefault(key, []).append(value)
    return {f"reward/extra/{key}/mean": sum(v) / len(v) for key, v in values.items()}


def components_column(components: Sequence[dict[str, Any]]) -> np.ndarray:
    """The per-row component dicts as a numpy object column (DataProto's non-tensor form)."""
    column = np.empty(len(components), dtype=object)
    column[:] = list(components)
    return column
