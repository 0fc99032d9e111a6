"""Diagnostic: does a key format keep the logit of the key a query prefers most?

On the calibration store's reservoir rows (the fit's own sample: in-sample for every method, so this
measures the format, not generalisation), per layer: the logit q·k / sqrt(D) of each reservoir query's
top key before and after the method's INT2 reading of the keys (LayerQuant, as the simulator runs it),
and the mean |logit error| over all query-key pairs. A format can have the same average error and still
shrink the winner (a needle): an MSE-optimal codebook puts its outer levels at the tail's conditional
mean, below the extreme values.

    python lab/top_logit.py --artifact runs/i16/artifact.safetensors --out lab/results/top_logit.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", required=True, help="oscar-int2 artifact (its calibration store must exist)")
    ap.add_argument("--methods", default="oscar-int2,oscar-lm-int2,oscar-sparse-int2")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    from oscar.stats.artifact import load_artifact
    from oscar.stats.reduce import LayerStats, ReduceConfig, open_store
    from oscar.kernels.simulate import LayerQuant
    from oscar.validate.methods import fitted_for

    art = load_artifact(a.artifact)
    methods = a.methods.split(",")
    arts = {m: fitted_for(m, art) for m in methods}
    view = open_store(art.meta["provenance"]["store"])
    D = art.head_dim
    per = {m: [] for m in methods}
    for l in range(art.num_layers):
        ls = LayerStats(view, l, ReduceConfig())
        k, q = (torch.from_numpy(ls.rows(x)).float() for x in "kq")  # (H, N, D)
        s = q @ k.transpose(-1, -2) / D**0.5  # (H, Nq, Nk)
        top = s.argmax(-1, keepdim=True)
        st = s.gather(-1, top)[..., 0]
        gap = st - s.scatter(-1, top, float("-inf")).max(-1).values
        for m in methods:
            sh = q @ LayerQuant(arts[m], l).keys(k[None])[0].transpose(-1, -2) / D**0.5
            d = sh.gather(-1, top)[..., 0] - st
            per[m].append({"layer": l, "top_shift": float(d.mean()), "top_abs_err": float(d.abs().mean()),
                           "all_abs_err": float((sh - s).abs().mean()), "top_gap": float(gap.mean()),
                           "top_kept": float((sh.argmax(-1, keepdim=True) == top).float().mean())})
    summary = {m: {k: sum(r[k] for r in rows) / len(rows) for k in ("top_shift", "top_abs_err", "all_abs_err", "top_gap", "top_kept")}
               for m, rows in per.items()}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"artifact": a.artifact, "summary": summary, "per_layer": per,
                   "rows_per_head": int(k.shape[1]), "note": "in-sample (reservoir rows), mean over layers and KV heads"}, f, indent=1)
    for m, s in summary.items():
        print(f"{m:18s} " + " ".join(f"{k} {v:+.4f}" for k, v in s.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
