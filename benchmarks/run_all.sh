#!/usr/bin/env bash
# The benchmark driver: every scenario against its baseline on every backend, one subprocess per suite.
#   benchmarks/run_all.sh [--quick] [--runs N] [--num-gpus N] [--model FAMILY|FOLDER|REPO] [--sizes 64x32,...]
#                         [--update-readme]
# With nothing set it uses every visible CUDA card; NUM_GPUS=1 or --num-gpus 1 pins it to one (CPU: 1).
# Outputs: benchmarks/results/results.{json,md,png}.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
[ -x "$python" ] || python="$(command -v python3)"
cd "$root"
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" exec "$python" -m benchmarks.run_all "$@"
