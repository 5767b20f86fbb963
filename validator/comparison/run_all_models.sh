#!/usr/bin/env bash
# The validator: every point, steering, logit lens and steered generation on each backend against eager.
#   validator/comparison/run_all_models.sh [--quick] [--num-gpus N] [MODEL ...]
# With nothing set it uses every visible CUDA card for the num_gpus=N runs (2 one-core ranks on a CPU);
# NUM_GPUS=1 or --num-gpus 1 pins it to one. Exit status 1 on any failure. Outputs: validator/results/.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
[ -x "$python" ] || python="$(command -v python3)"
cd "$root"
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" exec "$python" -m validator.comparison.validate "$@"
