#!/bin/bash
# Per-layer key widths at head granularity and the shipped widths at 8k: every command behind their tables.
# heads: the copy probe to first order split by KV head (lab/head_widths.py), widths chosen per layer or per
# (layer, head) on half of 8 calibration windows and scored on the other half; SmolLM2 on smollm2copy's artifact at
# 2048, Qwen on qwencopy's at 1024 (lab/calib_length.sh builds both). qwengrad8k: Qwen's first-order widths
# (qwengrad's artifact) on the goal's hard tasks at 8k with bf16 on the same samples (~30 min on 2 CPUs); qwengrad16k:
# the same at 16k, 10 samples per task; qwensplit16k: the split-key oscar-int2 of the same store (calibrated to 8192
# positions, as the widths' artifact) on those 16k samples, to tell the widths from the uncalibrated positions.
# qwen16kgrad: the same widths recipe on a store calibrated to 16384 positions (calibrate, fit scaled, tune, first-order
# widths at 4 x 1024), on qwengrad16k's samples (bf16 from there), against the 8192-position store's widths;
# qwen16keasy: that artifact on the goal's easy tasks at 16k (5 per task, bf16 beside it) and its perplexity;
# qwen16kshort: the same artifact's hard tasks at 1k-8k on qwengrad's / qwengrad8k's samples (its goal table);
# qwen16keasyshort: its easy tasks at 1k-8k (10 per task, bf16 beside it), the goal cells the others leave unmeasured.
# values: the first-order DP over key x value widths (lab/value_widths.py)
# on smollm2grad's artifact and windows; its widths on smollm2grad's needles and perplexity, paired.
#   bash lab/head_widths.sh
#   STEPS="qwengrad8k" bash lab/head_widths.sh
source "$(dirname "$0")/steps.sh" runs/i16e "heads qwengrad8k qwengrad16k qwensplit16k qwen16kgrad qwen16keasy qwen16kshort qwen16keasyshort values"
if has heads; then
  python lab/head_widths.py --artifact $W/s4096/scaled.safetensors --windows 8 --length 2048 \
    --log $W/s4096/heads_8x2048.gradients.jsonl --out lab/results/head_widths_smollm2.json --no-progress
  python lab/head_widths.py --model qwen2.5-0.5b --artifact $W/qp8192/scaled.safetensors --windows 8 --length 1024 \
    --log $W/qp8192/heads_8x1024.gradients.jsonl --out lab/results/head_widths_qwen.json --no-progress
fi
if has qwengrad8k; then
  Q="--model qwen2.5-0.5b"; G=$W/qp8192/grad.safetensors
  NH="--tasks niah_single_3,niah_multikey_1 --lengths 8k --samples 20 --protocol serving --dtype bfloat16 --no-progress"
  oscar validate niah $Q --artifact $G --methods bf16,oscar-int2 $NH --out $W/gg8k_hard
  python lab/goal_cells.py --goal qwen --niah $W/gg8k_hard $W/gg4k_hard --bf16 $W/gb4k_hard --ppl $W/gg_ppl $W/gs_ppl \
    --label oscar-layer-grad-int2 --out lab/results/goal_qwen_grad_8k.json
fi
if has qwengrad16k; then
  Q="--model qwen2.5-0.5b"; G=$W/qp8192/grad.safetensors
  NH="--tasks niah_single_3,niah_multikey_1 --lengths 16k --samples 10 --protocol serving --dtype bfloat16 --no-progress"
  oscar validate niah $Q --artifact $G --methods bf16,oscar-int2 $NH --out $W/gg16k_hard
  python lab/goal_cells.py --goal qwen --niah $W/gg16k_hard $W/gg8k_hard $W/gg4k_hard --bf16 $W/gb4k_hard --ppl $W/gg_ppl $W/gs_ppl \
    --label oscar-layer-grad-int2 --out lab/results/goal_qwen_grad_16k.json
fi
if has qwensplit16k; then  # 5 samples per task (the first 5 of qwengrad16k's): ~15 min
  Q="--model qwen2.5-0.5b"
  NH="--tasks niah_single_3,niah_multikey_1 --lengths 16k --samples 5 --protocol serving --dtype bfloat16 --no-progress"
  oscar validate niah $Q --artifact $W/qp8192/nll.safetensors --methods oscar-int2 $NH --out $W/gn16k_hard
  python lab/candidates_ab.py --niah $W/gg16k_hard $W/gn16k_hard --rename $W/gg16k_hard:oscar-int2=oscar-layer-grad-int2 \
    --out lab/results/ab_qwen_16k_grad_vs_split.json
fi
p16k_artifact() {  # Qwen's shipped recipe on a store calibrated to 16384 positions -> $W/qp16384g/grad.safetensors (~10 min)
  local Q="--model qwen2.5-0.5b" S=$W/qp16384g
  oscar calibrate $Q --store $S/calib.zarr --seq-len 2048 --positions 16384 --tokens 16384 --block-tokens 8192 --no-progress
  [ -e $S/scaled.fit.safetensors ] || oscar fit $S/calib.zarr --variant scaled --out $S/scaled.fit.safetensors --no-progress
  [ -e $S/scaled.safetensors ] || oscar validate tune $Q --artifact $S/scaled.fit.safetensors --out $S/scaled.safetensors --no-progress
  [ -e $S/grad.safetensors ] || oscar validate widths $Q --artifact $S/scaled.safetensors --estimate gradient --windows 4 \
    --length 1024 --out $S/grad.safetensors --no-progress
}
if has qwen16kgrad; then  # ~45 min: the store and artifact ~10 min, the 16k needles ~90 s per sample
  Q="--model qwen2.5-0.5b"; G=$W/qp16384g/grad.safetensors
  p16k_artifact
  NH="--tasks niah_single_3,niah_multikey_1 --lengths 16k --samples 10 --protocol serving --dtype bfloat16 --no-progress"
  oscar validate niah $Q --artifact $G --methods oscar-int2 $NH --out $W/gp16g_hard
  python lab/candidates_ab.py --niah $W/gg16k_hard $W/gp16g_hard --rename $W/gg16k_hard:oscar-int2=oscar-grad-p8k-int2 \
    $W/gp16g_hard:oscar-int2=oscar-grad-p16k-int2 --base oscar-grad-p8k-int2 --out lab/results/ab_qwen_16k_positions_grad.json
fi
if has qwen16keasy; then  # ~25 min
  Q="--model qwen2.5-0.5b"; G=$W/qp16384g/grad.safetensors
  NE="--tasks niah_single_1,niah_single_2 --lengths 16k --samples 5 --protocol serving --dtype bfloat16 --no-progress"
  oscar validate niah $Q --artifact $G --methods bf16,oscar-int2 $NE --out $W/gp16g_easy
  oscar validate ppl $Q --artifact $G --methods oscar-int2 --protocol strict,serving --dtype bfloat16 --no-progress --out $W/gp16g_ppl
  python lab/goal_cells.py --goal qwen --niah $W/gp16g_hard $W/gp16g_easy --bf16 $W/gg16k_hard --ppl $W/gp16g_ppl $W/gs_ppl \
    --label oscar-layer-grad-p16k-int2 --out lab/results/goal_qwen_grad_p16k.json
fi
if has qwen16kshort; then  # ~30 min
  Q="--model qwen2.5-0.5b"; G=$W/qp16384g/grad.safetensors
  oscar validate niah $Q --artifact $G --methods oscar-int2 --tasks niah_single_3,niah_multikey_1 --lengths 1k,2k,4k,8k \
    --samples 20 --protocol serving --dtype bfloat16 --no-progress --out $W/gp16g_short
  python lab/goal_cells.py --goal qwen --niah $W/gp16g_short $W/gp16g_hard $W/gp16g_easy \
    --bf16 $W/gb4k_hard $W/gg8k_hard $W/gg16k_hard --ppl $W/gp16g_ppl $W/gs_ppl \
    --label oscar-layer-grad-p16k-int2 --out lab/results/goal_qwen_grad_p16k.json
fi
if has qwen16keasyshort; then  # ~45 min: the goal's easy tasks at 1k-8k, the cells goal_qwen_grad_p16k does not hold
  Q="--model qwen2.5-0.5b"; G=$W/qp16384g/grad.safetensors
  p16k_artifact
  oscar validate niah $Q --artifact $G --methods bf16,oscar-int2 --tasks niah_single_1,niah_single_2 --lengths 1k,2k,4k,8k \
    --samples 10 --protocol serving --dtype bfloat16 --no-progress --out $W/gp16g_easy_short
  python lab/goal_cells.py --goal qwen --niah $W/gp16g_easy_short --label oscar-layer-grad-p16k-int2 \
    --out lab/results/goal_qwen_grad_p16k_easy.json
fi
if has values; then
  A=$W/s4096/scaled.safetensors; G=$W/s4096/grad_kv.safetensors
  N="--tasks niah_single_1,niah_single_2 --lengths 1k,2k,4k --samples 20 --protocol serving --dtype bfloat16 --no-progress"
  P="--protocol strict,serving --dtype bfloat16 --no-progress"
  python lab/value_widths.py --artifact $A --windows 4 --length 2048 --log $W/s4096/kv_4x2048.gradients.jsonl \
    --out-artifact $G --out lab/results/value_widths_smollm2.json --no-progress
  for s in 0 1 2; do oscar validate niah --artifact $G --methods oscar-int2 $N --seed $s --out $W/cv4k_s$s; done
  oscar validate ppl --artifact $G --methods oscar-int2 $P --out $W/cv_ppl
  R="$W/cg_ppl:oscar-int2=oscar-layer-grad-int2 $W/cv_ppl:oscar-int2=oscar-layer-kv-int2 $W/cw_ppl:oscar-int2=oscar-scaled-int2"
  for s in 0 1 2; do R="$R $W/cg4k_s$s:oscar-int2=oscar-layer-grad-int2 $W/cv4k_s$s:oscar-int2=oscar-layer-kv-int2"; done
  python lab/candidates_ab.py --niah $W/cg4k_s{0,1,2} $W/cv4k_s{0,1,2} --ppl $W/cg_ppl $W/cv_ppl $W/cw_ppl --base oscar-layer-grad-int2 \
    --rename $R --out lab/results/ab_smollm2_value_widths.json
  python lab/goal_cells.py --goal smollm2 --niah $W/cv4k_s{0,1,2} --bf16 $W/cw4k_s{0,1,2} --ppl $W/cv_ppl $W/cw_ppl \
    --label oscar-layer-kv-int2 --out lab/results/goal_smollm2_value_widths.json
fi
