#!/bin/bash
# Diagnostic (docs/decisions/0075-smollm2-s-4k-needle-needs-more-than-a-better-2.md "SmolLM2's 4k needle needs more than a better 2-bit key grid"): every command
# behind its table. smollm2keybits: SmolLM2's shipped recipe rebuilt on the 4096-token store (calibrate 65536 tokens,
# fit scaled, tune, first-order widths at 4 x 2048: what `oscar run` ships; ~10 min, skipped where present), then
# niah_single_2 at 4k, 40 samples (bench/niah_attribution.py's samples): bf16, oscar-int2, keys exact, values exact,
# and every layer's keys at 3 and at 4 bits (lab/key_bits.py), paired (~25 min on 2 CPUs).
# smollm2keybits3: the same arms and the one-group 2-bit keys on the goal's 4k samples (niah_single_1/2, 20 each, needle
# seeds 0-2: 120 pairs; ~25 min).
#   bash lab/key_bits.sh
source "$(dirname "$0")/steps.sh" runs/i16e "smollm2keybits smollm2keybits3"
if has smollm2keybits; then
  S=$W/s4096; A=$S/scaled.safetensors; G=$S/grad.safetensors
  N="--tasks niah_single_2 --lengths 4k --samples 40 --protocol serving --dtype bfloat16 --no-progress"
  oscar calibrate --model smollm2-135m --store $S/calib.zarr --tokens 65536 --seq-len 4096 --no-progress  # resumes / done
  [ -e $S/scaled.fit.safetensors ] || oscar fit $S/calib.zarr --variant scaled --out $S/scaled.fit.safetensors --no-progress
  [ -e $A ] || oscar validate tune --artifact $S/scaled.fit.safetensors --out $A --no-progress
  [ -e $G ] || oscar validate widths --artifact $A --estimate gradient --windows 4 --length 2048 --out $G --no-progress
  python lab/key_bits.py --artifact $A --widths $G --bits 3 4 --out-dir $S --out lab/results/key_bits_smollm2.json
  python bench/niah_attribution.py --artifact $G --tasks niah_single_2 --lengths 4096 --samples 40 --run-dir $W/kb_attr \
    --out lab/results/attribution_smollm2_key_bits.json
  for b in 3 4; do oscar validate niah --artifact $S/keys$b.safetensors --methods oscar-int2 $N --out $W/kb$b; done
  python lab/candidates_ab.py --niah $W/kb_attr $W/kb3 $W/kb4 --rename $W/kb_attr:oscar-int2-vq=oscar-exact-keys \
    $W/kb_attr:oscar-int2-kq=oscar-exact-values $W/kb3:oscar-int2=oscar-keys3-int2 $W/kb4:oscar-int2=oscar-keys4-int2 --out lab/results/ab_smollm2_key_bits.json
fi
if has smollm2keybits3; then  # after smollm2keybits (its artifacts)
  S=$W/s4096; A=$S/scaled.safetensors; G=$S/grad.safetensors; R=""
  N="--tasks niah_single_1,niah_single_2 --lengths 4k --samples 20 --protocol serving --dtype bfloat16 --no-progress"
  for s in 0 1 2; do
    python bench/niah_attribution.py --artifact $G --tasks niah_single_1,niah_single_2 --lengths 4096 --samples 20 --seed $s \
      --run-dir $W/kb3_attr_s$s --out $W/kb3_attr_s$s.json
    oscar validate niah --artifact $A --methods oscar-int2 $N --seed $s --out $W/kb3_one_s$s
    for b in 3 4; do oscar validate niah --artifact $S/keys$b.safetensors --methods oscar-int2 $N --seed $s --out $W/kb3_k${b}_s$s; done
    R="$R $W/kb3_attr_s$s:oscar-int2-vq=oscar-exact-keys $W/kb3_attr_s$s:oscar-int2-kq=oscar-exact-values"
    R="$R $W/kb3_one_s$s:oscar-int2=oscar-scaled-int2 $W/kb3_k3_s$s:oscar-int2=oscar-keys3-int2 $W/kb3_k4_s$s:oscar-int2=oscar-keys4-int2"
  done
  python lab/candidates_ab.py --niah $W/kb3_attr_s{0,1,2} $W/kb3_one_s{0,1,2} $W/kb3_k3_s{0,1,2} $W/kb3_k4_s{0,1,2} --rename $R \
    --out lab/results/ab_smollm2_key_bits_3seeds.json
  python lab/key_bits.py --plot lab/results/ab_smollm2_key_bits_3seeds.json --out lab/results/key_bits_smollm2.json
fi
