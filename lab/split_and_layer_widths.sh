#!/bin/bash
# Split keys and per-layer widths (docs/decisions/0061-a-b-split-keys-and-per-layer-widths-split-keys.md "A/B: split keys ..."): every command behind the tables.
# Needs the SmolLM2 store of a one-group (`--variant scaled`) oscar-int2 artifact and Qwen2.5-0.5B installed
# (`oscar models install qwen2.5-0.5b`). Takes ~2 h on 2 CPUs; each step resumes. STEPS selects steps.
#   bash lab/split_and_layer_widths.sh                 everything
#   STEPS="smollm2 tables" bash lab/split_and_layer_widths.sh
source "$(dirname "$0")/steps.sh" runs/i16b "artifacts smollm2 ablate placement qwen tables"
A=$W/scaled.safetensors                      # SmolLM2, one-group format (the A/B's oscar-int2)
Q=reports/examples/qwen2.5-0.5b/artifact.safetensors  # Qwen, one-group format (its provenance: runs/qwen/calib.zarr)
C=(bf16 oscar-int2 oscar-mix-int2 oscar-layer-int2)
join() { local IFS=,; echo "$*"; }
if has artifacts; then
  [ -d reports/examples/smollm2/calib.zarr ] || oscar calibrate --model smollm2-135m --store reports/examples/smollm2/calib.zarr
  [ -f $W/scaled.fit.safetensors ] || oscar fit reports/examples/smollm2/calib.zarr --variant scaled --out $W/scaled.fit.safetensors
  [ -f $A ] || oscar validate tune --artifact $W/scaled.fit.safetensors --out $A
  [ -d runs/qwen/calib.zarr ] || oscar calibrate --model qwen2.5-0.5b --store runs/qwen/calib.zarr --seq-len 2048 \
    --tokens 8192 --block-tokens 4096 --threads 1
fi
if has smollm2; then
  M=$(join "${C[@]}" oscar-mix-layer-int2 oscar-sparse-int2)
  oscar validate niah --artifact $A --methods "$M" --tasks niah_single_1,niah_single_2 --lengths 1k,2k,4k --samples 20 \
    --protocol serving --dtype bfloat16 --out $W/niah --no-progress
  oscar validate niah --artifact $A --methods "$M" --tasks niah_single_1,niah_single_2 --lengths 1k,2k,4k --samples 20 \
    --seed 1 --protocol serving --dtype bfloat16 --out $W/niah_seed1 --no-progress
  oscar validate ppl --artifact $A --methods "$(join "${C[@]}" oscar-sparse-int2)" --protocol strict,serving --dtype bfloat16 --out $W/ppl
fi
has ablate && oscar ablate --out $W/ablate --quick --schemes oscar_scaled oscar_mix --bits 2 3 --no-report --no-progress
has placement && python lab/split_placement.py --artifact $A --out lab/results/placement_smollm2.json
if has qwen; then
  oscar validate niah --model qwen2.5-0.5b --artifact $Q --methods "$(join "${C[@]}" oscar-mix-layer-int2)" \
    --tasks niah_single_1,niah_single_2 --lengths 1k,4k --samples 20 --protocol serving --dtype bfloat16 --out $W/qwen_niah --no-progress
  oscar validate ppl --model qwen2.5-0.5b --artifact $Q --methods "$(join "${C[@]}" oscar-sparse-int2 oscar-lm-int2)" \
    --protocol strict,serving --dtype bfloat16 --out $W/qwen_ppl
  oscar validate niah --model qwen2.5-0.5b --artifact $Q --methods "$(join "${C[@]}" oscar-sparse-int2)" \
    --tasks niah_single_3,niah_multikey_1 --lengths 4k,8k --samples 20 --protocol serving --dtype bfloat16 --out $W/qwen_niah_hard --no-progress
  # the shipped recipe (oscar run's fit --variant split + its own tune) on Qwen's store
  [ -f $W/qwen_split.fit.safetensors ] || oscar fit runs/qwen/calib.zarr --variant split --out $W/qwen_split.fit.safetensors
  [ -f $W/qwen_split.safetensors ] || oscar validate tune --model qwen2.5-0.5b --artifact $W/qwen_split.fit.safetensors \
    --out $W/qwen_split.safetensors
  oscar validate ppl --model qwen2.5-0.5b --artifact $W/qwen_split.safetensors --methods bf16,oscar-int2 --protocol strict,serving \
    --dtype bfloat16 --out $W/qwen_split_ppl
fi
if has tables; then
  python lab/candidates_ab.py --niah $W/niah $W/niah_seed1 --ppl $W/ppl --ablation $W/ablate --out lab/results/ab_smollm2_h2h4.json
  python lab/candidates_ab.py --niah $W/qwen_niah --ppl $W/qwen_ppl --out lab/results/ab_qwen_easy.json
  python lab/candidates_ab.py --niah $W/qwen_niah_hard --out lab/results/ab_qwen_hard.json
  python lab/candidates_ab.py --niah $W/qwen_split_ppl --ppl $W/qwen_split_ppl --out lab/results/ab_qwen_shipped_ppl.json  # no needles: ppl only
fi
