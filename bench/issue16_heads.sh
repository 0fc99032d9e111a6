#!/bin/bash
# Issue 16, hypothesis 4 at head granularity and the shipped widths at 8k: every command behind their tables.
# heads: the copy probe to first order split by KV head (bench/issue16_head_widths.py), widths chosen per layer or per
# (layer, head) on half of 8 calibration windows and scored on the other half; SmolLM2 on smollm2copy's artifact at
# 2048, Qwen on qwencopy's at 1024 (bench/issue16_calib_length.sh builds both). qwengrad8k: Qwen's first-order widths
# (qwengrad's artifact) on the goal's hard tasks at 8k with bf16 on the same samples (~1 h on 2 CPUs).
#   bash bench/issue16_heads.sh
#   STEPS="qwengrad8k" bash bench/issue16_heads.sh
source "$(dirname "$0")/steps.sh" runs/i16e "heads qwengrad8k"
if has heads; then
  python bench/issue16_head_widths.py --artifact $W/s4096/scaled.safetensors --windows 8 --length 2048 \
    --log $W/s4096/heads_8x2048.gradients.jsonl --out bench/results/issue16/head_widths_smollm2.json --no-progress
  python bench/issue16_head_widths.py --model qwen2.5-0.5b --artifact $W/qp8192/scaled.safetensors --windows 8 --length 1024 \
    --log $W/qp8192/heads_8x1024.gradients.jsonl --out bench/results/issue16/head_widths_qwen.json --no-progress
fi
if has qwengrad8k; then
  Q="--model qwen2.5-0.5b"; G=$W/qp8192/grad.safetensors
  NH="--tasks niah_single_3,niah_multikey_1 --lengths 8k --samples 20 --protocol serving --dtype bfloat16 --no-progress"
  oscar validate niah $Q --artifact $G --methods bf16,oscar-int2 $NH --out $W/gg8k_hard
  python bench/issue16_goal.py --goal qwen --niah $W/gg8k_hard $W/gg4k_hard --bf16 $W/gb4k_hard --ppl $W/gg_ppl $W/gs_ppl \
    --label oscar-layer-grad-int2 --out bench/results/issue16/goal_qwen_grad_8k.json
fi
