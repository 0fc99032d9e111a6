"""Per-layer key widths: which (key, value) widths the per-layer DP of `validate.codebooks.layer_artifact` gives
each layer, for oscar-layer-int2 and oscar-mix-layer-int2 built on one artifact and its store (and their `-top1`
variants, chosen by the share of query rows whose top key moves), with both calibrated objectives summed over layers
against the all-2-bit base.

    python lab/layer_widths_dp.py --artifact runs/i16e/qp8192/scaled.safetensors \
        --out lab/results/widths_qwen.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter


def main(argv=None) -> int:
    from oscar.stats.artifact import load_artifact
    from oscar.validate import codebooks as cb
    from oscar.validate.methods import bits_per_element

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", required=True, help="a one-group (`oscar fit --variant scaled`) artifact with its store")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    art = load_artifact(args.artifact)
    res = {"artifact": args.artifact}
    for name, build in (("oscar-layer-int2", cb.layer_artifact), ("oscar-mix-layer-int2", cb.mix_layer_artifact),
                        ("oscar-layer-top1-int2", cb.layer_top1_artifact),
                        ("oscar-mix-layer-top1-int2", cb.mix_layer_top1_artifact)):
        d = build(art)
        rec = d.meta["codec"]
        widths = [tuple(w) for w in rec["widths"]]
        res[name] = {"widths": [list(w) for w in widths], "counts": {str(k): v for k, v in Counter(widths).items()},
                     "chosen_by": rec["chosen_by"], "err_total": rec["err_total"], "err_total_base": rec["err_total_base"],
                     "top1_total": rec["top1_total"], "top1_total_base": rec["top1_total_base"],
                     "top1_rows": rec["top1_rows"], "bits_per_element": bits_per_element(d, d.head_dim)}
        wide = ", ".join(f"{l}: {w}" for l, w in enumerate(widths) if w != (2, 2))
        print(f"{name}: {dict(Counter(widths))}; output error {rec['err_total']:.3f} (all 2-bit "
              f"{rec['err_total_base']:.3f}), top-1 moved {rec['top1_total']:.3f} ({rec['top1_total_base']:.3f}; "
              f"summed shares over layers); {res[name]['bits_per_element']:.3f} bits; not (2, 2): {wide}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    json.dump(res, open(args.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
