"""The confound in per-layer widths: oscar-layer-int2 stores its wider key layers unclipped (fp16
scale/zero, clip 1), so is its needle gain the bits or the unclipped extremes? This writes the one-group artifact
with the key clip switched off (ratio 1) in exactly the layers oscar-layer-int2 widens, everything else as is
(2 bits, fp8 scale/zero: fewer bits than oscar-layer-int2, the same format as the artifact, so the paged cache
and the kernels run it unchanged).

    python lab/unclip_wide_layers.py --artifact runs/i16e/qp8192/scaled.safetensors \
        --widths lab/results/widths_qwen.json --out runs/i16e/qp8192/unclip.safetensors
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def main(argv=None) -> int:
    from oscar.stats.artifact import load_artifact, save_artifact

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", required=True, help="the one-group artifact oscar-layer-int2 was built on")
    ap.add_argument("--widths", required=True, help="lab/layer_widths_dp.py's JSON for that artifact")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    art = load_artifact(args.artifact)
    widths = json.load(open(args.widths))["oscar-layer-int2"]["widths"]
    if len(widths) != art.num_layers:
        raise SystemExit(f"{args.widths} has {len(widths)} layers, {args.artifact} {art.num_layers}")
    layers = [l for l, (kb, _) in enumerate(widths) if kb != art.quant.bits]
    for l in layers:
        art.clip_k[l] = torch.ones_like(art.clip_k[l])
    art.meta["unclipped_key_layers"] = layers
    save_artifact(art, args.out)
    print(f"{args.out}: key clip 1 in layers {layers} (oscar-layer-int2's wide layers), the rest as {args.artifact}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
