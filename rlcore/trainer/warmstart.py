"""The RL recipes' default starting policy: the SFT recipe, run briefly on the RL run's data.

Why: RL from a random tiny model learns nothing (it is never right, so every reward is 0); a
policy that is sometimes right (10-20% greedy on the arithmetic task after 60 SFT steps) gives
the advantages something to work with. A fixed budget (``warmstart.steps``) rather than "until
validation reaches x": the 80-prompt validation is noisy, and stopping on it picked warm starts
of quite different maturity.

How: ``python -m <warmstart.recipe>`` (``recipes.sft``) runs as a command of its own, with the RL
run's ``data`` section and the step budget as overrides, in this process's device but one
in-process rank (``trainer.backend=local``: no Ray cluster is shared or started for it). Running
the recipe as a command keeps the trainer layer free of any import of a recipe. The result is
cached under ``warmstart.dir/<key>``, the key a hash of what it is trained on (recipe, steps,
data); a ``warmstart.json`` marker, written last, marks it complete, and a file lock makes two
runs started together build it once. A change to the SFT recipe's own defaults needs a new
``warmstart.dir`` (or the old cache deleted).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlcore.trainer.preflight import preflight
from rlcore.trainer.progress import phase


def warm_start(cfg: DictConfig) -> str:
    """The HF directory of the warm-started policy for this run's data, built on first use."""
    preflight(cfg)  # the run's own paths, before the SFT run: a typo should not wait for it
    w = cfg.warmstart
    data = OmegaConf.to_container(cfg.data, resolve=True)
    what = {"recipe": w.recipe, "steps": w.steps, "data": data}
    if w.arch != "llama":  # the default arch stays out of the key: caches built before it keep theirs
        what["arch"] = w.arch
    key = hashlib.sha1(json.dumps(what, sort_keys=True).encode()).hexdigest()[:10]
    folder = Path(w.dir).resolve() / key
    marker = folder / "warmstart.json"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two recipes started together build it once
        if not marker.exists():
            shutil.rmtree(folder, ignore_errors=True)  # a build that died midway left no marker
            phase(f"warm start: {w.steps} steps of {w.recipe} -> {folder}")
            start = time.perf_counter()
            _run_recipe(cfg, folder, data)
            run_dir = folder / "sft" / "run"
            val = [row for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
                   if "val/reward_mean" in row]
            info = {"model_dir": str(run_dir / "hf"), "val_reward": val[-1]["val/reward_mean"],
                    "seconds": round(time.perf_counter() - start, 1)}
            marker.write_text(json.dumps(info) + "\n")  # last: marks the warm start complete
    info = json.loads(marker.read_text())
    print(f"warm start: {info['model_dir']} (greedy val reward {info['val_reward']:.3f})", flush=True)
    return info["model_dir"]


def _run_recipe(cfg: DictConfig, folder: Path, data: dict[str, Any]) -> None:
    t = cfg.trainer
    overrides = [
        f"trainer.total_steps={cfg.warmstart.steps}", f"trainer.output_dir={_value(str(folder))}",
        "trainer.project=sft", "trainer.run_name=run", "trainer.save_freq=0", "trainer.resume=disable",
        "trainer.export_hf=true",  # <run>/hf is the warm start
        "trainer.loggers=[jsonl]", "trainer.backend=local", f"trainer.device={t.device}",
        f"trainer.cpus_per_proc={t.cpus_per_proc}", f"tiny_model.arch={_value(cfg.warmstart.arch)}",
        *_overrides("data", data),
    ]
    log = folder / "warmstart.log"
    folder.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.run([sys.executable, "-m", cfg.warmstart.recipe, *overrides], stdout=out,
                              stderr=subprocess.STDOUT, timeout=cfg.warmstart.timeout_s, env=_child_env())
    if proc.returncode:
        tail = "\n".join(log.read_text().splitlines()[-25:])
        raise RuntimeError(f"the warm start ({cfg.warmstart.recipe}) failed with exit code {proc.returncode}; "
                           f"its log {log} ends:\n{tail}")


def _child_env() -> dict[str, str]:
    """This environment, with the import path this process has, so the child finds the recipes."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([os.getcwd(), *filter(None, sys.path),
                                                       env.get("PYTHONPATH", "")]))
    return env


def _overrides(prefix: str, node: Any) -> list[str]:
    """Hydra ``key=value`` overrides for every leaf of a nested mapping."""
    if isinstance(node, dict):
        return [o for k, v in node.items() for o in _overrides(f"{prefix}.{k}", v)]
    return [f"{prefix}={_value(node)}"]


def _value(value: Any) -> str:
    """A value in Hydra's override grammar: strings quoted, lists bracketed, None as null."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_value(v)}" for k, v in value.items()) + "}"
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"
