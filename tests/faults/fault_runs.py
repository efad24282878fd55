"""Short real recipe runs for the fault tests: the recipes' own YAML composed by Hydra with overrides
that make a run a few seconds (the suite's tiny model, 2 prompts x 2 samples a step, 3 new tokens)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

import recipes.grpo
from rlcore.trainer.tracking import read_jsonl_metrics
from rlcore.trainer.jsonl_rows import without_machine_metrics

CONFIG_DIR = Path(recipes.grpo.__file__).parent / "config"
REPO = CONFIG_DIR.parent.parent

# No reference model (no KL loss): one model fewer to build per run; 1 CPU thread per rank.
SHORT = ["trainer.loggers=[jsonl]", "trainer.total_steps=2", "trainer.val_freq=0", "trainer.save_freq=0",
         "trainer.cpus_per_proc=1", "data.train_batch_size=2", "data.arithmetic.n_train=8",
         "data.arithmetic.n_val=2", "rollout.n=2", "rollout.max_new_tokens=3",
         "actor.ppo_micro_batch_size_per_gpu=4", "actor.use_kl_loss=false"]


def overrides(model: str, output_dir: Path, *more: str) -> list[str]:
    return [f"model.path={model}", f"trainer.output_dir={output_dir}", *SHORT, *more]


def config(name: str, model: str, output_dir: Path, *more: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(name, overrides=overrides(model, output_dir, *more))


def last_line(message: str) -> str:
    """The last line of an error message (a remote traceback's exception line), without terminal colours."""
    lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", message).splitlines() if line.strip()]
    return lines[-1] if lines else ""


def comparable(run_dir: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock keys."""
    rows = read_jsonl_metrics(Path(run_dir) / "metrics.jsonl")
    return without_machine_metrics(rows)


def recipe_process(name: str, args: list[str], log: Path) -> subprocess.Popen:
    """``python -m recipes.<name> <args>`` in its own process group, output to ``log``."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", f"recipes.{name}", *args], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process and anything it started; reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def wait_until(predicate, timeout_s: float, proc: subprocess.Popen | None = None, poll_s: float = 0.001,
               what: str = "the condition", log: Path | None = None):
    """Poll ``predicate`` (tightly) until it returns a true value, which is returned; fail on timeout or when
    ``proc`` exits first."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-3000:] if log else ""
            raise AssertionError(f"the process exited (rc {proc.returncode}) before {what}:\n{tail}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s}s")
        time.sleep(poll_s)
