#!/usr/bin/env bash
# Set up from nothing, then run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TRITON_INTERPRET=${TRITON_INTERPRET:-1}
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout=900 "$@"
