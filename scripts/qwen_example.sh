#!/usr/bin/env bash
# The second model's example from the main job: Qwen2.5-0.5B through `oscar run` (calibration at the served positions
# with the calibration budget, the tune and the per-layer widths), RULER's four needle tasks at 1k-8k (20 samples per
# cell) for bf16, oscar-int2, kivi2 and tq-int2, perplexity (strict and serving) at 1k, 4k and 8k over 64k held-out
# tokens (8 windows of 8k), and the long end: niah_single_1 at 16k and 32k (5 samples, bf16 and oscar-int2) from the
# same artifact, calibrated to 32k positions.
#
#   bash scripts/qwen_example.sh                 # OUT=runs/qwen-example; re-running resumes (blocks, samples, windows)
#
# Only product commands. run.json records each step as the command that computes it alone, with its CPU time.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/qwen-example}
OSCAR=${OSCAR:-.venv/bin/oscar}
$OSCAR models install qwen2.5-0.5b
$OSCAR run --model qwen2.5-0.5b --full --no-ray --methods bf16,oscar-int2,kivi2,tq-int2 \
  --tasks niah_single_1,niah_single_2,niah_single_3,niah_multikey_1 --lengths 1k,2k,4k,8k \
  --ppl-contexts 1k,4k,8k --ppl-tokens 64k --attn-lengths 4k --long-lengths 16k,32k --long-samples 5 --positions 32k \
  --no-progress --out "$OUT"
