#!/usr/bin/env bash
# The GPU device check (scripts/device_check.py), from the repository root:
#   bash scripts/device_check.sh [--cpu] [--model medium] [--budget-s 450] ...
# On the device machine: the image's python3 (torch, transformers, pytest), the vendored packages of
# .device_vendor/ (bash scripts/vendor_for_device.sh, here, then carry it), results into $OUT.
# Here: PYTHON=.venv/bin/python bash scripts/device_check.sh --cpu --out /tmp/dc
set -uo pipefail
cd "$(dirname "$0")/.."
VENDOR=$(realpath -m "${DEVICE_VENDOR:-.device_vendor}")
if [ ! -d "$VENDOR" ]; then
    echo "no vendor folder $VENDOR: run 'bash scripts/vendor_for_device.sh' here and carry .device_vendor" >&2
    exit 2
fi
if [ -z "${PYTHON:-}" ]; then PYTHON=python3; fi
export PYTHONPATH="$VENDOR:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export RLCORE_DEVICE_VENDOR="$VENDOR"   # scripts/device_guard.py loads the vendored packages from here only
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
exec "$PYTHON" -m scripts.device_check "$@"
