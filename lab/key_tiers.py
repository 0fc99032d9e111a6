"""Key tiers, a screen: other ways to spend split keys' 2.75 bits across the query eigenbasis.

Split keys (oscar-int2) store the D/4 directions of the query eigenbasis that matter most at 3 bits and the rest
at 2, each part a per-token group with 8-bit scale/zero. Reverse water-filling says a direction's bits should
grow with log(λ_i σ_i²) and a direction no query reads should get none: a key component along it only shifts
every logit of a query by the same amount, which the softmax ignores. This screens tier layouts of the same key
budget (codes + 16 bits of params per stored part <= 176 bits per 64-dim row, the 2.75 of split keys; checked by
`oscar.quant.parts_bits_per_element`), placed, scaled, Hadamard-mixed and clipped per part by
`stats.split.fit_split_keys` (what the split and tiers fits run), on the store's
reservoir rows with the fit's key objective (relative q-weighted logit MSE, in-sample for all, before the tune).
A "0" part is not stored: its keys read as the calibrated mean.

    python lab/key_tiers.py --artifact runs/i16b/scaled.safetensors --out lab/results/tiers_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

LAYOUTS = ["16x3+48x2", "16x4+40x2+8x0", "24x3+32x2+8x0", "32x3+24x2+8x0", "32x3+16x2+16x0", "20x3+40x2+4x0",
           "12x4+48x2+4x0", "24x4+24x2+16x0", "48x3+16x0", "40x3+24x1", "16x3+32x2+16x1", "64x2"]


def parse(layout: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in p.split("x")) for p in layout.split("+")]


def tier_parts(tiers: list[tuple[int, int]]) -> list:
    """The stored parts [(a, b, spec)] of a layout; its "0" tiers must come last (channels after the parts are
    not stored: `stats.split.fit_split_keys`)."""
    from oscar.quant import QuantSpec

    parts, a = [], 0
    for n, b in tiers:
        if b:
            assert a == (parts[-1][1] if parts else 0), "not-stored tiers must come last"
            parts.append((a, a + n, QuantSpec(bits=b, param_dtype=torch.float8_e4m3fn)))
        a += n
    return parts


def key_bits(tiers: list[tuple[int, int]], D: int) -> float:
    from oscar.quant import parts_bits_per_element

    return parts_bits_per_element(tier_parts(tiers), D)


def main(argv=None) -> int:
    from oscar.stats.artifact import load_artifact
    from oscar.stats.fit import FitConfig
    from oscar.stats.split import fit_split_keys, layer_inputs
    from oscar.scoring import layer_formats as cb
    from oscar.recipe import widths as wd

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", required=True, help="oscar-int2 artifact (scaled variant) whose store still exists")
    ap.add_argument("--layouts", nargs="*", default=LAYOUTS)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    art = load_artifact(a.artifact)
    store, _, layers = cb.store_layers(art, "tier screen")
    D = art.head_dim
    ratios = np.array(FitConfig().clip_ratios)
    budget = key_bits(parse("16x3+48x2"), D)
    per: dict[str, list[float]] = {}
    for l, ls in enumerate(layers):
        mu = art.k_mean[l].double().numpy()
        U, lam, sig2 = layer_inputs(ls, mu)
        _, k, _ = wd._rows(ls, seed=l)
        kc = k - torch.from_numpy(mu)[:, None, :]
        Cq = np.asarray(ls.cov("q"), dtype=np.float64)
        for lay in a.layouts:
            tiers = parse(lay)
            assert sum(n for n, _ in tiers) == D, lay
            e = fit_split_keys(U, lam, sig2, kc, Cq, tier_parts(tiers), ratios).err  # the fit's placement and clips
            per.setdefault(lay, []).append(float(e.mean()))
        print(f"layer {l}: " + "  ".join(f"{lay} {per[lay][-1]:.4f}" for lay in a.layouts), flush=True)
    ref = np.array(per["16x3+48x2"])
    summary = {lay: {"key_bits": round(key_bits(parse(lay), D), 4), "within_budget": key_bits(parse(lay), D) <= budget + 1e-9,
                     "mean_err": float(np.mean(v)), "vs_split_keys": float(np.mean(np.array(v) / ref)),
                     "layers_better_than_split_keys": int(sum(np.array(v) < ref))}
               for lay, v in per.items()}
    res = {"artifact": a.artifact, "store": store, "budget_key_bits": budget,
           "objective": "relative q-weighted logit MSE (stats/clip.py key objective), reservoir rows, per-part clips "
                        "searched, directions ranked by the better of lambda*sigma2 and lambda per layer (stats.split.fit_split_keys, as "
                        "the split and tiers fits), before the tune",
           "summary": summary, "per_layer": per, "layers": len(ref), "seconds": round(time.perf_counter() - t0, 1),
           "command": "python " + " ".join(sys.argv)}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    for lay, v in sorted(summary.items(), key=lambda kv: kv[1]["vs_split_keys"]):
        print(f"{lay:18s} key bits {v['key_bits']:.3f}  err {v['mean_err']:.4f}  x split keys {v['vs_split_keys']:.3f}"
              f"  better on {v['layers_better_than_split_keys']}/{len(ref)} layers")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
