#!/usr/bin/env bash
# Stores of SmolLM2 calibrated on the same 16,384 tokens through different kernel paths, then the recipe's
# objectives on each (lab/tie_spread.py score) and their comparison (analyze). ~25 min per store on 2 busy CPUs.
#   bash lab/tie_spread.sh DIR              native, torch (OSCAR_NATIVE=0) and bfloat16-capture stores
#   AVX2=1 bash lab/tie_spread.sh DIR       then a store and its scoring on a host held to AVX2, and all four compared
set -euo pipefail
cd "$(dirname "$0")/.."
D=${1:?run directory}
mkdir -p "$D"
OSCAR=.venv/bin/oscar
cal() {  # name, env..., then -- calibrate options
  local name=$1; shift
  [ -e "$D/$name.zarr/.done" ] && return 0
  env "$@" $OSCAR calibrate --model smollm2-135m --store "$D/$name.zarr" --tokens 16384 --threads 1 --no-progress \
    ${DTYPE:+--dtype $DTYPE} --overwrite
  touch "$D/$name.zarr/.done"
}
cal native OSCAR_NATIVE=force
cal torch OSCAR_NATIVE=0
DTYPE=bfloat16 cal bf16 OSCAR_NATIVE=force
for s in native torch bf16; do
  [ -s "$D/$s.json" ] || .venv/bin/python lab/tie_spread.py score "$D/$s.zarr" "$D/$s.json" --table-factors "${FACTORS:-1.1,1.2}"
done
.venv/bin/python lab/tie_spread.py analyze "$D/native.json" "$D/torch.json" "$D/bf16.json"
# A host held to AVX2 (as bench/main_job_time.py --as-avx2 runs it): the store and the recipe's scoring both on its kernels.
if [ -n "${AVX2:-}" ]; then
  A=(ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 OSCAR_NATIVE_ISA=avx2 OSCAR_CPU_BF16=0
     OSCAR_CACHE="${OSCAR_CACHE:-$HOME/.cache/oscar-kv}/as-avx2")
  cal avx2 "${A[@]}" OSCAR_NATIVE=force
  [ -s "$D/avx2.json" ] || env "${A[@]}" .venv/bin/python lab/tie_spread.py score "$D/avx2.zarr" "$D/avx2.json" \
    --table-factors "${FACTORS:-1.1,1.2}"
  .venv/bin/python lab/tie_spread.py analyze "$D/native.json" "$D/torch.json" "$D/bf16.json" "$D/avx2.json"
fi
