"""Issue 16, hypothesis 5 screen: other ways to spend split keys' 2.75 bits across the query eigenbasis.

Split keys (oscar-int2) store the D/4 directions of the query eigenbasis that matter most at 3 bits and the rest
at 2, each part a per-token group with 8-bit scale/zero. Reverse water-filling says a direction's bits should
grow with log(λ_i σ_i²) and a direction no query reads should get none: a key component along it only shifts
every logit of a query by the same amount, which the softmax ignores. This screens tier layouts of the same key
budget (codes + 16 bits of params per stored part <= 176 bits per 64-dim row, the 2.75 of split keys; checked by
`oscar.quant.parts_bits_per_element`), directions ranked by λ_i σ_i² (or λ_i, whichever fits better, as the
split fit does), each part scaled and Hadamard-mixed within itself, each part's clip searched, on the store's
reservoir rows with the fit's key objective (relative q-weighted logit MSE, in-sample for all, before the tune).
A "0" part is not stored: its keys read as the calibrated mean.

    python bench/issue16_tiers.py --artifact runs/i16b/scaled.safetensors --out bench/results/issue16/tiers_smollm2.json
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


def key_bits(tiers: list[tuple[int, int]], D: int) -> float:
    from oscar.quant import QuantSpec, parts_bits_per_element

    parts, a = [], 0
    for n, b in tiers:
        if b:
            parts.append((a, a + n, QuantSpec(bits=b, param_dtype=torch.float8_e4m3fn)))
        a += n
    return parts_bits_per_element(parts, D)


def layout_error(U, lam, sig2, kc, Cq, tiers, score, ratios) -> np.ndarray:
    """(H,) relative logit MSE of one layer's keys under a tier layout: tier j holds the next n_j directions by score."""
    from oscar.quant import QuantSpec, fake_quant
    from oscar.stats.clip import choose, refine
    from oscar.stats.rotations import importance_scales, mixer

    H, D = lam.shape
    errs = []
    for h in range(H):
        order = np.argsort(-score[h], kind="stable")
        lam_h = np.where(lam[h] > 0, lam[h], 1e-3 * max(lam[h].mean(), 1e-30))  # as split_scaled_rotation
        sig_h = np.where(sig2[h] > 0, sig2[h], 1e-3 * max(sig2[h].mean(), 1e-30))
        k = kc[h].numpy()  # (N, D) centred keys, model space
        e = np.zeros_like(k)  # error, model space
        a = 0
        for n, b in tiers:
            idx = np.sort(order[a:a + n])
            a += n
            Up = U[h][:, idx]  # (D, n)
            if b == 0:  # not stored: the key reads as its mean along these directions
                e += -(k @ Up) @ Up.T
                continue
            d = importance_scales(lam_h[idx][None], sig_h[idx][None])[0]
            M = mixer(n)
            rk, rq = (Up * d) @ M, (Up / d) @ M  # (D, n): y = k rk, k_part = y rq^T
            y = torch.from_numpy(k @ rk)  # (N, n)
            Cp = torch.from_numpy(rq.T @ Cq[h] @ rq)  # (n, n) the query moment read through this part
            den = float(np.einsum("nd,de,ne->", k, Cq[h], k))
            sp = QuantSpec(bits=b, param_dtype=torch.float8_e4m3fn)

            def part_err(cands, y=y, Cp=Cp, sp=sp, den=den):
                out = []
                for c in cands:
                    ey = fake_quant(y.float(), sp, float(c)).double() - y
                    out.append(np.array([float(((ey @ Cp) * ey).sum()) / den]))
                return np.stack(out)

            cands, pe = refine(part_err, ratios, float(ratios.min()), float(ratios.max()))
            c = choose(pe, cands, 0.02, pe[-1]).clip
            ey = fake_quant(y.float(), sp, float(np.asarray(c).reshape(-1)[0])).double() - y
            e += ey.numpy() @ rq.T
        den = float(np.einsum("nd,de,ne->", k, Cq[h], k))
        errs.append(float(np.einsum("nd,de,ne->", e, Cq[h], e)) / den)
    return np.array(errs)


def main(argv=None) -> int:
    from oscar.stats.artifact import load_artifact
    from oscar.stats.fit import FitConfig
    from oscar.stats.split import layer_inputs
    from oscar.validate import codebooks as cb

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
        _, k, _ = cb._rows(ls, seed=l)
        kc = k - torch.from_numpy(mu)[:, None, :]
        Cq = np.asarray(ls.cov("q"), dtype=np.float64)
        for lay in a.layouts:
            tiers = parse(lay)
            assert sum(n for n, _ in tiers) == D, lay
            e = np.minimum(layout_error(U, lam, sig2, kc, Cq, tiers, lam * sig2, ratios),
                           layout_error(U, lam, sig2, kc, Cq, tiers, lam, ratios))
            per.setdefault(lay, []).append(float(e.mean()))
        print(f"layer {l}: " + "  ".join(f"{lay} {per[lay][-1]:.4f}" for lay in a.layouts), flush=True)
    ref = np.array(per["16x3+48x2"])
    summary = {lay: {"key_bits": round(key_bits(parse(lay), D), 4), "within_budget": key_bits(parse(lay), D) <= budget + 1e-9,
                     "mean_err": float(np.mean(v)), "vs_split_keys": float(np.mean(np.array(v) / ref)),
                     "layers_better_than_split_keys": int(sum(np.array(v) < ref))}
               for lay, v in per.items()}
    res = {"artifact": a.artifact, "store": store, "budget_key_bits": budget,
           "objective": "relative q-weighted logit MSE (stats/clip.py key objective), reservoir rows, per-part clips "
                        "searched, directions ranked by the better of lambda*sigma2 and lambda per head, before the tune",
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
