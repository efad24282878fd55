"""Pre-flight: every path, file and folder a run names, checked before any worker or engine starts.

A typo found by the code that first uses a path fails a run minutes in: the reward function's file
after the vLLM engine has loaded, a reused run folder after the workers started. ``preflight(cfg)``
asks every such question up front, in the driver, in well under a second:

- ``model.path`` and ``reward.model.path``: local model directories;
- ``data.train_files`` / ``data.val_files``: each file exists and its first row parses and has the
  prompt column (and ``data_source``, and a ground truth: the answer column or verl's ``reward_model``);
- ``reward.reward_fn`` (each entry of a list) and every ``reward.reward_fn_by_source`` value: a registered name, or a
  ``file.py:function`` / ``module:function`` whose file exists and defines the function; with neither,
  the first training row's ``data_source`` must have a registered function;
- the run folder: not held by a live run, and holding no other run's records unless resumed or
  overwritten (``rlcore.trainer.run_folder``);
- ``trainer.resume``: a given checkpoint folder is a complete checkpoint;
- ``agent.path``: the file exists and defines the class.

One problem raises its own error (``FileNotFoundError``, ``RunFolderError``, ...); several raise one
``PreflightError`` listing them all, so a user fixes every typo in one go. ``build_workers`` calls it
first, and ``warm_start`` before it launches its SFT run, so every recipe gets it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlcore.data.dataset import first_record
from rlcore.data.verl_schema import is_verl_row
from rlcore.models.config import ModelConfig
from rlcore.rewards.registry import get_reward_fn, reward_fn_for_source
from rlcore.registry import load_named
from rlcore.trainer.run_checkpoint import resolve_resume
from rlcore.trainer.run_folder import check_run_folder


class PreflightError(ValueError):
    """Several problems found before start-up, listed one per line."""


def run_dir(cfg: DictConfig) -> Path:
    """The run folder ``<trainer.output_dir>/<trainer.project>/<trainer.run_name>``, absolute."""
    t = cfg.trainer
    return (Path(t.output_dir) / t.project / t.run_name).resolve()


def preflight(cfg: DictConfig) -> None:
    """Check what ``cfg`` names (module docstring); raise on the first problem, or list several."""
    problems: list[BaseException] = []

    def check(what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - every problem is collected, then raised below
            problems.append(type(exc)(f"{what}: {exc}") if _retypable(exc) else exc)
            return None

    if OmegaConf.select(cfg, "model.path") is not None:
        check("model.path", ModelConfig(path=cfg.model.path).require_local_dir)
    rows = _data_rows(cfg, check) if "data" in cfg else []
    if "reward" in cfg:
        _check_reward(cfg, rows, check)
    if "trainer" in cfg:
        check("trainer.resume", lambda: resolve_resume(cfg.trainer.resume, run_dir(cfg) / "checkpoints"))
        check("run folder", lambda: check_run_folder(run_dir(cfg), cfg.trainer.resume, cfg.trainer.overwrite))
    if OmegaConf.select(cfg, "agent.path") is not None:
        check("agent.path", lambda: _check_agent(cfg.agent.path))
    if len(problems) == 1:
        raise problems[0]
    if problems:
        lines = "\n".join(f"  - {type(p).__name__}: {p}" for p in problems)
        raise PreflightError(f"{len(problems)} problems found before start-up:\n{lines}")


def _check_agent(path: str) -> None:
    """``agent.path`` names a class with a ``run`` method (the driver imports it as its runners will; no
    import of the agentic layer, which needs Ray: the GPU image runs this pre-flight without it)."""
    if not callable(getattr(load_named(path, "agent"), "run", None)):
        where, _, name = path.rpartition(":")
        raise ValueError(f"{path!r}: no class {name!r} with a run(ctx) method in {where}")


def _retypable(exc: Exception) -> bool:
    """Whether ``exc`` can be rebuilt with a prefixed message (plain one-argument exception types)."""
    return type(exc) in (FileNotFoundError, ValueError, TypeError, KeyError, OSError, ImportError,
                         ModuleNotFoundError, AttributeError)


def _data_rows(cfg: DictConfig, check: Callable) -> list[dict]:
    """The first row of every data file given (nothing for the generated tasks), its columns checked."""
    d = cfg.data
    rows = []
    for key in ("train_files", "val_files"):
        files = d.get(key)
        if files is None:
            continue
        for path in [files] if isinstance(files, str) else list(files):
            row = check(f"data.{key}", lambda p=path: first_record(p))
            if row is None:
                continue
            check(f"data.{key}", lambda p=path, r=row: _check_columns(cfg, r, p))
            rows.append(row)
    return rows


def _check_columns(cfg: DictConfig, row: dict, path: str) -> None:
    d = cfg.data
    if "reward_model" in cfg:  # the reward-model recipe reads (prompt, chosen, rejected) pairs
        wanted = [d.prompt_key]
    else:
        wanted = [d.prompt_key, "data_source"]
        if d.answer_key and not is_verl_row(row, d.answer_key):
            wanted.append(d.answer_key)
    missing = [k for k in wanted if k not in row]
    if missing:
        raise ValueError(f"{path}: column(s) {missing} missing in the first row (data.prompt_key / data.answer_key; "
                         f"a ground truth may also be verl's 'reward_model' column); columns present: {sorted(row)}")


def _check_reward(cfg: DictConfig, rows: list[dict], check: Callable) -> None:
    r = cfg.reward
    fns = r.get("reward_fn")
    if isinstance(fns, str):
        check("reward.reward_fn", lambda: get_reward_fn(fns))
    elif fns is not None:
        for i, name in enumerate(fns):
            check(f"reward.reward_fn[{i}]", lambda n=name: get_reward_fn(n))
    by_source = OmegaConf.to_container(r.reward_fn_by_source) if r.get("reward_fn_by_source") else {}
    for source, name in by_source.items():
        check(f"reward.reward_fn_by_source.{source}", lambda n=name: get_reward_fn(n))
    if r.get("reward_fn") is None:
        for row in rows:
            source = row.get("data_source")
            if source is not None and source not in by_source and reward_fn_for_source(str(source)) is None:
                check("reward", lambda s=source: _no_reward_for(s))


def _no_reward_for(source: Any) -> None:
    raise ValueError(f"no reward function for the data's data_source {source!r}: set reward.reward_fn="
                     "<file.py>:<function> (or a registered name), or reward.reward_fn_by_source."
                     f"{source}=<function>")
