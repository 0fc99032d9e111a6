"""Per-layer widths with the values in the budget: would the copy probe's DP spend bits on values if the
cache could store wider values per layer? `validate.tune.layer_copy_gradients` with options that widen keys and/or
values (first order: the value leaf's term adds to the key's), the same DP (`codebooks.layer_artifact`, objective
copy) at the same 2.5-bit budget over keys-only options or over key x value options. Choice on half of the windows,
scored on the other half (as lab/head_widths.py), and the key x value widths on all windows written as
a codec artifact (`codebooks` "layers": the simulator serves it as oscar-int2; the cache has no wider-value
format yet, so this is an A/B arm, not a product artifact).

    python lab/value_widths.py --artifact runs/i16e/s4096/scaled.safetensors --windows 4 --length 2048 \
        --log runs/i16e/s4096/kv_4x2048.gradients.jsonl --out-artifact runs/i16e/s4096/grad_kv.safetensors \
        --out lab/results/value_widths_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

KEYS = ((2, 2), (3, 2), (4, 2))  # codebooks.COPY_OPTIONS: what the per-layer cache format serves
KV = tuple((kb, vb) for vb in (2, 3, 4) for kb in (2, 3, 4))  # KEYS first, so the keys-only table is its first columns


def main(argv=None) -> int:
    import numpy as np

    from oscar.stats.artifact import load_artifact, save_artifact
    from oscar.scoring import layer_formats as cb
    from oscar.recipe import widths as wd
    from oscar.validate.env import load_model
    from oscar.recipe.tune import TuneConfig
    from oscar.recipe.widths import layer_copy_gradients

    from head_widths import option_costs, paired_t  # lab/ is on the path when run as a script

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--artifact", required=True, help="a tuned one-group (scaled) artifact")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--log", required=True, help="the per-window gradient log (resumable; read back for the halves)")
    ap.add_argument("--out-artifact", required=True, help="the key x value widths as a codec artifact (.safetensors)")
    ap.add_argument("--out", required=True, help="JSON")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    art = load_artifact(args.artifact)
    model, tok, _ = load_model(args.model)
    L = art.num_layers
    logged = sum(1 for _ in open(args.log)) if os.path.exists(args.log) else 0  # windows a previous run computed
    t0 = time.perf_counter()
    est = layer_copy_gradients(model, tok, art, KV, TuneConfig(copy_windows=args.windows, copy_length=args.length),
                               log=args.log, progress=not args.no_progress)  # (L, 9)
    secs = time.perf_counter() - t0
    recs = {r["window"]: r for r in map(json.loads, open(args.log))}
    cost = option_costs(art, KV)  # (O,)
    budget, nk = cb.oscar_bits(art), len(KEYS)

    def table(idx):
        return sum(np.asarray(recs[i]["sums"]).sum(1) for i in idx) / sum(recs[i]["tokens"] for i in idx)  # (L, O)

    def pick(t, n):  # the DP over the first n options
        return np.array(wd.layer_widths(t[:, :n], np.tile(cost[:n], (L, 1)), budget))

    def score(t, p):
        return float(t[np.arange(L), p].sum())

    halves = (list(range(0, args.windows, 2)), list(range(1, args.windows, 2)))
    diffs, folds = [], []
    for sel, ev in (halves, halves[::-1]):
        ts, te = table(sel), table(ev)
        pk, pkv = pick(ts, nk), pick(ts, len(KV))
        diffs += [score(table([i]), pkv) - score(table([i]), pk) for i in ev]
        folds.append({"choose_on": sel, "keys": round(score(te, pk), 6), "keys_values": round(score(te, pkv), 6)})
    out = wd.layer_artifact(art, KV, "oscar-layer-kv-int2", est)
    save_artifact(out, args.out_artifact)
    wk, wkv = pick(est, nk), pick(est, len(KV))
    assert out.meta["codec"]["widths"] == [list(KV[o]) for o in wkv]  # the artifact's DP is this one
    res = {"artifact": args.artifact, "model": args.model, "windows": args.windows, "length": args.length,
           "options": [list(o) for o in KV], "option_bits": cost.round(4).tolist(), "budget": budget,
           "seconds_gradients": round(secs, 1), "windows_read_from_log": logged,
           "held_out": {"folds": folds, "kv_minus_keys_per_window": [round(x, 6) for x in diffs],
                        "kv_minus_keys": paired_t(diffs)},
           "keys_only": {"widths": [list(KEYS[o]) for o in wk], "score": round(score(est, wk), 6)},
           "keys_values": {"widths": out.meta["codec"]["widths"], "score": round(score(est, wkv), 6),
                           "artifact": args.out_artifact},
           "estimated": est.round(7).tolist()}
    print(json.dumps({k: v for k, v in res.items() if k != "estimated"}))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
