"""Diagnostic: how many bits would SmolLM2's keys need to keep the 4k needle? Every layer's keys at b bits.

The attribution (`bench/niah_attribution.py`) showed SmolLM2's 4k niah_single_2 loss is in the keys and spread over
the layers, so what is left to try is a better 2-bit key grid everywhere. This bounds what such a grid could buy:
from a tuned one-group artifact it writes the same rotations with *every* layer's keys at `--bits` (3 or 4; fp16
scale/zero, no clip, values unchanged: `validate.codebooks.widths_artifact` -> `native_layer_artifact`, the per-layer
format OscarCache serves). Served on the needles beside the shipped widths and the exact keys, the dose-response says
how much of the key loss one more bit removes. A 2-bit code cannot come near one more bit's error: for a Gaussian
coordinate the best uniform 4-level grid has MSE 0.1188, the best 8-level one 0.0374 (5.0 dB lower), and no 2-bit
quantizer of any dimension goes below the rate-distortion bound 2^-4 = 0.0625 (2.8 dB under the 4-level grid).
So if 3-bit keys do not recover the needle, no grid at 2 bits will.

Over the budget by construction (it is a ceiling, not a candidate); the bits are the memory accounting's
(`validate.methods.bits_per_element`, what `oscar validate niah` records). The JSON also records, per arm, the keys' relative logit error on the
calibration store's reservoir rows (queries x keys of each layer, keys as `validate.methods.LayerQuant` serves them:
mean (q·(k̂ - k))² over the variance of q·k across keys, averaged over layers and heads; and in dB against the
shipped widths), and the per-layer relative attention-output error at 2 / 3 / 4 key bits that the widths DP read
(`layer_widths.err`).

    python lab/key_bits.py --artifact runs/i16e/s4096/scaled.safetensors --widths runs/i16e/s4096/grad.safetensors \\
        --bits 3 4 --out-dir runs/i16e/s4096 --out lab/results/key_bits_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os


def main(argv=None) -> int:
    import numpy as np
    import torch

    from oscar.stats.artifact import load_artifact, save_artifact
    from oscar.recipe.widths import _rows, native_layer_artifact, widths_artifact
    from oscar.validate.codebooks import lm_artifact, sparse_artifact
    from oscar.scoring.layer_formats import store_layers
    from oscar.kernels.simulate import LayerQuant
    from oscar.validate.methods import bits_per_element

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plot", metavar="AB_JSON", help="draw the dose-response of an A/B table over these arms (no artifacts)")
    ap.add_argument("--artifact", help="a tuned one-group artifact (oscar fit --variant scaled + tune)")
    ap.add_argument("--widths", help="the shipped per-layer widths artifact of the same fit (its error table and bits)")
    ap.add_argument("--bits", type=int, nargs="+", default=[3, 4])
    ap.add_argument("--out-dir", help="where keys<b>.safetensors go")
    ap.add_argument("--out", required=True, help="JSON")
    args = ap.parse_args(argv)
    if args.plot:
        return plot(args.plot, args.out)
    if not (args.artifact and args.out_dir):
        ap.error("--artifact and --out-dir are required (or --plot)")
    fitted = load_artifact(args.artifact)
    L, base = fitted.num_layers, fitted.quant.bits
    _, _, layers = store_layers(fitted, "key-bits")
    rows = [_rows(ls, seed=l)[:2] for l, ls in enumerate(layers)]  # per layer (q, k), each (H, N, D) float64

    def logit_error(art) -> float:
        """Mean over layers and heads of E (q·(k̂ - k))² / Var_k(q·k) on the reservoir rows."""
        out = []
        for l, (q, k) in enumerate(rows):
            kh = LayerQuant(art, l, pages=False).keys(k.float()[None])[0].double()  # (H, N, D)
            err = (q @ (kh - k).transpose(-1, -2)).pow(2).mean((-1, -2))  # (H,)
            out.append(err / (q @ k.transpose(-1, -2)).var(-1).mean(-1))
        return float(torch.stack(out).mean())

    # the equal-bit grids built before (Lloyd-Max and sparse keys): what a better 2-bit grid bought so far, in the same units
    arms = {"oscar-int2 (one group)": fitted, "oscar-lm-int2": lm_artifact(fitted), "oscar-sparse-int2": sparse_artifact(fitted)}
    rec = {"artifact": args.artifact, "artifacts": {}}
    for b in args.bits:
        a = native_layer_artifact(widths_artifact(fitted, [[b, base]] * L, method=f"oscar-keys{b}-int2"))
        path = os.path.join(args.out_dir, f"keys{b}.safetensors")
        save_artifact(a, path)
        rec["artifacts"][f"keys{b}"] = path
        arms[f"keys{b}"] = load_artifact(path)  # what a user would serve: the file
    if args.widths:
        w = arms["shipped widths"] = load_artifact(args.widths)
        lw = w.meta["layer_widths"]
        err = np.asarray(lw["err"])  # (L, options): relative attention-output error per layer and key width
        rec["widths"] = [kb for kb, _ in lw["widths"]]
        rec["attention_output_error"] = {
            "options": lw["options"],
            "mean_over_layers": [round(float(e), 6) for e in err.mean(0)],
            "shipped": round(float(err[np.arange(L), [lw["options"].index(list(x)) for x in lw["widths"]]].mean()), 6),
        }
    torch.set_grad_enabled(False)
    rel = {name: logit_error(a) for name, a in arms.items()}
    D = fitted.head_dim
    rec["bits_per_element"] = {name: bits_per_element(a, D) for name, a in arms.items()}  # the memory accounting's
    # the keys' own stored bits (codes and scale/zero), averaged over layers
    rec["key_bits_per_element"] = {name: round(float(np.mean([a.quant_for(l).key_bits(D) for l in range(L)])), 4)
                                   for name, a in arms.items() if not (a.meta.get("codec") or {}).get("kind")}
    ref = rel.get("shipped widths", rel["oscar-int2 (one group)"])
    rec["key_logit_error"] = {name: {"relative": round(e, 6), "dB_vs_" + ("shipped" if "shipped widths" in rel else "one_group"):
                                     round(10 * float(np.log10(e / ref)), 2)} for name, e in rel.items()}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=1)
    print(json.dumps(rec["bits_per_element"]), json.dumps(rec["key_logit_error"]), json.dumps(rec.get("attention_output_error")))
    return 0


# A/B labels (lab/key_bits.sh's --rename) -> the key_bits JSON's arm names; exact keys are 16 bits
ARMS = {"oscar-scaled-int2": "oscar-int2 (one group)", "oscar-int2": "shipped widths", "oscar-keys3-int2": "keys3",
        "oscar-keys4-int2": "keys4", "oscar-exact-keys": None}


def plot(ab_json: str, key_json: str) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ab, kb = json.load(open(ab_json)), json.load(open(key_json))
    L = max(ab["lengths"])
    rows = {r["method"]: r for r in ab["niah"] if r["task"] == "pooled" and r["length"] == L and "vs_bf16" in r}
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for i, (m, name) in enumerate(ARMS.items()):
        if m not in rows:
            continue
        x = 16.0 if name is None else kb["key_bits_per_element"][name]
        v = rows[m]["vs_bf16"]
        ax.errorbar([x], [v["diff"]], yerr=[[v["diff"] - v["lo"]], [v["hi"] - v["diff"]]], fmt="o", capsize=4)
        db = "" if name is None else f" ({kb['key_logit_error'][name]['dB_vs_shipped']:+.1f} dB)"
        ax.annotate(f"{m}{db}", (x, v["diff"]), textcoords="offset points", xytext=(6, 4 if i % 2 else -12), fontsize=7)
    ax.axhline(0, color="k", lw=0.6)
    ax.axhline(-5, color="r", ls="--", lw=0.8, label="goal margin (-5 points)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("key bits per element, codes + scale/zero (values INT2 in every arm)")
    ax.set_ylabel(f"needles vs bf16 at {L // 1024}k, points")
    ax.set_title(f"keys' precision vs the needle loss ({rows['oscar-int2']['vs_bf16']['paired']} pairs, 95 % intervals)",
                 fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    out = os.path.splitext(ab_json)[0] + ".png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
