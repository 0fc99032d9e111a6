#!/bin/bash
# Calibration length (docs/decisions/0065-calibrate-at-the-serving-length-oscar-run.md "Calibrate at the serving length"): every command behind its tables. The same
# calibration tokens at sequence lengths 2k / 4k / 8k (SmolLM2) and 2k / 8k (Qwen2.5-0.5B), each fitted (split keys)
# and tuned as `oscar run` does; the INT2 key error by key position on held-out text, then paired needles and
# perplexity. Also the tune objective `guarded` against `nll` on the 2k store; 2k windows read at positions to 8k
# (`--positions`, "Calibrate at positions, not lengths") against both; Qwen's hard needles at 4k with windows read to
# 4096; the Qwen goal grid 1k-8k with windows read to 8192 (qwengrid), its 16k cell with windows read to 16384
# (qwen16k); the SmolLM2 clip tuned at the serving length and protocol (servetune); the tune objective `guarded` on
# the grid's artifact (qwenguard); 40 samples per task at 2k and 4k, the grid's cells nearest a verdict (qwenmore);
# per-layer widths (alone and with split keys) on the grid's store, Qwen's hard tasks (qwenlayers), and on
# SmolLM2's shipped store (smollm2layers); the clip confound of per-layer widths: their wide layers unclipped at 2 bits
# (qwenunclip, after qwenlayers); per-layer widths chosen by each layer's copied-span NLL on calibration text, a
# retrieval signal measured through the model (qwencopy, after qwenunclip: against its arms; smollm2copy: builds the
# 4096-token store and scaled fit if absent, ~65 min; smollm2seed2: a third needle seed for its arms; smollm2split: the
# shipped split keys on the same store; qwencopygoal: bf16 on qwencopy's samples and the goal's cells; smollm2cheap: the
# product command `oscar validate widths` at 2 x 1024 probe windows, 11 min, against smollm2copy's 4 x 2048 choice;
# qwencopyeasy: the goal's easy tasks with Qwen's copy widths in the served per-layer format, bf16 alongside;
# smollm2grad: the copy probe to first order, `oscar validate widths --estimate gradient` on smollm2copy's artifact and
# windows, its estimates against the measured probe's and its needles / perplexity paired with the probe's widths'; qwengrad:
# the same estimate against qwencopy's measured probe, then its widths on the hard needles 1k-4k and perplexity;
# smollm2grad4k: smollm2grad's estimate read from 4 x 4096 windows instead of 4 x 2048, needles and perplexity paired;
# smollm2attr: which half of the shipped example's cache loses niah_single_2 at 4k, keys or values; smollm2attrlayers:
# which layers' keys, by key-width class, on the same samples).
# ~9.5 h on 2 CPUs. STEPS selects steps.
#   bash lab/calib_length.sh
#   STEPS="tables" bash lab/calib_length.sh
source "$(dirname "$0")/steps.sh" runs/i16e "smollm2 position niah ppl guarded qwen windows qwen4k qwengrid qwen16k servetune qwenguard qwenmore qwenlayers smollm2layers qwenunclip qwencopy qwencopyppl smollm2copy smollm2seed2 smollm2split qwencopygoal smollm2cheap qwencopyeasy smollm2grad qwengrad smollm2grad4k smollm2attr smollm2attrlayers tables"
N="--tasks niah_single_1,niah_single_2 --lengths 1k,2k,4k --samples 20 --protocol serving --dtype bfloat16 --no-progress"
P="--protocol strict,serving --dtype bfloat16 --no-progress"
if has smollm2; then  # stores, fits and tunes at three calibration lengths (65536 calibration tokens each)
  for L in 2048 4096 8192; do
    oscar calibrate --model smollm2-135m --store $W/s$L/calib.zarr --tokens 65536 --seq-len $L --no-progress
    oscar fit $W/s$L/calib.zarr --variant split --out $W/s$L/fit.safetensors --no-progress
    oscar validate tune --artifact $W/s$L/fit.safetensors --out $W/s$L/nll.safetensors --no-progress
  done
fi
if has position; then  # key logit error by key position, queries at the end of 4k / 8k held-out sequences
  A="--artifact c2k=$W/s2048/fit.safetensors --artifact c4k=$W/s4096/fit.safetensors --artifact c8k=$W/s8192/fit.safetensors"
  python lab/key_error_by_position.py $A --out lab/results/position_smollm2_4k.json
  python lab/key_error_by_position.py $A --length 8192 --bin 1024 --out lab/results/position_smollm2_8k.json
  python lab/key_error_by_position.py $A --length 2048 --sequences 6 --bin 256 --out lab/results/position_smollm2_2k.json
  python lab/key_error_by_position.py --plot lab/results/position_smollm2_{2k,4k,8k}.json \
    --out lab/results/position_smollm2.png
fi
if has niah; then  # the same needle samples for every arm; bf16 once per seed
  for s in 0 1; do
    oscar validate niah --artifact $W/s2048/nll.safetensors --methods bf16,oscar-int2 $N --seed $s --out $W/c2k_s$s
    oscar validate niah --artifact $W/s4096/nll.safetensors --methods oscar-int2 $N --seed $s --out $W/c4k_s$s
  done
  oscar validate niah --artifact $W/s8192/nll.safetensors --methods oscar-int2 $N --seed 0 --out $W/c8k_s0
fi
if has ppl; then
  oscar validate ppl --artifact $W/s2048/nll.safetensors --methods bf16,oscar-int2 $P --out $W/ppl_c2k
  oscar validate ppl --artifact $W/s4096/nll.safetensors --methods oscar-int2 $P --out $W/ppl_c4k
fi
if has guarded; then  # the tune objective of docs/decisions/0064-tune-objective-copy-guarded-built-not-the.md "Tune objective copy / guarded", on the 2k store
  oscar validate tune --artifact $W/s2048/fit.safetensors --objective guarded --out $W/s2048/guarded.safetensors --no-progress
  oscar validate niah --artifact $W/s2048/guarded.safetensors --methods oscar-int2 $N --seed 0 --out $W/g2k_s0
fi
if has qwen; then  # 16384 calibration tokens at 2k and 8k; the hard needle tasks at 8k
  Q="--model qwen2.5-0.5b"
  for L in 2048 8192; do
    oscar calibrate $Q --store $W/q$L/calib.zarr --seq-len $L --tokens 16384 --block-tokens 8192 --no-progress
    oscar fit $W/q$L/calib.zarr --variant split --out $W/q$L/fit.safetensors --no-progress
    oscar validate tune $Q --artifact $W/q$L/fit.safetensors --out $W/q$L/nll.safetensors --no-progress
  done
  python lab/key_error_by_position.py --length 8192 --sequences 2 --bin 1024 --artifact c2k=$W/q2048/fit.safetensors \
    --artifact c8k=$W/q8192/fit.safetensors --out lab/results/position_qwen_8k.json
  python lab/key_error_by_position.py --plot lab/results/position_qwen_8k.json --out lab/results/position_qwen.png
  NQ="--tasks niah_single_3,niah_multikey_1 --lengths 8k --samples 20 --protocol serving --dtype bfloat16 --no-progress"
  oscar validate niah $Q --artifact $W/q2048/nll.safetensors --methods bf16,oscar-int2 $NQ --out $W/q2k_8k
  oscar validate niah $Q --artifact $W/q8192/nll.safetensors --methods oscar-int2 $NQ --out $W/q8k_8k
fi
if has windows; then  # docs/decisions/0066-calibrate-at-positions-not-lengths-oscar.md "Calibrate at positions, not lengths": 2k windows read at positions to 8k
  oscar calibrate --model smollm2-135m --store $W/p8192/calib.zarr --tokens 65536 --seq-len 2048 --positions 8192 --no-progress
  oscar fit $W/p8192/calib.zarr --variant split --out $W/p8192/fit.safetensors --no-progress
  python lab/key_error_by_position.py --artifact c2k=$W/s2048/fit.safetensors --artifact c8k=$W/s8192/fit.safetensors \
    --artifact p8k=$W/p8192/fit.safetensors --length 8192 --bin 1024 --out lab/results/position_smollm2_8k_positions.json
  oscar calibrate --model qwen2.5-0.5b --store $W/qp8192/calib.zarr --seq-len 2048 --positions 8192 --tokens 16384 \
    --block-tokens 8192 --no-progress
  oscar fit $W/qp8192/calib.zarr --variant split --out $W/qp8192/fit.safetensors --no-progress
  python lab/key_error_by_position.py --length 8192 --sequences 2 --bin 1024 --artifact c2k=$W/q2048/fit.safetensors \
    --artifact c8k=$W/q8192/fit.safetensors --artifact p8k=$W/qp8192/fit.safetensors \
    --out lab/results/position_qwen_8k_positions.json
  python lab/key_error_by_position.py --plot lab/results/position_{smollm2,qwen}_8k_positions.json \
    --out lab/results/position_windows.png
  python bench/calib_positions.py --model smollm2-135m --tokens 32768 --long 8192 --short 2048 --repeats 2 \
    --out bench/results/calib_positions_smollm2.json
fi
if has qwen4k; then  # Qwen hard needles at 4k: 2k windows at positions to 4096 (matched) against the 2k fit
  Q="--model qwen2.5-0.5b"
  oscar calibrate $Q --store $W/qp4096/calib.zarr --seq-len 2048 --positions 4096 --tokens 16384 --block-tokens 8192 --no-progress
  oscar fit $W/qp4096/calib.zarr --variant split --out $W/qp4096/fit.safetensors --no-progress
  oscar validate tune $Q --artifact $W/qp4096/fit.safetensors --out $W/qp4096/nll.safetensors --no-progress
  NQ="--tasks niah_single_3,niah_multikey_1 --lengths 4k --samples 20 --protocol serving --dtype bfloat16 --no-progress"
  oscar validate niah $Q --artifact $W/qp4096/nll.safetensors --methods bf16,oscar-int2 $NQ --out $W/qp4k_4k
  oscar validate niah $Q --artifact $W/q2048/nll.safetensors --methods oscar-int2 $NQ --out $W/q2k_4k
fi
if has qwengrid; then  # the issue's Qwen goal grid, 1k-8k x four tasks, with one artifact: windows read to 8192
  Q="--model qwen2.5-0.5b"; G="--samples 20 --protocol serving --dtype bfloat16 --no-progress"
  E="niah_single_1,niah_single_2"; H="niah_single_3,niah_multikey_1"; A=$W/qp8192/nll.safetensors
  oscar validate tune $Q --artifact $W/qp8192/fit.safetensors --out $A --no-progress
  oscar validate niah $Q --artifact $A --methods bf16,oscar-int2 --tasks $E,$H --lengths 1k,2k $G --out $W/gp8k_short
  oscar validate niah $Q --artifact $A --methods bf16,oscar-int2 --tasks $E --lengths 4k $G --out $W/gp8k_4k_easy
  oscar validate niah $Q --artifact $A --methods oscar-int2 --tasks $H --lengths 4k $G --out $W/gp8k_4k_hard  # bf16: qp4k_4k
  oscar validate niah $Q --artifact $A --methods oscar-int2 --tasks $H --lengths 8k $G --out $W/gp8k_8k_hard  # bf16: q2k_8k
  oscar validate niah $Q --artifact $A --methods bf16,oscar-int2 --tasks $E --lengths 8k $G --out $W/gp8k_8k_easy
  oscar validate ppl $Q --artifact $A --methods bf16,oscar-int2 --protocol strict,serving --dtype bfloat16 --no-progress \
    --out $W/gp8k_ppl
fi
if has qwen16k; then  # the grid's 16k cell: its own artifact, 2k windows read to 16384 (calibrate to the served positions)
  Q="--model qwen2.5-0.5b"; A=$W/qp16384/nll.safetensors
  oscar calibrate $Q --store $W/qp16384/calib.zarr --seq-len 2048 --positions 16384 --tokens 16384 --block-tokens 8192 --no-progress
  oscar fit $W/qp16384/calib.zarr --variant split --out $W/qp16384/fit.safetensors --no-progress
  oscar validate tune $Q --artifact $W/qp16384/fit.safetensors --out $A --no-progress
  oscar validate niah $Q --artifact $A --methods bf16,oscar-int2 --tasks niah_single_1,niah_single_2,niah_single_3,niah_multikey_1 \
    --lengths 16k --samples ${SAMPLES16K:-20} --protocol serving --dtype bfloat16 --no-progress --out $W/gp16k
fi
if has servetune; then  # SmolLM2's 4k fit tuned as it is served (serving protocol, 4096 tokens) and strict at 4096
  oscar validate tune --artifact $W/s4096/fit.safetensors --protocol serving --tokens 4096 --out $W/s4096/serving.safetensors --no-progress
  oscar validate tune --artifact $W/s4096/fit.safetensors --protocol strict --tokens 4096 --out $W/s4096/strict4k.safetensors --no-progress
  oscar validate ppl --artifact $W/s4096/serving.safetensors --methods oscar-int2 $P --out $W/ppl_c4k_serve
  for s in 0 1; do
    oscar validate niah --artifact $W/s4096/serving.safetensors --methods oscar-int2 $N --seed $s --out $W/c4ks_s$s
  done
fi
if has qwenguard; then  # the grid's artifact tuned by `guarded` (retrieval proxy within 0.5 % of the best NLL)
  Q="--model qwen2.5-0.5b"; A=$W/qp8192/guarded.safetensors
  oscar validate tune $Q --artifact $W/qp8192/fit.safetensors --objective guarded --out $A --no-progress
  # it chose x1.1, the grid's factor: the needles would repeat the grid's (deterministic), so none are run
fi
if has qwenmore; then  # the grid's 2k and 4k cells at 40 samples per task (indices 0-19 again: a rerun check)
  oscar validate niah --model qwen2.5-0.5b --artifact $W/qp8192/nll.safetensors --methods bf16,oscar-int2 \
    --tasks niah_single_1,niah_single_2,niah_single_3,niah_multikey_1 --lengths 2k,4k --samples 40 --protocol serving \
    --dtype bfloat16 --no-progress --out $W/gp8k_more
fi
if has qwenlayers; then  # per-layer widths on the grid's store: widths per layer (and split keys among them), one-group base
  Q="--model qwen2.5-0.5b"; A=$W/qp8192/scaled.safetensors
  oscar fit $W/qp8192/calib.zarr --variant scaled --out $W/qp8192/scaled.fit.safetensors --no-progress
  oscar validate tune $Q --artifact $W/qp8192/scaled.fit.safetensors --out $A --no-progress
  oscar validate niah $Q --artifact $A --methods oscar-layer-int2,oscar-mix-layer-int2 --tasks niah_single_3,niah_multikey_1 \
    --lengths 1k,2k,4k,8k --samples 20 --protocol serving --dtype bfloat16 --no-progress --out $W/gl8k_hard
  oscar validate ppl $Q --artifact $A --methods oscar-layer-int2,oscar-mix-layer-int2 --protocol strict,serving \
    --dtype bfloat16 --no-progress --out $W/gl8k_ppl
  # the same two with the widths chosen by the share of calibration query rows whose top key moves
  oscar validate niah $Q --artifact $A --methods oscar-layer-top1-int2,oscar-mix-layer-top1-int2 \
    --tasks niah_single_3,niah_multikey_1 --lengths 1k,2k,4k,8k --samples 20 --protocol serving --dtype bfloat16 \
    --no-progress --out $W/gt8k_hard
  python lab/layer_widths_dp.py --artifact $A --out lab/results/widths_qwen.json  # the DP's widths per layer
fi
if has smollm2layers; then  # per-layer widths on SmolLM2's shipped store (4096-token sequences), one-group base
  A=$W/s4096/scaled.safetensors
  oscar fit $W/s4096/calib.zarr --variant scaled --out $W/s4096/scaled.fit.safetensors --no-progress
  oscar validate tune --artifact $W/s4096/scaled.fit.safetensors --out $A --no-progress
  for s in 0 1; do
    oscar validate niah --artifact $A --methods oscar-layer-int2,oscar-mix-layer-int2 $N --seed $s --out $W/cl4k_s$s
  done
  oscar validate ppl --artifact $A --methods oscar-layer-int2,oscar-mix-layer-int2 $P --out $W/ppl_cl4k
  python lab/layer_widths_dp.py --artifact $A --out lab/results/widths_smollm2.json
fi
if has qwenunclip; then  # per-layer widths store wide layers with no clip: is the gain the bit or the unclipped extremes?
  Q="--model qwen2.5-0.5b"; A=$W/qp8192/scaled.safetensors; U=$W/qp8192/unclip.safetensors
  python lab/unclip_wide_layers.py --artifact $A --widths lab/results/widths_qwen.json --out $U
  G="--tasks niah_single_3,niah_multikey_1 --lengths 1k,2k,4k --samples 20 --protocol serving --dtype bfloat16 --no-progress"
  oscar validate niah $Q --artifact $A --methods oscar-int2,oscar-layer-int2 $G --out $W/gs4k_hard  # clipped 2-bit, widths
  oscar validate niah $Q --artifact $U --methods oscar-int2 $G --out $W/gu4k_hard  # unclipped 2-bit in the wide layers
  oscar validate niah $Q --artifact $W/qp8192/nll.safetensors --methods oscar-int2 $G --out $W/gn4k_hard  # shipped split (the grid's records again)
fi
if has qwencopy; then  # widths per layer by each layer's copied-span NLL, paired with qwenunclip's arms (same store and fit)
  Q="--model qwen2.5-0.5b"; A=$W/qp8192/scaled.safetensors; C=$W/qp8192/copy.safetensors
  python lab/layer_copy_widths.py $Q --artifact $A --windows 4 --length 1024 --out-artifact $C --no-progress \
    --out lab/results/layer_copy_qwen.json
  G="--tasks niah_single_3,niah_multikey_1 --lengths 1k,2k,4k --samples 20 --protocol serving --dtype bfloat16 --no-progress"
  oscar validate niah $Q --artifact $C --methods oscar-int2 $G --out $W/gc4k_hard
  python lab/candidates_ab.py --niah $W/gn4k_hard $W/gs4k_hard $W/gc4k_hard --base oscar-layer-int2 \
    --rename $W/gs4k_hard:oscar-int2=oscar-scaled-int2 $W/gc4k_hard:oscar-int2=oscar-layer-copy-int2 \
    --out lab/results/ab_qwen_copy.json
  python lab/candidates_ab.py --niah $W/gn4k_hard $W/gs4k_hard $W/gc4k_hard \
    --rename $W/gs4k_hard:oscar-int2=oscar-scaled-int2 $W/gc4k_hard:oscar-int2=oscar-layer-copy-int2 \
    --out lab/results/ab_qwen_copy_vs_shipped.json
  python lab/candidates_ab.py --niah $W/gn4k_hard $W/gs4k_hard $W/gc4k_hard --base oscar-scaled-int2 \
    --rename $W/gs4k_hard:oscar-int2=oscar-scaled-int2 $W/gc4k_hard:oscar-int2=oscar-layer-copy-int2 \
    --out lab/results/ab_qwen_copy_vs_scaled.json
fi
if has qwencopyppl; then  # perplexity of qwencopy's arms on the same windows
  Q="--model qwen2.5-0.5b"; A=$W/qp8192/scaled.safetensors; C=$W/qp8192/copy.safetensors
  oscar validate ppl $Q --artifact $C --methods oscar-int2 $P --out $W/gc_ppl
  oscar validate ppl $Q --artifact $A --methods bf16,oscar-layer-int2 $P --out $W/gs_ppl
  python lab/candidates_ab.py --niah $W/gs4k_hard $W/gc4k_hard --ppl $W/gs_ppl $W/gc_ppl --base oscar-layer-int2 \
    --rename $W/gs4k_hard:oscar-int2=oscar-scaled-int2 $W/gc4k_hard:oscar-int2=oscar-layer-copy-int2 \
    $W/gc_ppl:oscar-int2=oscar-layer-copy-int2 --out lab/results/ab_qwen_copy_ppl.json
fi
if has smollm2copy; then  # widths per layer by a retrieval signal through the model, against the output-error DP's
  A=$W/s4096/scaled.safetensors; C=$W/s4096/copy.safetensors
  oscar calibrate --model smollm2-135m --store $W/s4096/calib.zarr --tokens 65536 --seq-len 4096 --no-progress  # resumes / done
  [ -e $W/s4096/scaled.fit.safetensors ] || oscar fit $W/s4096/calib.zarr --variant scaled --out $W/s4096/scaled.fit.safetensors --no-progress
  [ -e $A ] || oscar validate tune --artifact $W/s4096/scaled.fit.safetensors --out $A --no-progress
  python lab/layer_copy_widths.py --artifact $A --windows 4 --out-artifact $C --no-progress \
    --out bench/results/layer_copy_smollm2.json
  oscar validate ppl --artifact $C --methods oscar-int2 $P --out $W/cc_ppl
  oscar validate ppl --artifact $A --methods bf16,oscar-int2,oscar-layer-int2 $P --out $W/cw_ppl
  for s in 0 1; do
    oscar validate niah --artifact $A --methods bf16,oscar-int2,oscar-layer-int2 $N --seed $s --out $W/cw4k_s$s
    oscar validate niah --artifact $C --methods oscar-int2 $N --seed $s --out $W/cc4k_s$s
  done
  python lab/candidates_ab.py --niah $W/cw4k_s0 $W/cw4k_s1 $W/cc4k_s0 $W/cc4k_s1 --base oscar-layer-int2 \
    --rename $W/cw4k_s0:oscar-int2=oscar-scaled-int2 $W/cw4k_s1:oscar-int2=oscar-scaled-int2 \
    $W/cc4k_s0:oscar-int2=oscar-layer-copy-int2 $W/cc4k_s1:oscar-int2=oscar-layer-copy-int2 \
    --out lab/results/ab_smollm2_copy.json
  python lab/candidates_ab.py --niah $W/cw4k_s0 $W/cw4k_s1 $W/cc4k_s0 $W/cc4k_s1 --ppl $W/cw_ppl $W/cc_ppl \
    --base oscar-layer-int2 --rename $W/cw4k_s0:oscar-int2=oscar-scaled-int2 $W/cw4k_s1:oscar-int2=oscar-scaled-int2 \
    $W/cc4k_s0:oscar-int2=oscar-layer-copy-int2 $W/cc4k_s1:oscar-int2=oscar-layer-copy-int2 \
    $W/cw_ppl:oscar-int2=oscar-scaled-int2 $W/cc_ppl:oscar-int2=oscar-layer-copy-int2 \
    --out lab/results/ab_smollm2_copy_ppl.json
  python lab/candidates_ab.py --niah $W/cw4k_s0 $W/cw4k_s1 $W/cc4k_s0 $W/cc4k_s1 --base oscar-scaled-int2 \
    --rename $W/cw4k_s0:oscar-int2=oscar-scaled-int2 $W/cw4k_s1:oscar-int2=oscar-scaled-int2 \
    $W/cc4k_s0:oscar-int2=oscar-layer-copy-int2 $W/cc4k_s1:oscar-int2=oscar-layer-copy-int2 \
    --out lab/results/ab_smollm2_copy_vs_scaled.json
  # the goal's cells for each per-layer arm (bf16 and the output-error widths from the same runs)
  python lab/goal_cells.py --goal smollm2 --niah $W/cc4k_s0 $W/cc4k_s1 --bf16 $W/cw4k_s0 $W/cw4k_s1 \
    --ppl $W/cc_ppl $W/cw_ppl --label oscar-layer-copy-int2 --out lab/results/goal_smollm2_copy.json
  python lab/goal_cells.py --goal smollm2 --niah $W/cw4k_s0 $W/cw4k_s1 --ppl $W/cw_ppl --method oscar-layer-int2 \
    --out lab/results/goal_smollm2_layer.json
fi
if has smollm2seed2; then  # a third needle seed for smollm2copy's arms (its goal table asked for ~100 pairs at 1k)
  oscar validate niah --artifact $W/s4096/scaled.safetensors --methods bf16,oscar-layer-int2 $N --seed 2 --out $W/cw4k_s2
  oscar validate niah --artifact $W/s4096/copy.safetensors --methods oscar-int2 $N --seed 2 --out $W/cc4k_s2
  python lab/goal_cells.py --goal smollm2 --niah $W/cc4k_s{0,1,2} --bf16 $W/cw4k_s{0,1,2} --ppl $W/cc_ppl $W/cw_ppl \
    --label oscar-layer-copy-int2 --out lab/results/goal_smollm2_copy_3seeds.json
  python lab/goal_cells.py --goal smollm2 --niah $W/cw4k_s{0,1,2} --ppl $W/cw_ppl --method oscar-layer-int2 \
    --out lab/results/goal_smollm2_layer_3seeds.json
  python lab/candidates_ab.py --niah $W/cw4k_s{0,1,2} $W/cc4k_s{0,1,2} --base oscar-layer-int2 \
    --rename $W/cw4k_s0:oscar-int2=oscar-scaled-int2 $W/cw4k_s1:oscar-int2=oscar-scaled-int2 $W/cc4k_s0:oscar-int2=oscar-layer-copy-int2 $W/cc4k_s1:oscar-int2=oscar-layer-copy-int2 \
    $W/cc4k_s2:oscar-int2=oscar-layer-copy-int2 --out lab/results/ab_smollm2_copy_3seeds.json
fi
if has smollm2split; then  # the shipped format (split keys, its own tune) on smollm2copy's store, the same samples and windows
  oscar fit $W/s4096/calib.zarr --variant split --out $W/s4096/fit.safetensors --no-progress
  oscar validate tune --artifact $W/s4096/fit.safetensors --out $W/s4096/nll.safetensors --no-progress
  for s in 0 1 2; do oscar validate niah --artifact $W/s4096/nll.safetensors --methods oscar-int2 $N --seed $s --out $W/cs4k_s$s; done
  oscar validate ppl --artifact $W/s4096/nll.safetensors --methods oscar-int2 $P --out $W/cs_ppl
  python lab/candidates_ab.py --niah $W/cw4k_s{0,1,2} $W/cc4k_s{0,1,2} $W/cs4k_s{0,1,2} --ppl $W/cw_ppl $W/cc_ppl $W/cs_ppl \
    --rename $W/cw4k_s0:oscar-int2=oscar-scaled-int2 $W/cw4k_s1:oscar-int2=oscar-scaled-int2 $W/cw_ppl:oscar-int2=oscar-scaled-int2 \
    $W/cc4k_s0:oscar-int2=oscar-layer-copy-int2 $W/cc4k_s1:oscar-int2=oscar-layer-copy-int2 \
    $W/cc4k_s2:oscar-int2=oscar-layer-copy-int2 $W/cc_ppl:oscar-int2=oscar-layer-copy-int2 \
    --out lab/results/ab_smollm2_copy_vs_shipped.json
  python lab/goal_cells.py --goal smollm2 --niah $W/cs4k_s{0,1,2} --bf16 $W/cw4k_s{0,1,2} --ppl $W/cs_ppl $W/cw_ppl \
    --out lab/results/goal_smollm2_shipped_3seeds.json
fi
if has smollm2cheap; then  # `oscar validate widths` (the per-layer format OscarCache serves) with a 4x cheaper probe, same samples
  A=$W/s4096/scaled.safetensors; Q=$W/s4096/widths_2x1024.safetensors
  oscar validate widths --artifact $A --windows 2 --length 1024 --out $Q --no-progress  # resumes from its probe log
  for s in 0 1 2; do oscar validate niah --artifact $Q --methods oscar-int2 $N --seed $s --out $W/cq4k_s$s; done
  oscar validate ppl --artifact $Q --methods oscar-int2 $P --out $W/cq_ppl
  R="$W/cc_ppl:oscar-int2=oscar-layer-copy-int2 $W/cq_ppl:oscar-int2=oscar-layer-copy-2x1024 $W/cw_ppl:oscar-int2=oscar-scaled-int2"
  for s in 0 1 2; do R="$R $W/cc4k_s$s:oscar-int2=oscar-layer-copy-int2 $W/cq4k_s$s:oscar-int2=oscar-layer-copy-2x1024"; done
  python lab/candidates_ab.py --niah $W/cc4k_s{0,1,2} $W/cq4k_s{0,1,2} --ppl $W/cc_ppl $W/cq_ppl $W/cw_ppl --base oscar-layer-copy-int2 \
    --rename $R --out lab/results/ab_smollm2_cheap_probe.json
  R="$W/cq_ppl:oscar-int2=oscar-layer-copy-2x1024 $W/cw_ppl:oscar-int2=oscar-scaled-int2"; for s in 0 1 2; do R="$R $W/cq4k_s$s:oscar-int2=oscar-layer-copy-2x1024"; done
  python lab/candidates_ab.py --niah $W/cs4k_s{0,1,2} $W/cq4k_s{0,1,2} --ppl $W/cs_ppl $W/cq_ppl $W/cw_ppl --rename $R \
    --out lab/results/ab_smollm2_cheap_vs_shipped.json  # against the shipped split keys (smollm2split)
  python lab/goal_cells.py --goal smollm2 --niah $W/cq4k_s{0,1,2} --bf16 $W/cw4k_s{0,1,2} --ppl $W/cq_ppl $W/cw_ppl \
    --label oscar-layer-copy-2x1024 --out lab/results/goal_smollm2_cheap_probe.json
fi
if has qwencopygoal; then  # bf16 on qwencopy's samples, then the goal's cells for the copy-chosen widths (hard tasks, 1k-4k)
  Q="--model qwen2.5-0.5b"; C=$W/qp8192/copy.safetensors
  G="--tasks niah_single_3,niah_multikey_1 --lengths 1k,2k,4k --samples 20 --protocol serving --dtype bfloat16 --no-progress"
  oscar validate niah $Q --artifact $C --methods bf16 $G --out $W/gb4k_hard
  python lab/goal_cells.py --goal qwen --niah $W/gc4k_hard --bf16 $W/gb4k_hard --ppl $W/gc_ppl $W/gs_ppl \
    --label oscar-layer-copy-int2 --out lab/results/goal_qwen_copy.json
fi
if has qwencopyeasy; then  # niah_single_1/2 at 1k-4k with Qwen's copy widths as the cache's per-layer format (oscar-int2)
  Q="--model qwen2.5-0.5b"; C=$W/qp8192/copy.native.safetensors
  [ -e $C ] || python lab/native_widths.py --model qwen2.5-0.5b --artifact $W/qp8192/copy.safetensors \
    --out-artifact $C --out lab/results/native_widths_qwen.json
  oscar validate niah $Q --artifact $C --methods bf16,oscar-int2 $N --out $W/gq4k_easy
  python lab/goal_cells.py --goal qwen --niah $W/gq4k_easy --ppl $W/gc_ppl $W/gs_ppl \
    --label oscar-layer-copy-int2 --out lab/results/goal_qwen_copy_easy.json
fi
if has smollm2grad; then  # the copy probe to first order (validate.tune.layer_copy_gradients), same windows and samples
  A=$W/s4096/scaled.safetensors; G=$W/s4096/grad.safetensors
  python lab/copy_gradients.py --artifact $A --log $W/s4096/copy.safetensors.probes.jsonl --windows 4 --length 2048 \
    --out lab/results/copy_gradients_smollm2.json --no-progress
  python lab/copy_gradients.py --artifact $A --log $W/s4096/widths_2x1024.safetensors.probes.jsonl --windows 2 \
    --length 1024 --out lab/results/copy_gradients_smollm2_2x1024.json --no-progress
  oscar validate widths --artifact $A --estimate gradient --windows 4 --length 2048 --out $G --no-progress
  for s in 0 1 2; do oscar validate niah --artifact $G --methods oscar-int2 $N --seed $s --out $W/cg4k_s$s; done
  oscar validate ppl --artifact $G --methods oscar-int2 $P --out $W/cg_ppl
  R="$W/cc_ppl:oscar-int2=oscar-layer-copy-int2 $W/cg_ppl:oscar-int2=oscar-layer-grad-int2 $W/cw_ppl:oscar-int2=oscar-scaled-int2"
  for s in 0 1 2; do R="$R $W/cc4k_s$s:oscar-int2=oscar-layer-copy-int2 $W/cg4k_s$s:oscar-int2=oscar-layer-grad-int2"; done
  python lab/candidates_ab.py --niah $W/cc4k_s{0,1,2} $W/cg4k_s{0,1,2} --ppl $W/cc_ppl $W/cg_ppl $W/cw_ppl --base oscar-layer-copy-int2 \
    --rename $R --out lab/results/ab_smollm2_grad_vs_probe.json
  R="$W/cg_ppl:oscar-int2=oscar-layer-grad-int2 $W/cw_ppl:oscar-int2=oscar-scaled-int2"; for s in 0 1 2; do R="$R $W/cg4k_s$s:oscar-int2=oscar-layer-grad-int2"; done
  python lab/candidates_ab.py --niah $W/cs4k_s{0,1,2} $W/cg4k_s{0,1,2} --ppl $W/cs_ppl $W/cg_ppl $W/cw_ppl --rename $R \
    --out lab/results/ab_smollm2_grad_vs_shipped.json  # against the shipped split keys (smollm2split)
  python lab/goal_cells.py --goal smollm2 --niah $W/cg4k_s{0,1,2} --bf16 $W/cw4k_s{0,1,2} --ppl $W/cg_ppl $W/cw_ppl \
    --label oscar-layer-grad-int2 --out lab/results/goal_smollm2_grad.json
fi
if has qwengrad; then  # the first-order estimate against qwencopy's measured probe (4 x 1024 windows); its widths' hard needles
  Q="--model qwen2.5-0.5b"; G=$W/qp8192/grad.safetensors
  [ -e lab/results/copy_gradients_qwen.json ] || python lab/copy_gradients.py $Q --artifact $W/qp8192/scaled.safetensors \
    --log $W/qp8192/copy.safetensors.probes.jsonl --windows 4 --length 1024 --out lab/results/copy_gradients_qwen.json --no-progress
  oscar validate widths $Q --artifact $W/qp8192/scaled.safetensors --estimate gradient --windows 4 --length 1024 --out $G --no-progress
  NH="--tasks niah_single_3,niah_multikey_1 --lengths 1k,2k,4k --samples 20 --protocol serving --dtype bfloat16 --no-progress"
  oscar validate niah $Q --artifact $G --methods oscar-int2 $NH --out $W/gg4k_hard
  oscar validate ppl $Q --artifact $G --methods oscar-int2 $P --out $W/gg_ppl
  R="$W/gc4k_hard:oscar-int2=oscar-layer-copy-int2 $W/gg4k_hard:oscar-int2=oscar-layer-grad-int2"
  R="$R $W/gc_ppl:oscar-int2=oscar-layer-copy-int2 $W/gg_ppl:oscar-int2=oscar-layer-grad-int2"
  python lab/candidates_ab.py --niah $W/gb4k_hard $W/gc4k_hard $W/gg4k_hard --ppl $W/gs_ppl $W/gc_ppl $W/gg_ppl \
    --base oscar-layer-copy-int2 --rename $R --out lab/results/ab_qwen_grad_vs_probe.json
  python lab/goal_cells.py --goal qwen --niah $W/gg4k_hard --bf16 $W/gb4k_hard --ppl $W/gg_ppl $W/gs_ppl \
    --label oscar-layer-grad-int2 --out lab/results/goal_qwen_grad.json
fi
if has smollm2grad4k; then  # the first-order widths read at the longest needle length: 4 x 4096 windows against smollm2grad's 4 x 2048
  A=$W/s4096/scaled.safetensors; G=$W/s4096/grad_4x4096.safetensors
  oscar validate widths --artifact $A --estimate gradient --windows 4 --length 4096 --out $G --no-progress
  for s in 0 1 2; do oscar validate niah --artifact $G --methods oscar-int2 $N --seed $s --out $W/cg4l_s$s; done
  oscar validate ppl --artifact $G --methods oscar-int2 $P --out $W/cg4l_ppl
  R="$W/cg_ppl:oscar-int2=oscar-layer-grad-int2 $W/cg4l_ppl:oscar-int2=oscar-layer-grad4k-int2 $W/cw_ppl:oscar-int2=oscar-scaled-int2"
  for s in 0 1 2; do R="$R $W/cg4k_s$s:oscar-int2=oscar-layer-grad-int2 $W/cg4l_s$s:oscar-int2=oscar-layer-grad4k-int2"; done
  python lab/candidates_ab.py --niah $W/cg4k_s{0,1,2} $W/cg4l_s{0,1,2} --ppl $W/cg_ppl $W/cg4l_ppl $W/cw_ppl --base oscar-layer-grad-int2 \
    --rename $R --out lab/results/ab_smollm2_grad_4x4096.json
  python lab/goal_cells.py --goal smollm2 --niah $W/cg4l_s{0,1,2} --bf16 $W/cw4k_s{0,1,2} --ppl $W/cg4l_ppl $W/cw_ppl \
    --label oscar-layer-grad4k-int2 --out lab/results/goal_smollm2_grad_4x4096.json
fi
if has smollm2attr; then  # the committed example's artifact (oscar run's default widths): keys or values exact, 40 samples
  python bench/niah_attribution.py --artifact reports/examples/smollm2/artifact.safetensors --tasks niah_single_2 --lengths 4096 \
    --samples 40 --run-dir $W/attr_smollm2_grad --out lab/results/attribution_smollm2_grad.json
fi
if has smollm2attrlayers; then  # keys exact in one class of layers at a time, paired with smollm2attr's bf16 / oscar-int2
  python bench/niah_attribution.py --artifact reports/examples/smollm2/artifact.safetensors --key-classes --tasks niah_single_2 \
    --lengths 4096 --samples 40 --reuse $W/attr_smollm2_grad --run-dir $W/attr_smollm2_layers \
    --out lab/results/attribution_smollm2_layers.json
fi
if has tables; then
  python lab/candidates_ab.py --niah $W/c2k_s0 $W/c2k_s1 $W/c4k_s0 $W/c4k_s1 $W/c8k_s0 $W/g2k_s0 --ppl $W/ppl_c2k $W/ppl_c4k \
    --rename $W/c4k_s0:oscar-int2=oscar-c4k-int2 $W/c4k_s1:oscar-int2=oscar-c4k-int2 $W/c8k_s0:oscar-int2=oscar-c8k-int2 \
    $W/g2k_s0:oscar-int2=oscar-guarded-int2 $W/ppl_c4k:oscar-int2=oscar-c4k-int2 \
    --out lab/results/ab_smollm2_calib_length.json
  python lab/candidates_ab.py --niah $W/q2k_8k $W/q8k_8k --rename $W/q8k_8k:oscar-int2=oscar-c8k-int2 \
    --out lab/results/ab_qwen_calib_length.json
  python lab/candidates_ab.py --niah $W/qp4k_4k $W/q2k_4k --rename $W/qp4k_4k:oscar-int2=oscar-p4k-int2 \
    --out lab/results/ab_qwen_4k_positions.json
  python lab/candidates_ab.py --niah $W/c2k_s0 $W/c2k_s1 $W/c4k_s0 $W/c4k_s1 $W/c4ks_s0 $W/c4ks_s1 \
    --ppl $W/ppl_c2k $W/ppl_c4k $W/ppl_c4k_serve \
    --rename $W/c2k_s0:oscar-int2=oscar-c2k $W/c2k_s1:oscar-int2=oscar-c2k $W/ppl_c2k:oscar-int2=oscar-c2k \
    $W/c4ks_s0:oscar-int2=oscar-c4ks-int2 $W/c4ks_s1:oscar-int2=oscar-c4ks-int2 $W/ppl_c4k_serve:oscar-int2=oscar-c4ks-int2 \
    --out lab/results/ab_smollm2_servetune.json
  # per-layer widths on the grid's store against the grid's oscar-int2 (the same samples and windows). bf16 of the 4k / 8k
  # hard tasks comes from runs of the same samples, listed first: the grid's oscar-int2 records replace theirs
  python lab/candidates_ab.py --niah $W/qp4k_4k $W/q2k_8k $W/gp8k_short $W/gp8k_4k_hard $W/gp8k_8k_hard $W/gl8k_hard \
    $W/gt8k_hard --ppl $W/gp8k_ppl $W/gl8k_ppl --out lab/results/ab_qwen_layers.json
  # the clip confound: paired against the unclipped 2-bit artifact, scaled − unclip is the clip's share and
  # layer widths − unclip the bit's (the same scaled fit and tune); against the clipped 2-bit scaled fit, layer
  # widths − scaled is their whole effect and oscar-int2 (split keys, the grid's artifact) − scaled the fit's
  python lab/candidates_ab.py --niah $W/gn4k_hard $W/gs4k_hard $W/gu4k_hard --base oscar-unclip-int2 \
    --rename $W/gs4k_hard:oscar-int2=oscar-scaled-int2 $W/gu4k_hard:oscar-int2=oscar-unclip-int2 \
    --out lab/results/ab_qwen_unclip.json
  python lab/candidates_ab.py --niah $W/gn4k_hard $W/gs4k_hard $W/gu4k_hard --base oscar-scaled-int2 \
    --rename $W/gs4k_hard:oscar-int2=oscar-scaled-int2 $W/gu4k_hard:oscar-int2=oscar-unclip-int2 \
    --out lab/results/ab_qwen_unclip_vs_scaled.json
  python lab/candidates_ab.py --niah $W/gn4k_hard $W/gs4k_hard $W/gu4k_hard \
    --rename $W/gs4k_hard:oscar-int2=oscar-scaled-int2 $W/gu4k_hard:oscar-int2=oscar-unclip-int2 \
    --out lab/results/ab_qwen_unclip_vs_shipped.json
  python lab/candidates_ab.py --niah $W/c2k_s0 $W/c2k_s1 $W/c4k_s0 $W/c4k_s1 $W/cl4k_s0 $W/cl4k_s1 \
    --ppl $W/ppl_c2k $W/ppl_c4k $W/ppl_cl4k --rename $W/c2k_s0:oscar-int2=oscar-c2k $W/c2k_s1:oscar-int2=oscar-c2k \
    $W/ppl_c2k:oscar-int2=oscar-c2k --out lab/results/ab_smollm2_layers.json
  # the issue's goal cell by cell: SmolLM2 as `oscar run` ships it (calibrated at 4096), both seeds, and the committed
  # example; Qwen with windows read to 8192, 16k read to 16384 (bf16 of the 4k / 8k hard tasks from runs of the same samples)
  python lab/goal_cells.py --goal smollm2 --niah $W/c4k_s0 $W/c4k_s1 --bf16 $W/c2k_s0 $W/c2k_s1 \
    --ppl $W/ppl_c4k $W/ppl_c2k --out lab/results/goal_smollm2.json
  python lab/goal_cells.py --goal smollm2 --niah reports/examples/smollm2 --ppl reports/examples/smollm2 \
    --out lab/results/goal_smollm2_example.json
  python lab/goal_cells.py --goal qwen --niah $W/gp8k_short $W/gp8k_4k_easy $W/gp8k_4k_hard $W/gp8k_8k_hard \
    $W/gp8k_8k_easy $W/gp16k $W/gp8k_more --bf16 $W/qp4k_4k $W/q2k_8k --ppl $W/gp8k_ppl --out lab/results/goal_qwen.json
  python lab/niah_misses.py --model qwen2.5-0.5b --niah $W/gp8k_short $W/gp8k_4k_easy $W/gp8k_4k_hard $W/gp8k_8k_hard \
    $W/gp8k_8k_easy $W/gp16k --bf16 $W/qp4k_4k $W/q2k_8k --out lab/results/misses_qwen.json
  python lab/niah_misses.py --model smollm2-135m --niah $W/c4k_s0 $W/c4k_s1 --bf16 $W/c2k_s0 $W/c2k_s1 \
    --out lab/results/misses_smollm2.json
fi
