"""The run's open choices made once, on the driver, before any worker starts, and recorded.

A config may leave three things to the machine: ``trainer.device: auto``, ``model.mixed_precision:
auto`` (train in bf16 or fp32) and a vLLM rollout's ``rollout.dtype: null``. Each is decided here by a
rule on what the machine is (CUDA or not, native bf16 from torch's view of the CPU) and what the model
is (its width: ``rlcore.engines.dtype_choice``), never by timing, and written back into the config as
a concrete value. ``TrainingRun`` saves that config as ``<run>/config.yaml``, with the reasons under
``resolved``, so a run says what it chose and why, and two runs of one command choose the same.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from transformers import AutoConfig

from rlcore.engines import dtype_choice
from rlcore.workers.precision import model_width


def resolve_choices(cfg: DictConfig) -> dict[str, dict[str, str]]:
    """Make ``cfg``'s open choices concrete (in place) and record each under ``cfg.resolved``
    (``{key: {"value": ..., "why": ...}}``); returns that record. Idempotent: a second call finds
    concrete values and keeps the first record."""
    record = OmegaConf.to_container(cfg.resolved) if cfg.get("resolved") else {}
    before = set(record)
    t = cfg.trainer
    if t.device == "auto":
        t.device = "cuda" if torch.cuda.is_available() else "cpu"
        record["trainer.device"] = {"value": t.device, "why": f"auto: CUDA is {'' if t.device == 'cuda' else 'not '}available"}
    device = t.device
    model = cfg.get("model")
    if model is not None and model.get("mixed_precision") == "auto" and model.get("path"):
        width = model_width(AutoConfig.from_pretrained(model.path))
        choice, why = dtype_choice.mixed_precision_choice(width, device)
        model.mixed_precision = choice
        record["model.mixed_precision"] = {"value": choice or "float32", "why": f"auto: {why}"}
    rollout = cfg.get("rollout")
    if rollout is not None and rollout.get("backend") == "vllm" and rollout.get("dtype") is None:
        rollout.dtype = dtype_choice.default_vllm_dtype(device)
        record["rollout.dtype"] = {"value": rollout.dtype, "why": f"null with vllm: {dtype_choice.native_bf16(device)[1]}"}
    with open_dict(cfg):
        cfg.resolved = record
    for key in sorted(set(record) - before):
        print(f"chose {key}={record[key]['value']} ({record[key]['why']})", flush=True)
    return record
