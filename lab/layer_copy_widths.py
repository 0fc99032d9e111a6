"""Per-layer key widths with a retrieval signal measured through the model: per-layer widths chosen by each layer's
copied-span NLL change on calibration text (`validate.tune.layer_copy_errors`: one layer at a time at (3, 2) or
(4, 2), every other layer at 2 bits, the tune's copy windows under the serving protocol) instead of an average over
reservoir rows (`layer_artifact`'s output / top-1 objectives, which ranked the candidates the wrong way round for
needles: docs/decisions/0068-a-b-per-layer-key-widths-on-both-models-current.md, "per-layer key widths on both models' current stores").

Writes the artifact (the oscar-layer-int2 format, run as `--methods oscar-int2 --artifact OUT`), the probe log
(resumable: a rerun skips finished probes) and a JSON of the table and the widths chosen beside the output-error DP's.

    python lab/layer_copy_widths.py --model qwen2.5-0.5b --artifact runs/i16e/qp8192/scaled.safetensors \
        --out-artifact runs/i16e/qp8192/copy.safetensors --out lab/results/layer_copy_qwen.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

OPTIONS = ((2, 2), (3, 2), (4, 2))  # values stay at 2 bits: the DP never widened them on either model


def main(argv=None) -> int:
    from oscar.stats.artifact import load_artifact, save_artifact
    from oscar.recipe import widths as wd
    from oscar.validate.env import load_model
    from oscar.validate.methods import bits_per_element
    from oscar.recipe.tune import TuneConfig
    from oscar.recipe.widths import layer_copy_errors

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--artifact", required=True, help="a one-group (`oscar fit --variant scaled`, tuned) artifact with its store")
    ap.add_argument("--windows", type=int, default=8, help="copy windows per probe (TuneConfig.copy_windows)")
    ap.add_argument("--length", type=int, default=2048, help="tokens per copy window (TuneConfig.copy_length)")
    ap.add_argument("--out-artifact", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    art = load_artifact(args.artifact)
    model, tok, _ = load_model(args.model)
    cfg = TuneConfig(copy_windows=args.windows, copy_length=args.length)
    log = args.out_artifact + ".probes.jsonl"
    err = layer_copy_errors(model, tok, art, OPTIONS, cfg, log=log, progress=not args.no_progress)
    d = wd.layer_artifact(art, OPTIONS, "oscar-layer-copy-int2", err)
    out = wd.layer_artifact(art, OPTIONS, "oscar-layer-int2")  # the output-error DP on the same options
    save_artifact(d, args.out_artifact)
    res = {"artifact": args.artifact, "model": args.model, "options": [list(o) for o in OPTIONS],
           "copy_windows": cfg.copy_windows, "copy_length": cfg.copy_length, "copy_span": cfg.copy_span,
           "copy_err": err.round(6).tolist()}
    for name, a in (("copy", d), ("output", out)):
        w = [tuple(x) for x in a.meta["codec"]["widths"]]
        res[name] = {"widths": [list(x) for x in w], "counts": {str(k): v for k, v in Counter(w).items()},
                     "copy_err_total": round(float(sum(err[l, OPTIONS.index(x)] for l, x in enumerate(w))), 6),
                     "bits_per_element": bits_per_element(a, a.head_dim)}
        wide = ", ".join(f"{l}: {x}" for l, x in enumerate(w) if x != OPTIONS[0])
        print(f"{name} DP: {dict(Counter(w))}, copy NLL change summed {res[name]['copy_err_total']:+.4f}, "
              f"{res[name]['bits_per_element']:.3f} bits; wide: {wide}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    json.dump(res, open(args.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
