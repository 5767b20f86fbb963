#!/usr/bin/env bash
# Set up if needed, then run the demo on a tiny model built locally (no network). Output lands in out/demo/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m interp_engine.demo --out out/demo "$@"
