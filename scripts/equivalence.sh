#!/usr/bin/env bash
# Behaviour-equivalence check for refactors: run a small calibrate -> fit (oscar, scaled)
# -> tune -> NIAH + perplexity at float32 with the CLI of the checkout in $PWD, and write the
# artifact hashes, NIAH predictions and perplexities to OUT/summary.json. Compare two commits with
#   bash scripts/equivalence.sh OUT_A [STORE] ; (other checkout) bash scripts/equivalence.sh OUT_B OUT_A/calib.zarr
#   python scripts/equivalence.py OUT_A OUT_B       (exit 1 on any difference)
# With STORE given, the fit reads that store (same store -> same artifact bytes must hold).
set -euo pipefail
OUT=${1:?usage: scripts/equivalence.sh OUT [STORE]}
STORE=${2:-}
OSCAR=${OSCAR:-.venv/bin/oscar}
mkdir -p "$OUT"
if [ -z "$STORE" ]; then
  STORE="$OUT/calib.zarr"
  "$OSCAR" calibrate --store "$STORE" --tokens 16384 --threads 1 --no-progress
fi
# the fit alone (--no-tune --widths none), then the fit with its key clips tuned (the recipe's first two steps;
# before the recipe moved into `oscar fit`, the same artifact came from `oscar validate tune --artifact scaled`)
"$OSCAR" fit "$STORE" --out "$OUT/oscar.safetensors" --variant oscar --no-tune --widths none --threads 1 --no-progress
"$OSCAR" fit "$STORE" --out "$OUT/scaled.safetensors" --variant scaled --no-tune --widths none --threads 1 --no-progress
"$OSCAR" fit "$STORE" --out "$OUT/tuned.safetensors" --variant scaled --widths none --threads 1 --no-progress
M=bf16,naive-int2,kivi2,hadamard-int2,oscar-ref-int2,oscar-kc-int2,oscar-int2
"$OSCAR" validate niah --artifact "$OUT/tuned.safetensors" --methods $M --tasks niah_single_1,niah_single_2 \
  --lengths 1k --samples 2 --dtype float32 --out "$OUT/niah" --no-progress
"$OSCAR" validate ppl --artifact "$OUT/tuned.safetensors" --methods $M --lengths 1k --tokens 2048 \
  --protocols strict,serving --dtype float32 --out "$OUT/ppl" --no-progress
