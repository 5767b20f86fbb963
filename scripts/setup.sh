#!/usr/bin/env bash
# Idempotent setup: a .venv with torch 2.13 CPU (from the local wheel cache when present), the package and its
# test extras. No torchvision/torchaudio/torchcodec: PyPI's builds break `import transformers` beside torch CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.interp_engine_setup
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  python -m pip install -q --upgrade pip
  python -m pip install -q "torch==2.13.0"
  python -m pip install -q -e ".[test]"
  python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  touch "$stamp"
fi
