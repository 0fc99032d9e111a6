#!/bin/bash
# Key tiers (docs/decisions/0062-a-b-key-tiers-reverse-water-filling-a-native.md "A/B: key tiers ..."): every command behind the tables.
# Needs the one-group SmolLM2 artifact of lab/split_and_layer_widths.sh (runs/i16b/scaled.safetensors), the committed
# examples (reports/examples/smollm2: its store and split-key artifact; reports/examples/qwen2.5-0.5b with its
# store runs/qwen/calib.zarr) and Qwen2.5-0.5B installed. ~1.5 h on 2 CPUs. STEPS selects steps.
#   bash lab/key_tiers.sh
#   STEPS="tables" bash lab/key_tiers.sh
source "$(dirname "$0")/steps.sh" runs/i16c "screen ab ablate qwen shipped tables"
A=runs/i16b/scaled.safetensors                        # SmolLM2, one-group format: both A/B formats are built on it
Q=reports/examples/qwen2.5-0.5b/artifact.safetensors  # Qwen, one-group format
S=reports/examples/smollm2/artifact.safetensors       # the shipped oscar-int2 (split keys, its own tune)
M=bf16,oscar-mix-int2,oscar-tier-int2
N="--tasks niah_single_1,niah_single_2 --lengths 1k,2k,4k --samples 20 --protocol serving --dtype bfloat16 --no-progress"
if has screen; then  # calibrated key error of tier layouts at split keys' 2.75 key bits
  python lab/key_tiers.py --artifact $A --out lab/results/tiers_smollm2.json
  python lab/key_tiers.py --artifact $Q --layouts 16x3+48x2 16x4+40x2+8x0 12x4+48x2+4x0 24x4+24x2+16x0 \
    32x3+24x2+8x0 64x2 --out lab/results/tiers_qwen.json
fi
if has ab; then  # the formats on one artifact (the same tune factor), SmolLM2
  for s in 0 1; do oscar validate niah --artifact $A --methods $M $N --seed $s --out $W/niah_s$s; done
  oscar validate ppl --artifact $A --methods $M --protocol strict,serving --dtype bfloat16 --out $W/ppl
fi
has ablate && oscar ablate --out $W/ablate --quick --schemes oscar_scaled oscar_mix oscar_tier --bits 2 3 --no-report --no-progress
if has qwen; then
  oscar validate niah --model qwen2.5-0.5b --artifact $Q --methods $M --tasks niah_single_3,niah_multikey_1 --lengths 4k,8k \
    --samples 20 --protocol serving --dtype bfloat16 --out $W/qwen_niah_hard --no-progress
  oscar validate ppl --model qwen2.5-0.5b --artifact $Q --methods $M --protocol strict,serving --dtype bfloat16 --out $W/qwen_ppl
fi
if has shipped; then  # what `oscar run --variant tiers` would ship (fit + its own tune) against the example's oscar-int2
  [ -f $W/tiers.fit.safetensors ] || oscar fit reports/examples/smollm2/calib.zarr --variant tiers --out $W/tiers.fit.safetensors
  [ -f $W/tiers.safetensors ] || oscar validate tune --artifact $W/tiers.fit.safetensors --out $W/tiers.safetensors
  for s in 0 1; do oscar validate niah --artifact $W/tiers.safetensors --methods oscar-int2 $N --seed $s --out $W/tiers_s$s; done
  oscar validate niah --artifact $S --methods bf16,oscar-int2 $N --seed 1 --out $W/split_s1  # seed 0: the example's
  oscar validate ppl --artifact $W/tiers.safetensors --methods bf16,oscar-int2 --protocol strict,serving --dtype bfloat16 \
    --out $W/tiers_ppl
fi
if has tables; then
  python lab/candidates_ab.py --base oscar-mix-int2 --niah $W/niah_s0 $W/niah_s1 --ppl $W/ppl --ablation $W/ablate \
    --out lab/results/ab_smollm2_tiers.json
  python lab/candidates_ab.py --base oscar-mix-int2 --niah $W/qwen_niah_hard --ppl $W/qwen_ppl --out lab/results/ab_qwen_tiers.json
  python lab/candidates_ab.py --niah reports/examples/smollm2 $W/split_s1 $W/tiers_s0 $W/tiers_s1 \
    --ppl reports/examples/smollm2 $W/tiers_ppl \
    --rename $W/tiers_s0:oscar-int2=oscar-tier-int2 $W/tiers_s1:oscar-int2=oscar-tier-int2 $W/tiers_ppl:oscar-int2=oscar-tier-int2 \
    --out lab/results/ab_smollm2_tiers_shipped.json
fi
