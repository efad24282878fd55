#!/usr/bin/env bash
# Build .device_vendor/ (or $1): the pure-Python packages the GPU device check needs and the device
# image lacks (it has torch 2.11 and transformers 5.17, no registry). Pinned to the versions of this
# checkout's .venv, so the device runs what the suite tested. Pure Python only: the image's Python
# (3.12) is not this one (3.11), so a compiled file here would not load there; the build fails if one
# appears. Run here, then name the folder in the device tool's `carry`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DEST=${1:-.device_vendor}
# Distributions of scripts/device_guard.py's VENDORED modules (hydra, omegaconf, antlr4, tensordict,
# pyvers); pytest, pluggy and iniconfig are on the image already.
DISTS="hydra-core omegaconf antlr4-python3-runtime tensordict pyvers"
PINS=$("$PY" -c 'import sys, importlib.metadata as m; print(" ".join(f"{d}=={m.version(d)}" for d in sys.argv[1:]))' $DISTS)
rm -rf "$DEST"
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps --no-compile --target "$DEST" $PINS
rm -rf "$DEST/bin"  # console scripts, with this machine's interpreter path in them
compiled=$(find "$DEST" -name '*.so' -o -name '*.pyd' -o -name '*.dylib')
if [ -n "$compiled" ]; then
    echo "compiled files in $DEST would not load on the device's Python:" >&2
    echo "$compiled" >&2
    exit 1
fi
echo "$PINS" > "$DEST/PINS.txt"
echo "vendored into $DEST ($(du -sh "$DEST" | cut -f1)): $PINS"
