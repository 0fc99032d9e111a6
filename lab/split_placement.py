"""Split keys' placement: does *where* the 3-bit part goes matter, or only that keys get 2.75 bits?

oscar-mix-int2 places its D/4 wide directions of the query eigenbasis by C_Q (λ_i, or λ_i σ_i², whichever
fits the calibration rows better). This compares, per layer on the store's reservoir rows (the fit's key
objective: relative q-weighted logit MSE, per-part clips searched for each placement, in-sample for all),
the rules against controls in the same format and bits: random directions (seeded, TurboQuant's choice)
and the D/4 *smallest* λ_i (the wrong end). oscar-int2's own error (its fit record, same objective and
rows, before the tune) is the baseline.

    python lab/split_placement.py --artifact runs/i16b/scaled.safetensors \
        --out lab/results/placement_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch


def main(argv=None) -> int:
    from oscar.stats.artifact import load_artifact
    from oscar.stats.fit import FitConfig
    from oscar.stats.split import fit_split_keys, layer_inputs
    from oscar.scoring import layer_formats as cb
    from oscar.recipe import widths as wd

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", required=True, help="oscar-int2 artifact (scaled variant) whose store still exists")
    ap.add_argument("--random-seeds", type=int, default=3)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    art = load_artifact(a.artifact)
    store, _, layers = cb.store_layers(art, "placement bench")
    D, H = art.head_dim, art.num_kv_heads
    parts = cb.split_quant(art).key_parts(D)
    ratios = np.array(FitConfig().clip_ratios)
    per_rule: dict[str, list[float]] = {}
    base = []
    for l, ls in enumerate(layers):
        mu = art.k_mean[l].double().numpy()
        U, lam, sig2 = layer_inputs(ls, mu)
        _, k, _ = wd._rows(ls, seed=l)
        kc = k - torch.from_numpy(mu)[:, None, :]
        rules = {"lambda": lam, "lambda*sigma2": lam * sig2, "smallest lambda": -lam}
        rng = np.random.default_rng(1000 + l)
        for s in range(a.random_seeds):
            rules[f"random {s}"] = rng.random(lam.shape)
        for name, score in rules.items():
            err = fit_split_keys(U, lam, sig2, kc, ls.cov("q"), parts, ratios, rules={name: score}).err
            per_rule.setdefault(name, []).append(float(np.mean(err)))
        base.append(float(np.mean(art.meta["layers"][l]["clip"]["k"]["err"])))
    chosen = [min(e) for e in zip(per_rule["lambda"], per_rule["lambda*sigma2"])]
    rand = np.mean([per_rule[f"random {s}"] for s in range(a.random_seeds)], axis=0)
    summary = {name: {"mean_err": float(np.mean(v)), "vs_oscar_int2": float(np.mean(np.array(v) / np.array(base)))}
               for name, v in per_rule.items()}
    summary["oscar-mix-int2 (better of lambda, lambda*sigma2)"] = {
        "mean_err": float(np.mean(chosen)), "vs_oscar_int2": float(np.mean(np.array(chosen) / np.array(base)))}
    summary["oscar-int2 (one 2-bit part, fp16 params)"] = {"mean_err": float(np.mean(base)), "vs_oscar_int2": 1.0}
    res = {"artifact": a.artifact, "store": store, "parts": [(a_, b_, sp.bits) for a_, b_, sp in parts], "objective": "relative q-weighted logit MSE "
           "(stats/clip.py key objective), reservoir rows, per-part clips searched per placement, before the tune",
           "summary": summary, "per_layer": {**per_rule, "oscar-int2": base},
           "layers_where_chosen_beats_random_mean": int(sum(c < r for c, r in zip(chosen, rand))), "layers": len(base),
           "seconds": round(time.perf_counter() - t0, 1), "command": "python " + " ".join(sys.argv)}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    for name, v in summary.items():
        print(f"{name:48s} mean err {v['mean_err']:.4f}  x oscar-int2 {v['vs_oscar_int2']:.3f}")
    print(f"chosen beats the random mean on {res['layers_where_chosen_beats_random_mean']}/{len(base)} layers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
