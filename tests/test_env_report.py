"""python -m rlcore.env: run as a user runs it (a subprocess, --json) and its text from main(); every section there, and the dtypes
it reports are what the trainer's own choice (rlcore.trainer.choices.resolve_choices) makes on this machine."""

import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from rlcore.engines.dtype_choice import native_bf16
from rlcore.env import main
from rlcore.trainer.choices import resolve_choices

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ["rlcore", "python", "packages", "optional", "os", "cpu", "devices", "dtypes", "kernels"]


@pytest.fixture(scope="module")
def outputs(model_dir):
    """(text, json): the text from ``main`` in this process (the same code, without a second start-up of torch and
    transformers), the json from the command as a user runs it."""
    done = subprocess.run([sys.executable, "-m", "rlcore.env", "--json", "--model", model_dir], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([]) == 0
    return out.getvalue(), json.loads(done.stdout)


def trainer_choice(model_path):
    cfg = OmegaConf.create({"trainer": {"device": "auto"}, "model": {"path": model_path, "mixed_precision": "auto"},
                            "rollout": {"backend": "vllm", "dtype": None}})
    return resolve_choices(cfg)


def test_every_section_is_in_the_text_and_the_json(outputs):
    text, data = outputs
    assert list(data) == SECTIONS
    assert re.findall(r"^\[(\w+)\]$", text, flags=re.M) == SECTIONS
    assert data["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    assert data["packages"]["torch"] == torch.__version__ and data["packages"]["transformers"]
    assert f"  torch: {torch.__version__}" in text
    assert set(data["optional"]) >= {"openai", "anthropic", "wandb", "mlflow", "trackio", "peft", "openai-agents",
                                     "langgraph", "smolagents", "pydantic-ai", "claude-agent-sdk", "reasoning-gym",
                                     "verifiers"}
    assert data["devices"]["cuda_available"] == torch.cuda.is_available()
    assert data["devices"]["count"] == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert data["cpu"]["torch_capability"] == torch.backends.cpu.get_cpu_capability()
    commit = data["rlcore"]["git_commit"]
    here = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    assert commit == (here.stdout.strip() if here.returncode == 0 else None)
    assert data["kernels"]["training_attention"].startswith("rlcore_packed")  # the default: packed, SDPA inside


def test_the_dtypes_are_the_trainers_choice_here(outputs, model_dir):
    _, data = outputs
    dtypes = data["dtypes"]
    mine = trainer_choice(model_dir)  # the tiny model of the test suite: hidden 128, like the report's first width
    assert dtypes["trainer.device"] == mine["trainer.device"]
    assert dtypes["rollout.dtype (vllm)"] == mine["rollout.dtype"]
    assert dtypes["model.mixed_precision"][f"--model {model_dir}"] == mine["model.mixed_precision"]
    assert dtypes["model.mixed_precision"]["tiny model (hidden 128)"] == mine["model.mixed_precision"]
    # and by the rule itself: the engine samples in the trainer's dtype, fp32 training at width 128 on a CPU
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert dtypes["rollout.dtype (vllm)"]["value"] == mine["model.mixed_precision"]["value"]
    wide = dtypes["model.mixed_precision"]["SmolLM2-135M-wide model (hidden 576)"]["value"]
    assert wide == ("bfloat16" if native_bf16(device)[0] else "float32")
    if device == "cpu":
        assert dtypes["model.mixed_precision"]["tiny model (hidden 128)"]["value"] == "float32"


def test_a_model_that_is_not_a_local_directory_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"not a local HF model directory: {re.escape(str(tmp_path))}"):
        main(["--model", str(tmp_path)])
