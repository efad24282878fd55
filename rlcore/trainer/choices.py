"""The run's open choices made once, on the driver, before any worker starts, and recorded.

A config may leave three things to the machine: ``trainer.device: auto``, ``model.mixed_precision:
auto`` (train in bf16 or fp32) and a vLLM rollout's ``rollout.dtype: null``. Each is decided here by a
rule on what the machine is (CUDA or not, native bf16 from torch's view of the CPU) and what the model
is (its width: ``rlcore.engines.dtype_choice``), never by timing, and written back into the config as
a concrete value. The engine's dtype follows the trainer's compute dtype, and ``auto`` follows a dtype
the config names for the engine, so that the two sides compute alike; where they cannot (vLLM in bf16
on a CPU without native bf16), the record says why they differ. ``TrainingRun`` saves that config as ``<run>/config.yaml``, with the reasons under
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
    model, rollout = cfg.get("model"), cfg.get("rollout")
    engine_given = rollout.get("dtype") if rollout is not None else None
    if model is not None and model.get("mixed_precision") == "auto" and model.get("path"):
        width = model_width(AutoConfig.from_pretrained(model.path))
        choice, why = dtype_choice.mixed_precision_choice(width, device)
        given = {"float32": None, "fp32": None, "bfloat16": "bfloat16", "bf16": "bfloat16"}.get(engine_given, choice)
        if given != choice and model.get("dtype", "float32") == "float32":  # match the engine the config names
            why = (f"matches rollout.dtype={engine_given}, the engine's, so both sides compute alike (by the width "
                   f"rule alone: {choice or 'float32'}, {why})")
            choice = given
        model.mixed_precision = choice
        record["model.mixed_precision"] = {"value": choice or "float32", "why": f"auto: {why}"}
    if rollout is not None and engine_given is None and rollout.get("backend") in ("vllm", "hf"):
        chosen = engine_dtype(rollout.backend, model, device)
        if chosen is not None:
            rollout.dtype = chosen[0]
            record["rollout.dtype"] = {"value": chosen[0], "why": chosen[1]}
    with open_dict(cfg):
        cfg.resolved = record
    for key in sorted(set(record) - before):
        print(f"chose {key}={record[key]['value']} ({record[key]['why']})", flush=True)
    return record


def engine_dtype(backend: str, model, device: str) -> tuple[str, str] | None:
    """``rollout.dtype: null`` resolved: the trainer's compute dtype, so that the two sides compute alike
    and the consistency check expects fp32's noise (``rlcore.trainer.check_bands``); vLLM keeps fp32 where
    the trainer is bf16 but the device has no native bf16 (vLLM's CPU build sampled ~5x slower in
    emulated bf16), and says so. None: the HF engine's own default already matches (``model.dtype``)."""
    trainer = (model.get("mixed_precision") or model.get("dtype") or "float32") if model is not None else None
    native, why = dtype_choice.native_bf16(device)
    if trainer is None:  # no trained model here to match: bf16 where native
        return (dtype_choice.default_vllm_dtype(device), f"null with vllm: {why}") if backend == "vllm" else None
    if backend == "hf":
        if trainer == (model.get("dtype") or "float32"):
            return None
        return trainer, f"null with hf: the trainer's compute dtype (model.mixed_precision={trainer}), so both sides compute alike"
    if trainer == "bfloat16" and not native:
        return "float32", (f"null with vllm: the trainer computes in bfloat16, but {why}: vLLM samples ~5x slower in "
                           "emulated bf16, so the engine keeps float32 and the dtypes differ (the consistency check's "
                           "band is that pair's)")
    return trainer, f"null with vllm: the trainer's compute dtype ({trainer}), so both sides compute alike ({why})"
