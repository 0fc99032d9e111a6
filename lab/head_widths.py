"""Per-layer key widths at head granularity: would key widths per KV head beat widths per layer at the same
bits? The copy probe to first order (`validate.tune.layer_copy_gradients(heads=True)`) splits each layer's
copied-span NLL change at 3 / 4 bits into its KV heads' shares at no extra cost. Widths are chosen by the same DP
(`oscar.recipe.widths.layer_widths`, the same option costs and 2.5-bit budget) over layers or over (layer, head) units on
half of the copy windows and scored on the other half (and the other way round): a finer choice that only fits
the estimate's noise scores no better on the windows it did not see (per held-out window, heads − layers, with a
t interval over the windows), and by how many windows the choice read. First order only: a predicted NLL change on
calibration text, not needles; no per-head cache format exists yet.

    python lab/head_widths.py --artifact runs/i16e/s4096/scaled.safetensors --windows 8 --length 2048 \
        --log runs/i16e/s4096/heads_8x2048.gradients.jsonl --out lab/results/head_widths_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import time


def option_costs(art, opts):
    """(O,) bits per element of each (key bits, value bits) option, as `oscar.recipe.widths.layer_artifact`'s DP counts them."""
    import numpy as np

    from oscar.scoring import layer_formats as cb

    D = art.head_dim
    return np.array([0.5 * (cb.layer_spec(art, kb).bits_per_element(D) + cb.layer_spec(art, vb).bits_per_element(D))
                     for kb, vb in opts])


def paired_t(diffs) -> list[float]:
    """mean [95 % t interval] of per-window paired differences."""
    import numpy as np
    from scipy.stats import t as student

    d = np.asarray(diffs, dtype=float)
    half = float(student.ppf(0.975, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else float("nan")
    return [round(float(d.mean()), 6), round(float(d.mean()) - half, 6), round(float(d.mean()) + half, 6)]


def _table(recs, idx):
    import numpy as np

    return sum(np.asarray(recs[i]["sums"]) for i in idx) / sum(recs[i]["tokens"] for i in idx)  # (L, H, O)


def main(argv=None) -> int:
    import numpy as np

    from oscar.recipe import widths as wd
    from oscar.stats.artifact import load_artifact
    from oscar.scoring import layer_formats as cb
    from oscar.validate.env import load_model
    from oscar.recipe.tune import TuneConfig
    from oscar.recipe.widths import layer_copy_gradients

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--artifact", required=True, help="a tuned one-group (scaled) artifact")
    ap.add_argument("--windows", type=int, default=8, help="copy windows (even: halves of interleaved windows)")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--log", required=True, help="the per-window gradient log (resumable; read back for the halves)")
    ap.add_argument("--out", required=True, help="JSON; a heatmap PNG beside it")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    art = load_artifact(args.artifact)
    model, tok, _ = load_model(args.model)
    opts = wd.COPY_OPTIONS
    logged = sum(1 for _ in open(args.log)) if os.path.exists(args.log) else 0  # windows a previous run computed
    t0 = time.perf_counter()
    est = layer_copy_gradients(model, tok, art, opts, TuneConfig(copy_windows=args.windows, copy_length=args.length),
                               log=args.log, progress=not args.no_progress, heads=True)  # (L, H, O)
    secs = time.perf_counter() - t0
    recs = {r["window"]: r for r in map(json.loads, open(args.log))}
    L, H, O = est.shape
    cost = option_costs(art, opts)  # (O,)
    budget = cb.oscar_bits(art)

    def pick_layers(t):  # (L, H, O) -> (L, H) option per unit, one per layer
        p = wd.layer_widths(t.sum(1), np.tile(cost, (L, 1)), budget)
        return np.repeat(np.array(p)[:, None], H, 1)

    def pick_heads(t):
        return np.array(wd.layer_widths(t.reshape(L * H, O), np.tile(cost, (L * H, 1)), budget)).reshape(L, H)

    def score(t, p):  # summed NLL change per token of the choice p under table t
        return float(np.take_along_axis(t, p[..., None], 2).sum())

    halves = (list(range(0, args.windows, 2)), list(range(1, args.windows, 2)))
    folds, diffs = [], []  # diffs: heads − layers on each held-out window (paired: same window, same choice data)
    for sel, ev in (halves, halves[::-1]):
        ts, te = _table(recs, sel), _table(recs, ev)
        pl, ph = pick_layers(ts), pick_heads(ts)
        diffs += [score(_table(recs, [i]), ph) - score(_table(recs, [i]), pl) for i in ev]
        folds.append({"choose_on": sel, "score_on": ev,
                      "layers": {"in_sample": round(score(ts, pl), 6), "held_out": round(score(te, pl), 6)},
                      "heads": {"in_sample": round(score(ts, ph), 6), "held_out": round(score(te, ph), 6)}})
    from itertools import combinations

    by_k = {}  # held-out score of widths chosen on k of a half's windows: does the choice need more windows?
    for k in sorted({1, 2, len(halves[0])}):
        sc = {"layers": [], "heads": []}
        for sel, ev in (halves, halves[::-1]):
            te = _table(recs, ev)
            for sub in combinations(sel, k):
                ts = _table(recs, sub)
                sc["layers"].append(score(te, pick_layers(ts)))
                sc["heads"].append(score(te, pick_heads(ts)))
        by_k[k] = {u: round(float(np.mean(v)), 6) for u, v in sc.items()}
    pl, ph = pick_layers(est), pick_heads(est)
    gain4 = -est[..., 2]  # (L, H): NLL saved by 4-bit keys in that head alone, first order
    srt = np.sort(gain4.ravel())[::-1]
    pos = srt[srt > 0]
    res = {"artifact": args.artifact, "model": args.model, "windows": args.windows, "length": args.length,
           "options": [list(o) for o in opts], "option_bits": cost.round(4).tolist(), "budget": budget,
           "seconds_gradients": round(secs, 1), "windows_read_from_log": logged, "kv_heads": H,
           "held_out": {"layers": round(float(np.mean([f["layers"]["held_out"] for f in folds])), 6),
                        "heads": round(float(np.mean([f["heads"]["held_out"] for f in folds])), 6),
                        "heads_minus_layers_per_window": [round(x, 6) for x in diffs],
                        "heads_minus_layers": paired_t(diffs)},  # mean [95 % t interval]
           "folds": folds, "held_out_by_choice_windows": by_k,
           "all_windows": {"layers": {"score": round(score(est, pl), 6), "key_bits": [opts[o][0] for o in pl[:, 0]]},
                           "heads": {"score": round(score(est, ph), 6),
                                     "key_bits": [[opts[o][0] for o in row] for row in ph]}},
           "gain4_share_top": {f"{k}_heads": round(float(pos[:k].sum() / pos.sum()), 4) for k in (3, 9, 27) if len(pos)},
           "estimated": est.round(7).tolist()}
    print(json.dumps({k: v for k, v in res.items() if k != "estimated"}))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    _plot(gain4, ph, opts, args.out.rsplit(".", 1)[0] + ".png", args.model)
    return 0


def _plot(gain4, picks, opts, path, model) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L, H = gain4.shape
    fig, ax = plt.subplots(figsize=(max(4, 1.2 * H + 2), 0.22 * L + 1.5))
    m = ax.imshow(gain4, aspect="auto", cmap="viridis")
    for l in range(L):
        for h in range(H):
            b = opts[picks[l, h]][0]
            if b != opts[0][0]:
                ax.text(h, l, str(b), ha="center", va="center", color="w", fontsize=7)
    ax.set_xlabel("KV head"), ax.set_ylabel("layer")
    ax.set_title(f"{model}: copy NLL saved by 4-bit keys per head (first order)\nnumbers: the per-head DP's key bits", fontsize=9)
    fig.colorbar(m, ax=ax, label="NLL / token")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
