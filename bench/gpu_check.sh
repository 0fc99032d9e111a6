#!/usr/bin/env bash
# GPU check: kernel tests on CUDA, the decode benchmark (batch 1 and 32, 4k-128k, vs BF16 SDPA and
# FlashInfer when importable), an end-to-end OscarCache decode of a random-init model with GLM-4.7's
# attention shape at 32k and 128k, a 2-stage calibration on CUDA of GLM-4.7's first layers
# (3 dense + 1 MoE, 160 experts) against `oscar plan`, the same in GLM-4.7-FP8's block-FP8 layout
# against its dequantized BF16 twin, and a needle batch decoded by 2 pipeline stages on CUDA, each keeping its
# layers' INT2 rows, against one process, and the same through each stage's own layers' OscarCache (the Triton
# kernels) against the cache engine in one process, and one decode step of the Triton latent kernel with GLM-5's
# MLA shapes against its torch reference (bench/gpu_e2e.py). No weights, no downloads.
# Budget < 9 minutes on one H100/H200-class GPU (each step has its own time limit and keeps what it
# measured when stopped; the limits sum to 540 s); the results land under $OUT in 11 files: env.json,
# kernel_tests.xml, decode_cuda.{json,png}, e2e_decode.json, e2e_calibrate.json, e2e_calibrate_fp8.json,
# e2e_needles.json, e2e_needles_cache.json, e2e_latent.json, check.log.
#
#   bash bench/gpu_prepare.sh     # here: wheels the device image lacks + the tokenizer, into .gpu/
#   OUT=/some/dir OSCAR_COMMIT=$(git rev-parse HEAD) bash bench/gpu_check.sh   # there, .gpu carried
#
# Results measured on a GPU are meant to be copied to reports/bench/ (they carry the commit).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
unset TRITON_INTERPRET            # real kernels on the device, not the interpreter
export OSCAR_COMMIT=${OSCAR_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}

# carried wheels (bench/gpu_prepare.sh): installed beside the image's packages, never over them
if [ -d .gpu/wheels ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/oscar-site .gpu/wheels/*.whl \
    >>"$OUT/check.log" 2>&1 && export PYTHONPATH=/tmp/oscar-site${PYTHONPATH:+:$PYTHONPATH}
fi
[ -d .gpu/tokenizer ] && export OSCAR_TOKENIZER_DIR=$PWD/.gpu/tokenizer
# the stage folders map onto oscar.<stage> only once installed (no deps: use the machine's torch)
if ! $PY -c "import oscar.kernels.paged" 2>/dev/null; then
  $PY -m pip install -q --no-deps --no-build-isolation -e . >>"$OUT/check.log" 2>&1 \
    || { echo "install failed, see $OUT/check.log"; exit 2; }
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
# 1. kernel tests (DEV = cuda when available; incl. Triton compilation)
timeout 100 $PY -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_paged.py tests/test_split_cache.py tests/test_layer_widths.py tests/test_triton_latent.py \
  --junitxml="$OUT/kernel_tests.xml" 2>&1 | tee -a "$OUT/check.log" | tail -15 || status=1
# 2. decode benchmark: batch 1 and 32 at 4k..128k vs BF16 SDPA (+ FlashInfer), bandwidth vs peak
timeout 90 $PY bench/decode.py --device cuda --out "$OUT/decode_cuda.json" 2>&1 | tee -a "$OUT/check.log" | tail -15 || status=1
# 3. end-to-end decode through OscarCache, GLM-4.7 attention shape, 32k and 128k, vs DynamicCache BF16
timeout 50 $PY bench/gpu_e2e.py decode --out "$OUT/e2e_decode.json" 2>&1 | tee -a "$OUT/check.log" | tail -4 || status=1
# 4. calibration on CUDA, 2 pipeline stages on the one GPU, vs oscar plan (Ray if importable)
timeout 80 $PY bench/gpu_e2e.py calibrate --out "$OUT/e2e_calibrate.json" 2>&1 | tee -a "$OUT/check.log" | tail -4 || status=1
# 5. block-FP8 calibration on CUDA, 2 stages, against its dequantized BF16 twin (16 of 160 experts: disk and time)
timeout 80 $PY bench/gpu_e2e.py calibrate-fp8 --out "$OUT/e2e_calibrate_fp8.json" 2>&1 | tee -a "$OUT/check.log" | tail -4 || status=1
# 6. needles through 2 pipeline stages on CUDA (4 dense layers, 4 samples x 8k, bf16 + INT2) vs one process
timeout 60 $PY bench/gpu_e2e.py needles --out "$OUT/e2e_needles.json" 2>&1 | tee -a "$OUT/check.log" | tail -4 || status=1
# 7. the same needles through the product cache: each stage its own layers' OscarCache on CUDA (Triton) vs one process
timeout 60 $PY bench/gpu_e2e.py needles --engine cache --out "$OUT/e2e_needles_cache.json" 2>&1 | tee -a "$OUT/check.log" | tail -4 || status=1
# 8. MLA: one decode step of the Triton latent kernel (GLM-5's shapes, INT2 latent history) vs the torch reference
timeout 20 $PY bench/gpu_e2e.py latent --contexts 4096,32768 --out "$OUT/e2e_latent.json" 2>&1 | tee -a "$OUT/check.log" | tail -4 || status=1
ls -l "$OUT"
exit $status
