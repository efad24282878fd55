"""TrainingRun: the bookkeeping around every recipe's loop, so that the recipe shows only its algorithm.

It owns the run folder ``<trainer.output_dir>/<trainer.project>/<trainer.run_name>/``::

    metrics.jsonl      one JSON object per logged step (the record plots are made from)
    tensorboard/       the same scalars for TensorBoard
    checkpoints/       global_step_N/{actor,critic}/ (worker state) + trainer_state.pt (driver state)

and does, around the recipe's own work:
- seeding the driver (``trainer.seed``) and, with ``trainer.resume``, restoring a checkpoint: worker
  weights and optimizers, the rollout's copy of the weights, the loader position, the driver's RNG
  and every object the recipe registered in ``state`` (e.g. a KL controller). Rows an interrupted
  run logged after that checkpoint are dropped from metrics.jsonl, since those steps run again;
- validation before training, every ``trainer.val_freq`` steps and after the last step;
- per-step timing (``timing_s/<stage>`` from ``with run.timer("stage")``), tokens per second, and a
  checkpoint every ``trainer.save_freq`` steps;
- teardown: used as a context manager (``with TrainingRun(...) as run:``) it closes the loggers and
  shuts the workers down however the block ends, after whatever the recipe handed to
  ``run.on_close`` (a producer thread, a second worker group), latest first.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from omegaconf import DictConfig

from rlcore.data.dataset import PromptLoader
from rlcore.protocol import DataProto
from rlcore.trainer.builder import Workers, prompts_to_proto
from rlcore.trainer.run_checkpoint import (
    load_run_state,
    prune_checkpoints,
    resolve_resume,
    restore_rng_state,
    save_run_state,
)
from rlcore.trainer.timing import Timer, throughput_metrics
from rlcore.trainer.tracking import Tracker, truncate_jsonl_after

CONSOLE_KEYS = (
    "critic/score/mean", "val/reward_mean", "response_length/mean", "actor/entropy", "actor/pg_clipfrac",
    "actor/kl_loss", "actor/reward_kl_penalty", "critic/vf_loss", "sft/nll", "timing_s/step",
)


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class TrainingRun:
    def __init__(self, cfg: DictConfig, workers: Workers, loader: PromptLoader, validate: Callable[[], dict[str, float]],
                 state: Mapping[str, Stateful] | None = None) -> None:
        t = cfg.trainer
        self.cfg, self.workers, self.loader, self._validate = cfg, workers, loader, validate
        self.state = dict(state or {})
        self.dir = (Path(t.output_dir) / t.project / t.run_name).resolve()
        self.ckpt_dir = self.dir / "checkpoints"
        self.timer = Timer()
        self.last_val: dict[str, float] = {}
        random.seed(t.seed)
        np.random.seed(t.seed)
        torch.manual_seed(t.seed)
        self.start_step = self._resume()
        if self.start_step:
            truncate_jsonl_after(self.dir / "metrics.jsonl", self.start_step)
        self._teardown = contextlib.ExitStack()
        self._teardown.callback(workers.shutdown)
        self.tracker = Tracker(list(t.loggers), project=t.project, experiment=t.run_name, log_dir=self.dir, config=cfg,
                               total_steps=t.total_steps, console_keys=CONSOLE_KEYS)  # + a progress bar
        self._teardown.callback(self.tracker.close)
        self._batches = iter(loader)
        self._step_start = time.perf_counter()

    # ------------------------------------------------------------------ the loop
    def steps(self) -> Iterator[int]:
        """Step numbers still to run (1-based), after validating the starting model when asked."""
        t = self.cfg.trainer
        if self.start_step == 0 and t.val_before_train and t.val_freq:
            self.tracker.log(self.validate(), step=0)
        for step in range(self.start_step + 1, t.total_steps + 1):
            self.timer.reset()
            self._step_start = time.perf_counter()
            yield step

    def next_prompts(self) -> DataProto:
        """The next training batch of prompts (the loader repeats the data for as long as needed)."""
        tensors, non_tensors = next(self._batches)
        return prompts_to_proto(tensors, non_tensors)

    def validate(self) -> dict[str, float]:
        with self.timer("validate"):
            self.last_val = self._validate()
        return self.last_val

    def end_step(self, step: int, metrics: Mapping[str, float], batch: DataProto | None = None) -> None:
        """Validate and checkpoint when due, then log ``metrics`` plus timings and throughput."""
        t = self.cfg.trainer
        out = dict(metrics)
        if t.val_freq and (step % t.val_freq == 0 or step == t.total_steps):
            out.update(self.validate())
        if t.save_freq and step % t.save_freq == 0:
            with self.timer("save_checkpoint"):
                self.save(step)
        out.update(self.timer.metrics())
        out["timing_s/step"] = time.perf_counter() - self._step_start
        if batch is not None:
            tokens = int(batch.batch["attention_mask"].sum())
            out.update(throughput_metrics(self.timer.durations, tokens))
            out["throughput/step"] = tokens / out["timing_s/step"]
        self.tracker.log(out, step=step)

    # ------------------------------------------------------------------ teardown
    def __enter__(self) -> "TrainingRun":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def on_close(self, callback: Callable[[], Any]) -> None:
        """Call ``callback`` when the run closes, before the loggers and workers (latest first)."""
        self._teardown.callback(callback)

    def close(self) -> None:
        """Run the ``on_close`` callbacks, close the loggers, shut the workers down. Idempotent."""
        self._teardown.close()

    # ------------------------------------------------------------------ checkpoints
    def save(self, step: int) -> None:
        step_dir = self.ckpt_dir / f"global_step_{step}"
        for role, group in self.workers.trained.items():
            group.save_checkpoint(str(step_dir / role))
        state = {"loader": self.loader.state_dict(), **{k: v.state_dict() for k, v in self.state.items()}}
        save_run_state(self.ckpt_dir, step, state)  # written last: marks the checkpoint complete
        if self.cfg.trainer.max_ckpt_to_keep:
            prune_checkpoints(self.ckpt_dir, self.cfg.trainer.max_ckpt_to_keep)

    def _resume(self) -> int:
        found = resolve_resume(self.cfg.trainer.resume, self.ckpt_dir)
        if found is None:
            return 0
        step, folder = found
        for role, group in self.workers.trained.items():
            group.load_checkpoint(str(folder / role))
        if self.workers.rollout is not None:
            self.workers.rollout.sync_weights()
        state: dict[str, Any] = load_run_state(folder)
        self.loader.load_state_dict(state["loader"])
        for key, obj in self.state.items():
            obj.load_state_dict(state[key])
        restore_rng_state(state["rng"])
        print(f"resumed from {folder} (step {step})", flush=True)
        return step
