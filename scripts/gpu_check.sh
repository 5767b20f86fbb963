#!/usr/bin/env bash
# The eager backend on a CUDA machine with torch but no vLLM and no internet: parity (fp32, bf16), bnb-4bit where
# bitsandbytes is there, device_map, and speed against plain HF; one JSON. Wheels the machine lacks (beartype,
# bitsandbytes) may be carried in .whl/ (pip download them where the network is).
#   bash scripts/gpu_check.sh [OUT.json]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu_check.json}"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ie-site .whl/*.whl
  export PYTHONPATH="/tmp/ie-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
exec timeout 480 python3 scripts/gpu_check.py --out "$out"
