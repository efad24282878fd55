"""A sharded checkpoint as a HF model directory, and the run record that makes that possible.

    python -m rlcore.trainer.export <run>/checkpoints/global_step_N [--out DIR]

Why: a checkpoint (``rlcore.trainer.run_checkpoint``) holds the trained parameters as
torch.distributed.checkpoint shards plus optimizer state, which only this framework reads back.
Runs with ``trainer.export_hf=true`` (the default) already leave ``<ckpt>/hf`` and ``<run>/hf``
(``TrainingRun``); this rebuilds the same directory from a checkpoint written without it, or
before it existed.

How: the checkpoint alone does not say which model it is. A sharded checkpoint holds only the
parameters that train, so a LoRA actor's holds its adapters and an actor with
``actor.freeze_router`` lacks its routers: those come from the model the run started from, and
the architecture and tokenizer too. The run folder says which: ``TrainingRun`` records the
resolved config, ``model.path`` filled in, as ``<run>/config.yaml`` (``save_run_config``). For
an older run the config Hydra wrote (``<run>/hydra/config.yaml``) is read instead; its
``model.path`` may be null, the recipe's built-in start: SFT's fresh tiny model
(``<run>/init_model``) or the RL recipes' warm start (``rlcore.trainer.warmstart``, taken from
its cache, built again only if that is gone). ``--config`` and ``--model-path`` override both.

The worker is then built in this process exactly as the run built it (the same class and
sections, one rank on ``--device``), its trainable parameters loaded from the shards (the
optimizer state is not read), and its own ``export_hf`` writes the directory: the tensors equal
those of an export taken during the run. The exported role is the actor (a LoRA actor's adapters
merged in); in a reward-model run, the reward model (``AutoModelForSequenceClassification``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlcore.errors import UserError
from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup
from rlcore.trainer import prompt_format
from rlcore.trainer.run_checkpoint import HF_DIR, STATE_FILE, find_latest_checkpoint
from rlcore.trainer.warmstart import warm_start
from rlcore.workers import fsdp_utils
from rlcore.workers.actor import ActorWorker
from rlcore.workers.reward_model import RewardModelWorker

RUN_CONFIG = "config.yaml"  # in the run folder: the config the run trains with, model.path resolved
HYDRA_CONFIG = Path("hydra") / "config.yaml"  # what Hydra writes there (recipes' ``hydra.output_subdir``)
EXPORTED_ROLES = ("actor", "rm")  # the first one a run trains is exported: the policy, else the reward model


class NotACheckpointError(UserError, FileNotFoundError):
    """The path given is not a complete checkpoint, or lacks what the export needs."""


def exported_role(trained: Mapping[str, Any] | Sequence[str]) -> str | None:
    """The role whose weights a run exports, among the roles it trains (None: nothing to export)."""
    return next((role for role in EXPORTED_ROLES if role in trained), None)


def save_run_config(cfg: DictConfig | Mapping, run_dir: Path) -> Path:
    """Write ``cfg`` (resolved; a relative local ``model.path`` made absolute) to ``<run_dir>/config.yaml``."""
    plain = OmegaConf.to_container(cfg if isinstance(cfg, DictConfig) else OmegaConf.create(dict(cfg)), resolve=True)
    path = (plain.get("model") or {}).get("path")
    if path and os.path.isdir(path):
        plain["model"]["path"] = os.path.abspath(path)
    out = Path(run_dir) / RUN_CONFIG
    tmp = out.with_name(out.name + ".tmp")
    OmegaConf.save(OmegaConf.create(plain), tmp)
    os.replace(tmp, out)
    return out


def resolve_checkpoint(path: str | Path) -> Path:
    """The step folder of ``path``: a ``global_step_N`` folder, or the newest complete one in a run's
    ``checkpoints/`` folder or in the run folder itself."""
    path = Path(path)
    if (path / STATE_FILE).is_file():
        return path
    for ckpt_dir in (path, path / "checkpoints"):
        found = find_latest_checkpoint(ckpt_dir)
        if found:
            return found[1]
    why = "does not exist" if not path.exists() else f"holds no {STATE_FILE} and no complete global_step_N folder"
    raise NotACheckpointError(f"{path} is not a checkpoint: it {why}. Give a run's checkpoints/global_step_N folder "
                              f"(complete ones hold {STATE_FILE}), its checkpoints/ folder or the run folder")


def load_checkpoint_config(step_dir: Path, config: str | Path | None = None) -> tuple[dict, Path]:
    """The run's config as a plain dict, and the file it came from (see the module docstring)."""
    run_dir = step_dir.parent.parent
    candidates = [Path(config)] if config else [run_dir / RUN_CONFIG, run_dir / HYDRA_CONFIG]
    for file in candidates:
        if file.is_file():
            return OmegaConf.to_container(OmegaConf.load(file), resolve=True), file
    raise NotACheckpointError(f"no run config for checkpoint {step_dir}: looked for "
                              f"{' and '.join(str(c) for c in candidates)}. Give the run's config with --config")


def starting_model(config: dict, run_dir: Path, source: Path) -> str:
    """The model directory the run started from: ``model.path``, else the recipe's built-in start."""
    path = (config.get("model") or {}).get("path")
    if path:
        return path
    if (run_dir / "init_model" / "config.json").is_file():  # recipes/sft.py's fresh tiny model
        return str(run_dir / "init_model")
    if "warmstart" in config:  # an RL recipe's warm start: its cache, built again only if gone
        return warm_start(OmegaConf.create(config))
    raise NotACheckpointError(f"model.path is null in {source} and {run_dir} holds no init_model/: give the model "
                              "the run started from with --model-path")


def export_checkpoint(checkpoint: str | Path, out: str | Path | None = None, *, config: str | Path | None = None,
                      model_path: str | None = None, role: str | None = None, device: str = "cpu") -> Path:
    """Write checkpoint ``checkpoint``'s model as a HF directory at ``out`` (default ``<ckpt>/hf``); returns it."""
    step_dir = resolve_checkpoint(checkpoint)
    cfg, source = load_checkpoint_config(step_dir, config)
    present = [r for r in EXPORTED_ROLES if (step_dir / r).is_dir()]
    role = role or exported_role(present)
    if role not in present:
        raise NotACheckpointError(f"checkpoint {step_dir} holds no {role or ' or '.join(EXPORTED_ROLES)}/ folder to "
                                  f"export (it holds {sorted(p.name for p in step_dir.iterdir())})")
    cfg["model"]["path"] = model_path or starting_model(cfg, step_dir.parent.parent, source)
    cfg.setdefault("trainer", {})["device"] = device
    out = Path(out) if out else step_dir / HF_DIR
    worker_cls = (ClassWithInitArgs(ActorWorker, cfg, role="actor") if role == "actor"
                  else ClassWithInitArgs(RewardModelWorker, cfg, trainable=True))
    group = LocalWorkerGroup(worker_cls)
    try:
        group.init_model()
        # The model's trainable parameters only: the optimizer state in the shards is not needed here.
        fsdp_utils.load_checkpoint(str(step_dir / role), group.worker().module, None)
        group.export_hf(str(out))
    finally:
        group.shutdown()
    prompt_format.record(cfg, out)  # as the run's own exports: evaluate renders prompts as the run did
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlcore.trainer.export", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="a global_step_N folder (or a run's checkpoints/ folder: the newest)")
    parser.add_argument("--out", help="where to write the HF directory (default: <checkpoint>/hf)")
    parser.add_argument("--config", help="the run's config (default: <run>/config.yaml, else <run>/hydra/config.yaml)")
    parser.add_argument("--model-path", help="the model the run started from (default: the config's model.path)")
    parser.add_argument("--role", choices=EXPORTED_ROLES, help="the role to export (default: actor, else rm)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where to rebuild the model")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.checkpoint, args.out, config=args.config, model_path=args.model_path,
                                role=args.role, device=args.device)
    except NotACheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"exported {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
