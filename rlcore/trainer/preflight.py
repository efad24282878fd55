"""Pre-flight: every path, file and folder a run names, checked before any worker or engine starts.

A typo found by the code that first uses a path fails a run minutes in: the reward function's file
after the vLLM engine has loaded, a reused run folder after the workers started. ``preflight(cfg)``
asks every such question up front, in the driver, in about a second (it reads the data files' rows):

- ``model.path`` and ``reward.model.path``: local model directories;
- ``data.train_files`` / ``data.val_files``: each file exists and every row parses and has the
  prompt column (and ``data_source``, and a ground truth: the answer column or verl's ``reward_model``);
  the first bad row of a file is named;
- ``reward.reward_fn`` (each entry of a list) and every ``reward.reward_fn_by_source`` value: a registered name, or a
  ``file.py:function`` / ``module:function`` whose file exists and defines the function; with neither,
  every distinct ``data_source`` of every file must have a registered function (a source first met in
  row 9000 would otherwise fail the run at the step that samples it): the file and first row are named;
- the run folder: not held by a live run, and holding no other run's records unless resumed or
  overwritten (``rlcore.trainer.run_folder``);
- ``trainer.resume``: a given checkpoint folder is a complete checkpoint;
- ``agent.path``: the file exists and defines the class.

Every problem found is listed in one ``PreflightError`` (a ``rlcore.errors.UserError``: the recipe's
command line prints it without a traceback, ``rlcore.trainer.cli``), so a user fixes every typo in one go;
a file, function or folder that does not exist comes with the closest name there is. ``build_workers`` calls it
first, and ``warm_start`` before it launches its SFT run, so every recipe gets it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from omegaconf import DictConfig, OmegaConf

from rlcore.data.dataset import first_record, read_records
from rlcore.data.verl_schema import is_verl_row
from rlcore.errors import DataError, UserError
from rlcore.models.config import ModelConfig
from rlcore.rewards.registry import get_reward_fn, reward_fn_for_source
from rlcore.registry import load_named
from rlcore.trainer.run_checkpoint import resolve_resume
from rlcore.trainer.run_folder import check_run_folder


class PreflightError(UserError, ValueError):
    """The problems found before start-up, one per line (``problems``: the lines)."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(problems[0] if len(problems) == 1 else
                         f"{len(problems)} problems found before start-up:\n{lines}")


def run_dir(cfg: DictConfig) -> Path:
    """The run folder ``<trainer.output_dir>/<trainer.project>/<trainer.run_name>``, absolute."""
    t = cfg.trainer
    return (Path(t.output_dir) / t.project / t.run_name).resolve()


def preflight(cfg: DictConfig) -> None:
    """Check what ``cfg`` names (module docstring); raise one ``PreflightError`` listing every problem."""
    problems: list[str] = []

    def check(what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - every problem is collected, then raised below
            problems.append(f"{what}: {exc}")
            return None

    if OmegaConf.select(cfg, "model.path") is not None:
        check("model.path", ModelConfig(path=cfg.model.path).require_local_dir)
    sources = _data_sources(cfg, check) if "data" in cfg else {}
    if "reward" in cfg:
        _check_reward(cfg, sources, check)
    if "trainer" in cfg:
        check("trainer.resume", lambda: resolve_resume(cfg.trainer.resume, run_dir(cfg) / "checkpoints"))
        check("run folder", lambda: check_run_folder(run_dir(cfg), cfg.trainer.resume, cfg.trainer.overwrite))
    if OmegaConf.select(cfg, "agent.path") is not None:
        check("agent.path", lambda: _check_agent(cfg.agent.path))
    if problems:
        raise PreflightError(problems)


def _check_agent(path: str) -> None:
    """``agent.path`` names a class with a ``run`` method (the driver imports it as its runners will; no
    import of the agentic layer, which needs Ray: the GPU image runs this pre-flight without it)."""
    if not callable(getattr(load_named(path, "agent"), "run", None)):
        where, _, name = path.rpartition(":")
        raise ValueError(f"{path!r}: no class {name!r} with a run(ctx) method in {where}")


def _data_sources(cfg: DictConfig, check: Callable) -> dict[str, tuple[str, int]]:
    """Every distinct ``data_source`` of the data files given, with the file and row that first names it
    (nothing for the generated tasks); every row's columns checked, the first bad row of a file named."""
    d = cfg.data
    sources: dict[str, tuple[str, int]] = {}
    for key in ("train_files", "val_files"):
        files = d.get(key)
        if files is None:
            continue
        for path in [files] if isinstance(files, str) else list(files):
            rows = check(f"data.{key}", lambda p=path: _read_rows(cfg, p))
            for i, row in enumerate(rows or []):
                if check(f"data.{key}", lambda p=path, r=row, i=i: _check_columns(cfg, r, p, i)) is None:
                    break  # the file's first bad row is named; the rest would repeat it
                if "data_source" in row:
                    sources.setdefault(str(row["data_source"]), (str(path), i))
    return sources


def _read_rows(cfg: DictConfig, path: str) -> list[dict]:
    """Every row of a data file, with the columns the checks read (of a parquet file only those: a verl
    file's other columns can be large). The first row is read first, so a bad format fails fast."""
    first_record(path)
    if str(path).endswith(".parquet"):
        d = cfg.data
        names = pq.read_schema(path).names
        wanted = [c for c in dict.fromkeys((d.prompt_key, d.answer_key, "data_source", "reward_model")) if c in names]
        return pq.read_table(path, columns=wanted).to_pylist()
    return read_records(path)[0]


def _check_columns(cfg: DictConfig, row: dict, path: str, index: int) -> bool:
    d = cfg.data
    if "reward_model" in cfg:  # the reward-model recipe reads (prompt, chosen, rejected) pairs
        wanted = [d.prompt_key]
    else:
        wanted = [d.prompt_key, "data_source"]
        if d.answer_key and not is_verl_row(row, d.answer_key):
            wanted.append(d.answer_key)
    missing = [k for k in wanted if k not in row]
    if missing:
        where = "the first row" if index == 0 else f"row {index}"
        raise DataError(f"{path}: column(s) {missing} missing in {where} (data.prompt_key / data.answer_key; "
                        f"a ground truth may also be verl's 'reward_model' column); columns present: {sorted(row)}")
    return True


def _check_reward(cfg: DictConfig, sources: dict[str, tuple[str, int]], check: Callable) -> None:
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
        for source, (path, row) in sources.items():
            if source not in by_source and reward_fn_for_source(source) is None:
                check("reward", lambda s=source, p=path, i=row: _no_reward_for(s, p, i))


def _no_reward_for(source: Any, path: str, row: int) -> None:
    raise ValueError(f"no reward function for the data's data_source {source!r} ({path}, first in row {row}): "
                     "set reward.reward_fn=<file.py>:<function> (or a registered name), or "
                     f"reward.reward_fn_by_source.{source}=<function>")
