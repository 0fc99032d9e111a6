#!/usr/bin/env bash
# GPU check for the INT2 kernels: kernel tests on CUDA, then the CUDA decode benchmark.
# Budget < 8 minutes on one H100/H200-class GPU; every result lands as JSON/XML/PNG under $OUT.
#
#   OUT=/some/dir OSCAR_COMMIT=$(git rev-parse HEAD) bash bench/gpu_check.sh
#
# Results measured on a GPU are meant to be copied to reports/bench/ (they carry the commit).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
unset TRITON_INTERPRET            # real kernels on the device, not the interpreter
export OSCAR_COMMIT=${OSCAR_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}

# the stage folders map onto oscar.<stage> only once installed (no deps: use the machine's torch)
if ! $PY -c "import oscar.kernels.paged" 2>/dev/null; then
  $PY -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
    || { echo "install failed, see $OUT/install.log"; exit 2; }
fi

$PY - <<'PY' >"$OUT/env.json"
import json, os, torch
info = {"commit": os.environ.get("OSCAR_COMMIT"), "torch": torch.__version__, "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available()}
try:
    import triton; info["triton"] = triton.__version__
except Exception as e:
    info["triton_error"] = repr(e)
try:
    import flashinfer; info["flashinfer"] = getattr(flashinfer, "__version__", "?")
except Exception as e:
    info["flashinfer"] = None
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info.update(device=p.name, sms=p.multi_processor_count, memory_GiB=round(p.total_memory / 2**30, 1))
print(json.dumps(info, indent=2))
PY
cat "$OUT/env.json"

status=0
# 1. kernel tests (DEV = cuda when available; < ~2 min incl. Triton compilation)
timeout 240 $PY -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_paged.py \
  --junitxml="$OUT/kernel_tests.xml" 2>&1 | tee "$OUT/kernel_tests.txt" | tail -15 || status=1
# 2. decode benchmark: batch 1 and 32 at 4k..128k vs BF16 SDPA (+ FlashInfer), bandwidth vs peak
timeout 330 $PY bench/decode.py --device cuda --out "$OUT/decode_cuda.json" 2>&1 | tee "$OUT/decode_cuda.log" | tail -15 || status=1
ls -l "$OUT"
exit $status
