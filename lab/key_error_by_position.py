"""Does the INT2 key error grow with the key's position past the calibration length?

The stores are calibrated on windows of `seq_len` tokens (2048 by default), so C_Q, the key scales and the
clips only ever see post-RoPE keys and queries at positions < seq_len. RoPE's slow pairs keep turning past
that: a key at position 3000 puts energy in directions calibration saw carry little, which the scaled split
format then reads with the wrong scale and clip. Needles at 4k sit there.

Held-out text only (`validate.heldout`, the corpus's held-out split: calibration never saw it), read through
the model once per sequence of `--length` tokens; every layer's post-RoPE q/k captured as attention receives
them. Per artifact, keys [sink, T) are read through `LayerQuant.keys` (the simulator's reading of the cache),
and the queries of the last `--queries` positions score them. Per bin of key positions:

    rel_logit_err = RMS(q·(k̂ − k)) / RMS(q·k − mean_t q·k)   (the logit error against the logit spread)
    top1_kept     = the bin's best key (exact logit) is still the bin's best after INT2

pooled over layers, query heads, queries and sequences. A flat curve says position is not the problem; a
step at the calibration length says it is.

    python lab/key_error_by_position.py --artifact A=runs/t/fit2k.safetensors --artifact B=runs/t/fit4k.safetensors \
        --out lab/results/position_smollm2.json
    python lab/key_error_by_position.py --plot R2K.json R4K.json R8K.json --out position.png
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def plot(paths: list[str], out: str) -> None:
    """One panel per result file (queries at the end of its --length): relative logit error by key position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.load(open(p)) for p in paths]
    fig, axes = plt.subplots(1, len(runs), figsize=(max(6.0, 4.2 * len(runs)), 3.6), sharey=True, squeeze=False)
    for ax, r in zip(axes[0], runs):
        mid = [(lo + hi) / 2 for lo, hi in r["bins"]]
        for name, a in r["artifacts"].items():
            ax.plot(mid, a["rel_logit_err"], marker="o", ms=3, label=f"calibrated at {name}")
        ax.set_title(f"{r.get('model', '')} queries at {r['config']['length']} tokens".strip())
        ax.set_xlabel("key position")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("RMS logit error / RMS logit spread")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("INT2 key error by position, held-out text (lab/key_error_by_position.py)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> int:
    from oscar.defaults import SINK
    from oscar.stats.artifact import load_artifact
    from oscar.validate.attention import capture_rows
    from oscar.validate.env import load_model
    from oscar.validate.heldout import heldout_sequences
    from oscar.kernels.simulate import LayerQuant

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", action="append", help="NAME=PATH (repeatable)")
    ap.add_argument("--model", default=None, help="default: the artifacts' model")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--sequences", type=int, default=3)
    ap.add_argument("--queries", type=int, default=32, help="query positions at the end of each sequence")
    ap.add_argument("--bin", type=int, default=512)
    ap.add_argument("--out", required=True, help="result JSON (with --plot: the PNG)")
    ap.add_argument("--plot", nargs="+", metavar="JSON", help="plot these result files into --out instead of measuring")
    a = ap.parse_args(argv)
    if a.plot:
        plot(a.plot, a.out)
        return 0
    if not a.artifact:
        ap.error("--artifact NAME=PATH is required (or --plot)")
    t0 = time.perf_counter()
    arts = {}
    for s in a.artifact:
        name, _, path = s.partition("=")
        arts[name] = load_artifact(path)
    first = next(iter(arts.values()))
    model, tok, _ = load_model(a.model or first.meta["model"]["name"])
    for art in arts.values():
        art.check_model(model.config)
    held = heldout_sequences(tok, a.length * a.sequences, a.length)
    seqs = [s for s in held.seqs if len(s) == a.length][:a.sequences]
    T, L = a.length, first.num_layers
    qpos = list(range(T - a.queries, T))
    layers = list(range(L))
    K, _, Q = capture_rows(model, seqs, layers, {i: qpos for i in range(len(seqs))}, progress=True)
    edges = list(range(SINK, T - a.queries, a.bin)) + [T - a.queries]
    bins = list(zip(edges[:-1], edges[1:]))
    out = {"config": vars(a), "model": first.meta["model"]["name"], "heldout": held.info, "bins": bins, "artifacts": {}}
    for name, art in arts.items():
        num = torch.zeros(len(bins), dtype=torch.float64)
        den = torch.zeros(len(bins), dtype=torch.float64)
        kept = torch.zeros(len(bins), dtype=torch.float64)
        trials = 0
        per_layer = []
        for l in layers:
            lq = LayerQuant(art, l, pages=False)
            ln, ld = torch.zeros(len(bins), dtype=torch.float64), torch.zeros(len(bins), dtype=torch.float64)
            for i in range(len(seqs)):
                k = K[l][i].float()                                   # (Hkv, T, D)
                kh = k.clone()
                kh[:, SINK:] = lq.keys(k[None, :, SINK:])[0]          # every non-sink key from INT2
                q = Q[l][i].float()                                   # (Hq, n, D)
                g = q.shape[0] // k.shape[0]
                kk = k.repeat_interleave(g, 0)                        # (Hq, T, D)
                khh = kh.repeat_interleave(g, 0)
                s = q @ kk.transpose(1, 2) / k.shape[-1] ** 0.5      # (Hq, n, T)
                sh = q @ khh.transpose(1, 2) / k.shape[-1] ** 0.5
                for j, (lo, hi) in enumerate(bins):
                    e, x = (sh - s)[..., lo:hi], s[..., lo:hi]
                    x = x - x.mean(-1, keepdim=True)
                    ln[j] += e.double().pow(2).sum()
                    ld[j] += x.double().pow(2).sum()
                    kept[j] += (sh[..., lo:hi].argmax(-1) == s[..., lo:hi].argmax(-1)).double().sum()
                trials += q.shape[0] * q.shape[1]
            num += ln
            den += ld
            per_layer.append([round(float((ln[j] / ld[j]).sqrt()), 5) for j in range(len(bins))])
        out["artifacts"][name] = {
            "rel_logit_err": [round(float(v), 5) for v in (num / den).sqrt()],
            "top1_kept": [round(float(v), 5) for v in kept / trials],
            "per_layer_rel_logit_err": per_layer,
            "trials_per_bin": trials,
            "store": art.meta.get("provenance", {}).get("store"),
        }
    out["seconds"] = round(time.perf_counter() - t0, 1)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"{'bin':>12} " + " ".join(f"{n:>22}" for n in arts))
    for j, (lo, hi) in enumerate(bins):
        cells = [f"{out['artifacts'][n]['rel_logit_err'][j]:.4f} / {out['artifacts'][n]['top1_kept'][j]:.3f}" for n in arts]
        print(f"{lo:>5}-{hi:<6} " + " ".join(f"{c:>22}" for c in cells))
    print(f"(rel logit err / top-1 kept; {a.out}, {out['seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
