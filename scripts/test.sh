#!/usr/bin/env bash
# Set up if needed, then run the whole test suite. pytest's "no tests collected" (exit 5) is a failure here.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
.venv/bin/python -m pytest -q "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "no tests ran: treating as a failure" >&2
  exit 1
fi
exit "$rc"
