"""The copy probe to first order. `validate.tune.layer_copy_gradients` (one forward + backward per copy
window) against `layer_copy_errors` (2L + 1 forwards) on the same artifact, windows and options: each layer's
estimated against measured copied-span NLL change, their rank correlation, and the widths the DP picks from each
(the same DP, the same 2.5-bit budget). The measured table comes from the probe log a previous run wrote (resumed:
nothing is re-measured if the log is complete).

    python lab/copy_gradients.py --artifact runs/i16e/s4096/scaled.safetensors \
        --log runs/i16e/s4096/copy.safetensors.probes.jsonl --windows 4 --length 2048 \
        --out lab/results/copy_gradients_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main(argv=None) -> int:
    import numpy as np
    from scipy.stats import pearsonr, spearmanr

    from oscar.stats.artifact import load_artifact
    from oscar.recipe import widths as wd
    from oscar.validate.env import load_model
    from oscar.recipe.tune import TuneConfig
    from oscar.recipe.widths import layer_copy_errors, layer_copy_gradients

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--artifact", required=True, help="the tuned one-group (scaled) artifact the probe log was written for")
    ap.add_argument("--log", required=True, help="the measured probe's log (layer_copy_errors)")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    art = load_artifact(args.artifact)
    model, tok, _ = load_model(args.model)
    cfg = TuneConfig(copy_windows=args.windows, copy_length=args.length)
    opts = wd.COPY_OPTIONS
    t0 = time.perf_counter()
    meas = layer_copy_errors(model, tok, art, opts, cfg, log=args.log, progress=not args.no_progress)
    t1 = time.perf_counter()
    est = layer_copy_gradients(model, tok, art, opts, cfg, progress=not args.no_progress)
    t2 = time.perf_counter()
    res = {"artifact": args.artifact, "model": args.model, "options": [list(o) for o in opts], "windows": args.windows,
           "length": args.length, "measured": meas.round(6).tolist(), "estimated": est.round(6).tolist(),
           "seconds_measured_from_log": round(t1 - t0, 1), "seconds_gradients": round(t2 - t1, 1)}
    for o in range(1, len(opts)):
        res[f"bits{opts[o][0]}"] = {"pearson": round(float(pearsonr(meas[:, o], est[:, o])[0]), 4),
                                    "spearman": round(float(spearmanr(meas[:, o], est[:, o])[0]), 4)}
    picks = {}
    for name, err in (("measured", meas), ("estimated", est)):
        a = wd.layer_artifact(art, opts, "oscar-layer-copy-int2", err)
        w = [opts.index(tuple(x)) for x in a.meta["codec"]["widths"]]
        picks[name] = w
        res[name + "_widths"] = {"key_bits": [opts[o][0] for o in w],
                                 "measured_nll_change_summed": round(float(sum(meas[l, o] for l, o in enumerate(w))), 6)}
    res["same_widths"] = picks["measured"] == picks["estimated"]
    for l in range(art.num_layers):
        print(f"layer {l:2d}  measured {meas[l, 1]:+.4f} {meas[l, 2]:+.4f}  estimated {est[l, 1]:+.4f} {est[l, 2]:+.4f}"
              f"  widths {opts[picks['measured'][l]][0]} / {opts[picks['estimated'][l]][0]}")
    print(json.dumps({k: v for k, v in res.items() if k not in ("measured", "estimated")}))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
