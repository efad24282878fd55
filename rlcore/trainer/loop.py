"""TrainingRun: the bookkeeping around every recipe's loop, so that the recipe shows only its algorithm.

It owns the run folder ``<trainer.output_dir>/<trainer.project>/<trainer.run_name>/``::

    metrics.jsonl      one JSON object per logged step (the record plots are made from)
    tensorboard/       the same scalars for TensorBoard
    checkpoints/       global_step_N/{actor,critic}/ (worker state) + hf/ (the policy as a HF model)
                       + trainer_state.pt (driver state)
    hf/                the policy after the last step as a HF model (config, tokenizer, safetensors)
    hf_best/           the policy at the best validation score so far, with best.json (``trainer.keep_best``;
                       rlcore.trainer.best_val); val/best, val/best_step in metrics.jsonl
    trajectories/      step_N.jsonl: a few prompt groups of each step's batch, token by token
                       (``trainer.trajectory_groups``; rlcore.trainer.trajectories), for ``python -m rlcore.inspect``
    wandb/ mlruns/ trackio/   W&B (offline), MLflow and trackio records, when trainer.loggers names them; with
                       a completion table every trainer.completion_table.every steps (rlcore.trainer.completion_table)
    config.yaml        the resolved config, model.path filled in: what ``python -m rlcore.trainer.export``
                       rebuilds a checkpoint's model from
    run.lock           held (``flock``) for the run's life; holds its pid
    stalls/            step_N_<phase>.txt: what a phase past its watchdog deadline waited for, with stacks
    check.jsonl        the consistency check's verdict of every judged step, its warnings and notes
                       (rlcore.trainer.verdicts), for people and ``python -m rlcore.inspect``

A folder is one run's. A second live run in it fails at once, naming the holder's pid (the lock
goes with the process, however it ends). A folder holding an earlier run's records is refused too,
since new rows would be appended to the old ones, unless ``trainer.resume`` continues that run or
``trainer.overwrite=true`` deletes its records first.

and does, around the recipe's own work:
- seeding the driver (``trainer.seed``; ``trainer.deterministic``: torch's deterministic algorithms)
  and each prompt batch's sampling (``meta_info["seed"]``, from the seed and the batch's index, so a
  resumed run samples what an uninterrupted one did) and, with ``trainer.resume``, restoring a
  checkpoint: worker weights and optimizers, the rollout's copy of the weights, the loader position,
  the driver's RNG and every object the recipe registered in ``state`` (e.g. a KL controller). Rows an interrupted
  run logged after that checkpoint are dropped from metrics.jsonl, since those steps run again;
- validation before training, every ``trainer.val_freq`` steps and after the last step;
- per-step timing (``timing_s/<stage>`` from ``with run.timer("stage")``), tokens per second, and a
  checkpoint every ``trainer.save_freq`` steps;
- a watchdog (``trainer.watchdog``, ``rlcore.trainer.watchdog``): a stage or step running past its
  deadline names the stuck worker group, rank and method and writes stacks to ``<run>/stalls/``;
- with ``trainer.export_hf`` (default on), a HF model directory of the policy (the actor, a LoRA
  actor's adapters merged in; in a reward-model run, the reward model) in each checkpoint
  (``<ckpt>/hf``) and, after the last step, in the run folder (``<run>/hf``), which
  ``AutoModelForCausalLM.from_pretrained`` and vLLM load. Here, once, for every recipe;
- SIGTERM / SIGINT (``timeout``, schedulers, ctrl-C; ``rlcore.trainer.stop_signal``): a step still
  generating, scoring, computing log-probs, or in its first update before that update's first optimizer
  step, is abandoned and the step before it is checkpointed; a step past that finishes and is checkpointed (with ``save_freq: 0`` too; its ``hf/`` with ``export_hf``);
  then the process exits with 128 + the signal's number (143, 130); a second signal exits at once;
- teardown: used as a context manager (``with TrainingRun(...) as run:``) it closes the loggers and
  shuts the workers down however the block ends, after whatever the recipe handed to
  ``run.on_close`` (a producer thread, a second worker group), latest first.
"""

from __future__ import annotations

import contextlib
import copy
import random
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from rlcore.data.dataset import PromptLoader
from rlcore.engines.seeding import derive_seed, set_deterministic
from rlcore.protocol import DataProto
from rlcore.trainer.best_val import BestValidation
from rlcore.trainer.builder import Workers, prompts_to_proto
from rlcore.trainer.completion_table import CompletionTable
from rlcore.trainer.check_bands import expected_dtypes
from rlcore.trainer.consistency import ConsistencyCheck
from rlcore.trainer import prompt_format
from rlcore.trainer.probe_check import ProbeCheck, model_vocab_size
from rlcore.trainer.export import exported_role, save_run_config
from rlcore.trainer.run_checkpoint import (
    HF_DIR,
    STATE_FILE,
    capture_rng_state,
    find_latest_checkpoint,
    load_run_state,
    prune_checkpoints,
    resolve_resume,
    restore_rng_state,
    save_run_state,
)
from rlcore.trainer.process_memory import report_run_watch, start_run_watch
from rlcore.trainer.progress import phase
from rlcore.trainer.run_folder import RunFolderError, claim_run_folder  # noqa: F401 (RunFolderError: re-exported)
from rlcore.single_controller import abandon
from rlcore.trainer.stop_signal import (
    ABANDONABLE_STAGES,
    UPDATE_STAGES,
    RunStopped,
    StepAbandoned,
    StopSignals,
    abandon_workers,
    abandoned_call,
    drain_calls,
)
from rlcore.trainer.timing import Timer, throughput_metrics
from rlcore.trainer.tracking import Tracker, read_jsonl_metrics, truncate_jsonl_after
from rlcore.trainer.trajectories import TRAINER_LOG_PROB_KEYS, TRAJECTORY_DIR, TrajectoryWriter
from rlcore.trainer.verdicts import VerdictLog, judged
from rlcore.trainer.watchdog import Watchdog
from rlcore.workers.mismatch import read_check_config

CONSOLE_KEYS = (
    "reward/score/mean", "val/reward_mean", "response_length/mean", "actor/entropy", "actor/pg_clipfrac",
    "actor/kl_loss", "actor/reward_kl_penalty", "critic/vf_loss", "sft/nll", "rm/loss", "rm/accuracy",
    "val/pair_accuracy", "val/best", "check/logprob_abs_diff_mean", "timing_s/step",
)


def consistency_check(cfg: DictConfig, workers: Workers) -> ConsistencyCheck:
    """The run's ``trainer.check``; the weights of a hybrid rollout group are compared with the actor's,
    and both score the end-to-end probe (engine servers are added by their recipe: ``run.check.watch``)."""
    rollout, actor = workers.rollout, workers.trained.get("actor")
    engines = rollout.weight_checksums if rollout is not None else None
    probe = probe_check(cfg, actor, rollout.probe_log_probs) if rollout is not None else None
    expected, why = expected_dtypes(cfg)  # the band of the configured dtype pair (rlcore.trainer.check_bands)
    return ConsistencyCheck(read_check_config(cfg), actor, engines, probe=probe, expected=expected, why=why)


def probe_check(cfg: DictConfig, actor: Any, engines: Callable[[list[int]], list]) -> ProbeCheck | None:
    """The end-to-end probe (``rlcore.trainer.probe_check``) between ``actor`` and ``engines(ids)``, over
    the model's vocabulary; None without an actor, or with ``trainer.check.probe=false``."""
    if actor is None or not read_check_config(cfg).probe:
        return None
    return ProbeCheck(actor.probe_log_probs, engines, lambda: model_vocab_size(cfg.model.path))


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
        self.watchdog = Watchdog(t.watchdog, self.dir / "stalls")  # every timed stage (and step) has a deadline
        self.timer = Timer(watch=(self._stage_begins, self.watchdog.end))
        self.check = consistency_check(cfg, workers)  # trainer vs sampler, every step (docs/correctness.md)
        self.verdicts: VerdictLog | None = None  # <run>/check.jsonl, once the start step is known (_start)
        self.last_val: dict[str, float] = {}
        self._failed = False  # the run's block ended by an exception
        self._exported_at: int | None = None  # the step of the last checkpoint this run exported
        self._teardown = contextlib.ExitStack()
        try:
            lock = claim_run_folder(self.dir, t.resume, t.overwrite)
        except BaseException:
            workers.shutdown()  # stops the builder's memory watch too: no run will report it
            raise
        self._teardown.callback(lock.close)  # released last
        self._teardown.callback(workers.shutdown)
        self._teardown.callback(self.watchdog.close)
        # the run's processes' PSS: the builder's watch, or one of its own for workers built another way
        self.memory = workers.memory or start_run_watch(t.memory_watch_s)
        self._teardown.callback(report_run_watch, self.memory, self.dir)  # its end line and <run>/memory.json
        try:
            self._start(t)
        except BaseException:
            self.close()
            raise
        self._batches = iter(loader)
        self._step_start = time.perf_counter()
        # SIGTERM / SIGINT: abandon the step while it changed nothing yet, else finish it; checkpoint; exit 128 + signum
        self._abandonable = False  # the step under way has not begun changing state (rlcore.trainer.stop_signal)
        self._can_abandon = True  # False once prompts are drawn ahead of the steps (a producer thread)
        self._step_began: dict[str, Any] | None = None  # loader, RNG and state as the step under way found them
        self._step = 0
        self._validating = False  # a validation's generation: abandoned too (the step it follows is saved)
        self._updating = False  # in the step's first update: abandonable until its first optimizer step
        self._stop = StopSignals(lambda: (self._abandonable or self._validating) and self._can_abandon,
                                 lambda: self._stop.missed.extend(abandon_workers()),
                                 lambda: "update (unless it made an optimizer step)" if self._updating else "generation")
        self._stop.install()
        self._teardown.callback(self._stop.restore)
        self._saved_at: int | None = None  # the step of this run's latest checkpoint

    def _start(self, t: DictConfig) -> None:
        random.seed(t.seed)
        np.random.seed(t.seed)
        torch.manual_seed(t.seed)
        # The driver's own process (in-process workers live here too); the device only decides the CUDA settings.
        set_deterministic(t.deterministic, "cuda" if torch.cuda.is_available() else "cpu")
        self.start_step = self._resume()
        self.check.calibrate()  # the engine holds the trainer's weights now: the probe measures the run's noise
        # Rows logged after the checkpoint (all of them when starting from step 0) are logged again.
        truncate_jsonl_after(self.dir / "metrics.jsonl", self.start_step if self.start_step else -1)
        keep = t.keep_best and t.export_hf  # <run>/hf_best: rlcore.trainer.best_val
        self.best = BestValidation(self.dir, self._export_best if keep else None)
        self.best.resume(read_jsonl_metrics(self.dir / "metrics.jsonl") if self.start_step else [])
        self.tracker = Tracker(list(t.loggers), project=t.project, experiment=t.run_name, log_dir=self.dir,
                               config=self.cfg, total_steps=t.total_steps, console_keys=CONSOLE_KEYS)  # + a progress bar
        self._teardown.callback(lambda: self.tracker.close(failed=self._failed))
        save_run_config(self.cfg, self.dir)
        self.verdicts = VerdictLog(self.dir, self.start_step)  # rows of the steps run again are dropped
        self.check.record = self.verdicts  # the check's warnings and notes are kept there too
        source = OmegaConf.select(self.cfg, "env.name") or OmegaConf.select(self.cfg, "agent.path")  # episodes' rows
        self.trajectories = TrajectoryWriter(self.dir / TRAJECTORY_DIR, t.trajectory_groups,
                                             OmegaConf.select(self.cfg, "model.path"), self.start_step, source)
        table = t.get("completion_table") or {}
        self.completions = CompletionTable(table.get("every", 10), table.get("rows", 16), self.tracker,
                                           self.trajectories.token_pieces, source)

    # ------------------------------------------------------------------ the loop
    def steps(self) -> Iterator[int]:
        """Step numbers still to run (1-based), after validating the starting model when asked."""
        t = self.cfg.trainer
        if self.start_step == 0 and t.val_before_train and t.val_freq:
            phase("validating the starting model (step 0; the first generate also warms the engine up)")
            val = self.validate()
            self.tracker.log({**val, **self.best.observe(0, val)}, step=0)
        self.check.start(self.start_step)  # the weights engines start from: what a missed sync leaves them holding
        phase(f"training: steps {self.start_step + 1} to {t.total_steps}")
        for step in range(self.start_step + 1, t.total_steps + 1):
            self._stop_if_asked(step - 1)
            self._step = step
            self._step_began = {"loader": self.loader.state_dict(), "rng": capture_rng_state(),
                                **{k: copy.deepcopy(v.state_dict()) for k, v in self.state.items()}}
            self._abandonable = True
            self.timer.reset()
            self._step_start = time.perf_counter()
            self.watchdog.step = step
            watched = self.watchdog.begin("step")
            yield step
            self.watchdog.end(watched)
        self.export_final()
        if said := self.best.summary():
            print(said, flush=True)

    def next_prompts(self) -> DataProto:
        """The next training batch of prompts (the loader repeats the data for as long as needed), with
        ``meta_info["seed"]``, its sampling seed: derived from ``trainer.seed`` and the batch's index in
        the run (from the loader's position, which checkpoints restore), not drawn from an RNG whose
        state a resume would have to replay."""
        if threading.current_thread() is not threading.main_thread():
            self._can_abandon = False  # drawn ahead by a producer: a step's start is not its data position
        position = self.loader.state_dict()
        index = position["epoch"] * len(self.loader) + position["position"]
        tensors, non_tensors = next(self._batches)
        return prompts_to_proto(tensors, non_tensors, {"seed": derive_seed(self.cfg.trainer.seed, index)})

    def validate(self) -> dict[str, float]:
        with self.timer("validate"):
            self._validating = True
            try:
                self.last_val = self._validate()
            finally:
                self._validating = False
        return self.last_val

    def end_step(self, step: int, metrics: Mapping[str, float], batch: DataProto | None = None) -> None:
        """Validate and checkpoint when due, then log ``metrics`` plus timings and throughput."""
        t = self.cfg.trainer
        self._update_returned()
        self._abandonable = False  # the step's work is done: it is saved, not abandoned
        out = dict(metrics)
        if t.val_freq and (step % t.val_freq == 0 or step == t.total_steps):
            try:
                val = self.validate()
                out.update({**val, **self.best.observe(step, val)})
            except Exception:
                if not self._stop.asked:  # the workers, asked to abandon, refuse new generations
                    raise
                drain_calls()  # a stop signal gave the validation up: the step is saved and logged without it
                print(f"validation after step {step} abandoned: its val/ metrics are not logged", flush=True)
        if t.save_freq and step % t.save_freq == 0:
            with self.timer("save_checkpoint"):
                self.save(step)
        start = time.perf_counter()
        self.trajectories.write(step, batch, self.sampled_log_probs(batch))
        self.completions.log(step, batch)  # every trainer.completion_table.every steps
        out["timing_s/trajectories"] = time.perf_counter() - start  # timed apart: no "throughput/" key for it
        with self.timer("check"):
            self.verdicts.begin(step, out)
            out.update(self.check.after_step(step, out))
            if judged(self.check.cfg.enable, out):  # every judged step leaves a verdict row: ok or its cause
                self.verdicts.verdict(step, out)
        out.update(self.balance_metrics())
        out.update(self.memory.metrics() if self.memory else {})
        out.update(self.timer.metrics())
        out["timing_s/step"] = time.perf_counter() - self._step_start
        if batch is not None:
            tokens = int(batch.batch["attention_mask"].sum())
            out.update(throughput_metrics(self.timer.durations, tokens))
            out["throughput/step"] = tokens / out["timing_s/step"]
        self.tracker.log(out, step=step)
        self._stop_if_asked(step)

    def sampled_log_probs(self, batch: DataProto | None) -> list[dict] | None:
        """The trainer's log-probs of the trajectory sample's rows from a single-step update's own
        forward (``rlcore.workers.sampled_rows``), when the sample is on and the batch has the sampler's
        log-probs but none of the trainer's (an SFT batch has neither: nothing is asked)."""
        actor = self.workers.trained.get("actor")
        if actor is None or not self.trajectories.wants(batch):
            return None
        have = batch.batch.keys()
        if "rollout_log_probs" not in have or any(k in have for k in TRAINER_LOG_PROB_KEYS):
            return None
        return [row for rank in actor.take_sampled_log_probs() for row in rank]

    def _stage_begins(self, name: str) -> object:
        """A timed stage begins (the phase boundaries where a stop signal can end a step): a step being
        abandoned stops here; the first stage that changes state (an update past its first optimizer step,
        sync, ...) ends the part of the step that can be abandoned. The step's first update stays abandonable
        while it runs: its workers decide (``rlcore.workers.update_stop``), told they may (``permit_update``)."""
        self._update_returned()
        if self._abandonable and self._stop.requested and self._can_abandon:
            # a signal that came while nothing was abandonable (between the loop's last check and this
            # step's start) finds the step not begun: given up too, the step before it is what is saved
            self._stop.abandoning = True
            raise StepAbandoned()
        if name in UPDATE_STAGES and self._abandonable:
            self._updating = True
        elif name not in ABANDONABLE_STAGES:
            self._abandonable = False
        abandon.permit_update(self._updating and self._can_abandon)
        return self.watchdog.begin(name)

    def _update_returned(self) -> None:
        """The step's first update, begun earlier, returned (it was not given up): it made an optimizer
        step, so the step is no longer abandonable; one a stop signal was giving up is finished and saved."""
        if not self._updating:
            return
        self._updating = self._abandonable = False
        abandon.permit_update(False)
        if self._stop.abandoning:
            self._stop.abandoning = False
            print(f"step {self._step}'s update had made an optimizer step: finishing the step and saving it "
                  f"({self._stop.since()})", flush=True)

    def _abandon_step(self, error: BaseException) -> None:
        """After a stop signal gave up the step under way: let the workers' abandoned calls end, checkpoint
        the step before it as it was when this one began, and exit with 128 + the signal's number."""
        step, self._abandonable = self._step - 1, False
        if not isinstance(error, StepAbandoned) and not abandoned_call(error):
            print(f"(while abandoning step {self._step}: {type(error).__name__}: {str(error)[:300]})", flush=True)
        late = drain_calls()
        done = f"abandoned calls ended {self._stop.since()}"
        failed_update = self._updating and not abandoned_call(error)  # it may have stepped, then failed
        self._updating = False  # given up, not returned: the save's own stage must not read it as finished
        if late or failed_update:
            print(f"{'calls still running' if late else 'the update failed'} after the stop, so nothing new is saved: "
                  f"{late or type(error).__name__}", flush=True)
        elif step > self.start_step and self._saved_at != step:
            restore_rng_state(self._step_began["rng"])  # in-process workers save this process's RNG too
            with self.timer("save_checkpoint"):
                self.save(step, self._step_began)
            done += f"; saved {self._stop.since()}"
        print(done, flush=True)
        missed = "".join(f"; {m}" for m in self._stop.missed)
        found = find_latest_checkpoint(self.ckpt_dir)
        where = (f"checkpoint {found[1]} (step {found[0]}): continue with trainer.resume=auto, or export it with "
                 f"python -m rlcore.trainer.export {found[1]}" if found else "no step finished, nothing saved")
        print(f"stopped by {signal.Signals(self._stop.signum).name} during step {self._step} (abandoned){missed}; "
              f"{where}", flush=True)
        raise RunStopped(self._stop.exit_code()) from None

    def _stop_if_asked(self, step: int) -> None:
        """After a stop signal (``rlcore.trainer.stop_signal``): checkpoint ``step``, the last finished one
        (unless saved already, or none finished), and exit with 128 + the signal's number."""
        if not self._stop.requested:
            return
        if step > self.start_step and self._saved_at != step:
            with self.timer("save_checkpoint"):
                self.save(step)
            print(f"saved {self._stop.since()}", flush=True)
        found = find_latest_checkpoint(self.ckpt_dir)
        where = (f"checkpoint {found[1]} (step {found[0]}): continue with trainer.resume=auto, or export it with "
                 f"python -m rlcore.trainer.export {found[1]}" if found else "no step finished, nothing saved")
        print(f"stopped by {signal.Signals(self._stop.signum).name} after step {step}; {where}", flush=True)
        raise RunStopped(self._stop.exit_code())

    def balance_metrics(self) -> dict[str, float]:
        """``balance/<role>/tokens_max_min_{before,after}``: max over min of the tokens per DP rank in
        this step's last balanced call of each trained role (its update), for the plain contiguous
        split and for the split used (the same with ``trainer.balance_batch=false``). 1 is perfect;
        the step waits for the heaviest rank. Nothing with one rank."""
        out = {}
        for role, group in self.workers.trained.items():
            stats, group.last_balance = group.last_balance, None
            if stats:
                for when in ("before", "after"):
                    lo = max(stats[f"tokens_min_{when}"], 1)
                    out[f"balance/{role}/tokens_max_min_{when}"] = stats[f"tokens_max_{when}"] / lo
        return out

    # ------------------------------------------------------------------ teardown
    def __enter__(self) -> "TrainingRun":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        abandoned = exc is not None and self._stop.abandoning and isinstance(exc, (StepAbandoned, Exception))
        self._failed = exc_type is not None and not issubclass(exc_type, RunStopped) and not abandoned  # W&B / MLflow
        try:
            if abandoned:
                self._abandon_step(exc)
        finally:
            self.close()

    def on_close(self, callback: Callable[[], Any]) -> None:
        """Call ``callback`` when the run closes, before the loggers and workers (latest first)."""
        self._teardown.callback(callback)

    def close(self) -> None:
        """Run the ``on_close`` callbacks, close the loggers, shut the workers down. Idempotent."""
        self._teardown.close()

    # ------------------------------------------------------------------ checkpoints
    def save(self, step: int, began: Mapping[str, Any] | None = None) -> None:
        """Checkpoint ``step``: the workers' state now, and the driver's (loader position, RNG, ``state``)
        now or, from an abandoned step, as ``began`` recorded them when it began. A checkpoint of the
        same step already there is unmarked first: a save cut short never leaves a marker on mixed files."""
        step_dir = self.ckpt_dir / f"global_step_{step}"
        (step_dir / STATE_FILE).unlink(missing_ok=True)
        for role, group in self.workers.trained.items():
            group.save_checkpoint(str(step_dir / role))
        if self.cfg.trainer.export_hf:
            with self.timer("export_hf"):
                if self.export_hf(step_dir / HF_DIR, what="checkpoint"):  # before the marker: part of the checkpoint
                    self._exported_at = step
        if began is None:
            state = {"loader": self.loader.state_dict(), **{k: v.state_dict() for k, v in self.state.items()}}
            rng = None
        else:
            state, rng = {k: v for k, v in began.items() if k != "rng"}, began["rng"]
        save_run_state(self.ckpt_dir, step, state, rng=rng)  # written last: marks the checkpoint complete
        self._saved_at = step
        if self.cfg.trainer.max_ckpt_to_keep:
            prune_checkpoints(self.ckpt_dir, self.cfg.trainer.max_ckpt_to_keep)

    def export_hf(self, out: Path, what: str = "HF export") -> bool:
        """Write the exported role's weights as a HF directory at ``out`` (replacing one there); False
        when the run trains no role that exports. A failure names ``out``."""
        role = exported_role(self.workers.trained)
        if role is None:
            return False
        shutil.rmtree(out, ignore_errors=True)  # no stale files of an earlier export beside the new ones
        try:
            getattr(self.workers, role).export_hf(str(out))
        except Exception as exc:
            cause = exc.__cause__ or exc
            kind = OSError if isinstance(cause, OSError) else RuntimeError
            raise kind(f"writing {what} {out} failed (the {role} as a HF model): {type(cause).__name__}: "
                       f"{cause}") from exc
        try:
            prompt_format.record(self.cfg, out)  # evaluate renders prompts as this run did
        except (OSError, ValueError) as exc:  # no tokenizer there (another node's disk): the run's config.yaml says
            print(f"warning: no {prompt_format.RECORD} in {out}: {exc}", flush=True)
        return True

    def _export_best(self, out: Path) -> bool:
        with self.timer("keep_best"):
            return self.export_hf(out, what="best export")

    def export_final(self) -> None:
        """``<run>/hf`` after the last step (``trainer.export_hf``): a copy of the last checkpoint's export
        when that checkpoint is of the last step, else an export of the workers' weights."""
        if not self.cfg.trainer.export_hf or exported_role(self.workers.trained) is None:
            return
        out = self.dir / HF_DIR
        last = self.ckpt_dir / f"global_step_{self.cfg.trainer.total_steps}" / HF_DIR
        if self._exported_at == self.cfg.trainer.total_steps and last.is_dir():  # saved by this run, at the last step
            shutil.rmtree(out, ignore_errors=True)
            shutil.copytree(last, out)
        else:
            self.export_hf(out)
        print(f"exported the trained model to {out}", flush=True)

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
