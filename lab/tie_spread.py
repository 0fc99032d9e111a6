"""How far the recipe's objectives move between stores of one model calibrated through different kernel paths.

    python lab/tie_spread.py score STORE OUT.json [--tokens 2048] [--windows 4] [--length 2048] [--table-factors 1.1,1.2]
    python lab/tie_spread.py analyze A.json B.json [C.json ...]

`score` runs the recipe's steps on one store as `oscar fit` runs them (fit --variant scaled; the clip tune's strict
NLL per factor on calibration text, here in float64 and in float32; the widths' copy-NLL table to first order at a
factor) and writes every objective with what the choices read (the DP's costs and budget). `analyze` compares the
stores: the spread of each objective, and the choices each store gives with and without ties at that spread.
The stores come from `oscar calibrate` run under the kernel paths compared (lab/tie_spread.sh).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import numpy as np


def score(a) -> None:
    import torch

    from oscar.stats.fit import FitConfig, fit
    from oscar.recipe.tune import TuneConfig, scale_key_clips, tune_key_clip
    from oscar.scoring.layer_formats import layer_spec, oscar_bits
    from oscar.validate.env import load_model
    from oscar.recipe.widths import COPY_OPTIONS, layer_copy_gradients
    from oscar import host, native_build
    from oscar.recipe import store_inputs

    torch.set_num_threads(a.threads)
    t0 = time.time()
    art = fit(a.store, FitConfig(variant="scaled", progress=False))
    m, tok, _ = load_model(store_inputs(a.store)[0])
    out = {"store": a.store, "host": host.describe(), "native": native_build.CHOICES, "tokens": a.tokens,
           "windows": a.windows, "length": a.length, "nll": {}, "tables": {}}
    for dt in ("float64", "float32"):
        _, rec = tune_key_clip(m, tok, art, TuneConfig(tokens=a.tokens, dtype=dt), progress=False)
        out["nll"][dt] = rec["nll_per_token_full"] if "nll_per_token_full" in rec else rec["nll_per_token"]
        out["nll"][dt + "_chosen"] = rec["chosen_factor"]
        out[f"tune_seconds_{dt}"] = rec["seconds"]
        print(f"tune {dt}: {rec['nll_per_token']} -> x{rec['chosen_factor']} ({rec['seconds']} s)", flush=True)
    factors = [float(f) for f in a.table_factors.split(",")] if a.table_factors else [out["nll"]["float64_chosen"]]
    D = art.head_dim
    out["costs"] = [0.5 * (layer_spec(art, kb).bits_per_element(D) + layer_spec(art, vb).bits_per_element(D))
                    for kb, vb in COPY_OPTIONS]
    out["budget"] = oscar_bits(art)
    for f in factors:
        t = time.time()
        err = layer_copy_gradients(m, tok, scale_key_clips(art, f), COPY_OPTIONS,
                                   TuneConfig(copy_windows=a.windows, copy_length=a.length), progress=False)
        out["tables"][str(f)] = np.asarray(err).tolist()
        print(f"widths table at x{f}: {time.time() - t:.0f} s", flush=True)
    out["seconds"] = time.time() - t0
    with open(a.out, "w") as fh:
        json.dump(out, fh, indent=1)


def _dp_widths(table, costs, budget, rule):
    """The widths the DP gives on `table` under a rule: plain (the table as it is), round (rounded to TIE_REL of
    its largest entry: the rule before), ties (narrower_on_ties at STORE_TIE_TABLE)."""
    from oscar.common import TIE_REL, narrower_on_ties
    from oscar.recipe.widths import layer_widths

    t = np.asarray(table, float)
    c = np.tile(np.asarray(costs, float), (len(t), 1))
    obj = {"plain": lambda: t, "round": lambda: np.round(t / (TIE_REL * np.abs(t).max())),
           "ties": lambda: narrower_on_ties(t)}[rule]()
    return layer_widths(obj, c, budget)


def _factor(nll: dict, rule: str) -> float:
    from oscar.common import smallest_change, tied_best

    fs = sorted(nll, key=float)
    v = [nll[f] for f in fs]
    i = {"plain": lambda: int(np.argmin(v)), "round": lambda: tied_best(v)[0], "ties": lambda: smallest_change(
        [float(f) for f in fs], v)}[rule]()
    return float(fs[i])


RULES = ("plain", "round", "ties")


def analyze(a) -> None:
    from oscar.common import STORE_TIE_REL, STORE_TIE_TABLE

    runs = [json.load(open(p)) for p in a.runs]
    names = [p.rsplit("/", 1)[-1].removesuffix(".json") for p in a.runs]
    print(f"== the tune's NLL per token (ties: STORE_TIE_REL {STORE_TIE_REL:g}; widths: STORE_TIE_TABLE "
          f"{STORE_TIE_TABLE:g})")
    for dt in ("float64", "float32"):
        for n, r in zip(names, runs):
            print(f"  {dt} {n}: " + ", ".join(f"x{f} {v:.6f}" for f, v in r["nll"][dt].items()) + " -> "
                  + ", ".join(f"{rule} x{_factor(r['nll'][dt], rule)}" for rule in RULES))
    rel = {"float64": [], "float32": [], "float64 vs float32 (one store)": []}
    for (na, ra), (nb, rb) in itertools.combinations(zip(names, runs), 2):
        for dt in ("float64", "float32"):
            d = {f: abs(ra["nll"][dt][f] - rb["nll"][dt][f]) / min(ra["nll"][dt][f], rb["nll"][dt][f])
                 for f in ra["nll"][dt]}
            rel[dt] += list(d.values())
            print(f"  spread {dt} {na} vs {nb}: max {max(d.values()):.2e} relative ("
                  + ", ".join(f"x{f} {v:.1e}" for f, v in d.items()) + ")")
    for n, r in zip(names, runs):
        d = [abs(r["nll"]["float64"][f] - r["nll"]["float32"][f]) / r["nll"]["float64"][f] for f in r["nll"]["float64"]]
        rel["float64 vs float32 (one store)"] += d
        v = sorted(r["nll"]["float64"].values())
        print(f"  {n}: float64 against float32 up to {max(d):.2e}; best two factors {(v[1] - v[0]) / v[0]:.2e} apart")
    for k, v in rel.items():
        print(f"  largest relative spread, {k}: {max(v):.2e} (median {np.median(v):.1e}, {len(v)} pairs)")
    print("== the widths' table (copy-NLL change per copied token, per layer and option), tie rule applied")
    for (na, ra), (nb, rb) in itertools.combinations(zip(names, runs), 2):
        for f in sorted(set(ra["tables"]) & set(rb["tables"])):
            ta, tb = np.asarray(ra["tables"][f]), np.asarray(rb["tables"][f])
            scale = max(np.abs(ta).max(), np.abs(tb).max())
            d = np.abs(ta - tb)[:, 1:] / scale
            print(f"  x{f} {na} vs {nb}: |diff| up to {d.max():.2e} of the largest |entry| {scale:.4f} "
                  f"(median {np.median(d):.1e}, 90th percentile {np.quantile(d, 0.9):.1e})")
            for rule in RULES:
                wa = _dp_widths(ta, ra["costs"], ra["budget"], rule)
                wb = _dp_widths(tb, rb["costs"], rb["budget"], rule)
                diff = [l for l, (x, y) in enumerate(zip(wa, wb)) if x != y]
                print(f"    {rule}: differ in layers {diff}; {na}: {_wide(wa)}; {nb}: {_wide(wb)}")
    print("== the recipe per store: factor, then the widths at that factor (where its table was scored)")
    for rule in RULES:
        for dt in ("float64", "float32"):
            out = []
            for n, r in zip(names, runs):
                f = _factor(r["nll"][dt], rule)
                t = r["tables"].get(str(f))
                out.append(f"{n} x{f} " + (str(_wide(_dp_widths(t, r["costs"], r["budget"], rule))) if t else "(no table)"))
            print(f"  {rule} {dt}: " + "; ".join(out))


def _wide(w):
    return {l: 2 + o for l, o in enumerate(w) if o}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("score")
    s.add_argument("store")
    s.add_argument("out")
    s.add_argument("--tokens", type=int, default=2048)
    s.add_argument("--windows", type=int, default=4)
    s.add_argument("--length", type=int, default=2048)
    s.add_argument("--table-factors", default="")
    s.add_argument("--threads", type=int, default=1)
    z = sub.add_parser("analyze")
    z.add_argument("runs", nargs="+")
    a = ap.parse_args()
    score(a) if a.cmd == "score" else analyze(a)


if __name__ == "__main__":
    main()
