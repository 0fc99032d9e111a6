"""How many calibration tokens the fit needs: rotations and model-level figures against the budget.

One calibration at the largest budget the corpus gives (`--blocks`, blocks of one `--seq-len` sequence), then
fits of its first b blocks for each budget b (`oscar fit --blocks b`: a prefix of the same calibration, so the
budgets are nested and differ only in how much text they saw). Per budget:

- rotations: per layer and KV head, the leading subspace of the query eigenvectors that R_K is built on
  (U_Q, the shipped `scaled` recipe), of dimension d_eff (the largest-budget fit's, per head), against the
  largest-budget fit's: distance = 1 - mean cos² of the principal angles (0: the same subspace; the fit's
  own stability check across blocks uses the same measure and falls back below 0.5);
- strict perplexity of the fitted artifact (the rotations and searched clips, no tune or widths) on held-out
  windows, paired per window with the largest budget's (bootstrap interval of the mean difference);
- needles under the serving protocol, paired per sample with the largest budget's (Newcombe interval).

The same held-out windows and needle samples for every budget: the differences are paired.

    python bench/calib_budget.py --model smollm2-135m --work /tmp/cb-smol --out bench/results/calib_budget_smollm2.json
    python bench/calib_budget.py --plot docs/calib_budget.png bench/results/calib_budget_*.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from oscar.validate.evidence import paired_diff, read_samples, read_windows
from oscar.host import describe
from oscar.validate.intervals import paired_bootstrap_diff
from oscar.pipeline.calibrate import CalibConfig, calibrate
from oscar.stats.artifact import load_artifact, save_artifact
from oscar.stats.fit import FitConfig, fit
from oscar.stats.reduce import LayerStats, ReduceConfig, open_store
from oscar.stats.spectrum import principal_cos2
from oscar.validate.niah import NiahConfig, run_niah
from oscar.validate.ppl import PplConfig, run_ppl
from oscar.reports.plots import pyplot


def query_bases(store: str, blocks: int) -> list[np.ndarray]:
    """Per layer (H, D, D) query eigenvectors (descending) from the store's first `blocks` blocks."""
    view = open_store(store, log=lambda m: None)
    view.blocks = view.blocks[:blocks]
    return [LayerStats(view, l, ReduceConfig()).eig("q")[1] for l in range(view.num_layers)]


def subspace_distance(U: np.ndarray, V: np.ndarray, k: np.ndarray) -> np.ndarray:
    """(H,) 1 - mean cos² of the principal angles between the leading k[h] columns of U[h] and V[h]."""
    return np.array([1.0 - principal_cos2(U[h][:, :k[h]], V[h][:, :k[h]]).mean() for h in range(len(U))])


def plot(paths: list[str], out: str) -> None:
    """Both panels per model: the rotations' subspace distance, and the strict NLL / needle differences against
    the largest budget (95 % intervals), by calibration tokens."""
    plt = pyplot()
    fig, ax = plt.subplots(1, 3, figsize=(13, 3.6))
    for p in paths:
        res = json.load(open(p))
        rows, name = res["rows"], res["config"]["model"]
        t = [r["tokens"] / 1024 for r in rows]
        ax[0].plot(t[:-1], [r["subspace_distance"]["median"] for r in rows[:-1]], "o-", label=f"{name} median")
        ax[0].plot(t[:-1], [r["subspace_distance"]["max"] for r in rows[:-1]], "x--", label=f"{name} max")
        for i, (k, ci) in enumerate((("strict_nll_diff_vs_top", "strict_nll_diff_ci"),
                                     ("needle_diff_vs_top", "needle_diff_ci")), start=1):
            y = [r[k] for r in rows]
            err = [[r[k] - r[ci][0] for r in rows], [r[ci][1] - r[k] for r in rows]]
            ax[i].errorbar(t, y, yerr=err, fmt="o-", capsize=3, label=name)
    ax[0].set(xlabel="calibration tokens (k)", ylabel="1 - mean cos² (U_Q, d_eff dims)", yscale="log",
              title="rotations vs the largest budget")
    ax[1].set(xlabel="calibration tokens (k)", ylabel="nats / token", title="strict NLL minus the largest budget's")
    ax[2].set(xlabel="calibration tokens (k)", ylabel="points", title="needle score minus the largest budget's")
    for a in ax[1:]:
        a.axhline(0, color="grey", lw=0.5)
    for a in ax:
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--plot":
        argv = sys.argv[1:]
    if argv and argv[0] == "--plot":
        plot(argv[2:], argv[1])
        print(f"-> {argv[1]}")
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--corpus", default="pydoc")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--blocks", type=int, default=None,
                    help="largest budget, in blocks of one sequence (default: every sequence the corpus gives; pydoc: 22)")
    ap.add_argument("--budgets", default="4,8,16", help="smaller budgets, in blocks")
    ap.add_argument("--ppl-context", type=int, default=1024)
    ap.add_argument("--ppl-tokens", type=int, default=8192)
    ap.add_argument("--tasks", default="niah_single_2,niah_multikey_1")
    ap.add_argument("--lengths", default="2048")
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--work", required=True, help="directory for the store, artifacts and per-budget results "
                    "(a rerun resumes: the store, each fit and each result are kept)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    os.makedirs(a.work, exist_ok=True)
    store = os.path.join(a.work, "calib.zarr")
    t0 = time.perf_counter()
    calibrate(CalibConfig(model=a.model, corpus=a.corpus, store=store, seq_len=a.seq_len, seqs_per_block=1,
                          tokens=a.blocks * a.seq_len if a.blocks else None), progress=True)  # resumes block by block
    calib_s = time.perf_counter() - t0
    most = len(open_store(store, log=lambda m: None).blocks)
    budgets = sorted({int(b) for b in a.budgets.split(",") if int(b) < most} | {most})

    arts, fit_s = {}, {}
    for b in budgets:
        arts[b] = os.path.join(a.work, f"fit{b}.safetensors")
        if not os.path.exists(arts[b]):
            t = time.perf_counter()
            save_artifact(fit(store, FitConfig(variant="scaled", blocks=b, progress=False)), arts[b])
            fit_s[b] = round(time.perf_counter() - t, 1)
            print(f"fit at {b} blocks: {fit_s[b]} s", flush=True)

    top = budgets[-1]
    ref = query_bases(store, top)
    d_eff = [np.asarray(k, dtype=int) for k in load_artifact(arts[top]).meta["d_eff"]["k"]]  # per layer (H,)
    rows = {}
    for b in budgets:
        U = query_bases(store, b)
        dist = np.stack([subspace_distance(U[l], ref[l], np.maximum(d_eff[l], 1)) for l in range(len(U))])  # (L, H)
        ppl_dir, niah_dir = os.path.join(a.work, f"ppl{b}"), os.path.join(a.work, f"niah{b}")
        run_ppl(PplConfig(out=ppl_dir, model=a.model, artifact=arts[b], methods=["oscar-int2"],
                                contexts=[a.ppl_context], protocols=["strict"], tokens=a.ppl_tokens), progress=False)
        run_niah(NiahConfig(out=niah_dir, model=a.model, artifact=arts[b], methods=["oscar-int2"],
                                   tasks=a.tasks.split(","), lengths=[int(x) for x in a.lengths.split(",")],
                                   samples=a.samples, protocol="serving"), progress=False)
        rows[b] = {"tokens": b * a.seq_len, "dist": dist, "ppl": ppl_dir, "niah": niah_dir}
        print(f"{b:3d} blocks: subspace distance median {np.median(dist):.4f} max {dist.max():.4f}", flush=True)

    def window_nll(d: str) -> np.ndarray:  # per-token NLL of each whole window, in window order
        w = sorted((r["window"], r["nll"] / r["count"]) for r in read_windows(os.path.join(d, "ppl_windows.jsonl"))
                   if r["context"] == a.ppl_context and r["protocol"] == "strict")
        return np.array([v for _, v in w])

    def needle_scores(d: str) -> np.ndarray:  # in (task, length, index) order
        done = read_samples(os.path.join(d, "niah_samples.jsonl"))
        return np.array([float(done[k]["score"]) for k in sorted(done)])

    out_rows = []
    for b in budgets:
        r = rows[b]
        x, y = window_nll(r["ppl"]), window_nll(rows[top]["ppl"])
        s, t = needle_scores(r["niah"]), needle_scores(rows[top]["niah"])
        nd = paired_diff(s, t)
        out_rows.append({
            "blocks": b, "tokens": r["tokens"], "fit_s": fit_s.get(b),
            "subspace_distance": {"median": float(np.median(r["dist"])), "p90": float(np.quantile(r["dist"], 0.9)),
                                  "max": float(r["dist"].max()),
                                  "per_layer_median": [float(v) for v in np.median(r["dist"], 1)]},
            "strict_nll": float(x.mean()), "strict_nll_diff_vs_top": float((x - y).mean()),
            "strict_nll_diff_ci": [float(v) for v in paired_bootstrap_diff(x, y)] if b != top else [0.0, 0.0],
            "windows": int(len(x)),
            "needle_score": float(s.mean()), "needle_diff_vs_top": nd[0],
            "needle_diff_ci": [nd[1], nd[2]], "needle_samples": int(len(s)),
        })
    res = {"config": vars(a), "host": describe(), "calibrate_s": round(calib_s, 1), "rows": out_rows}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    for r in out_rows:
        print(f"{r['tokens']:>7d} tokens: distance median {r['subspace_distance']['median']:.4f}  strict NLL "
              f"{r['strict_nll']:.4f} (vs top {r['strict_nll_diff_vs_top']:+.4f} {r['strict_nll_diff_ci']})  needles "
              f"{r['needle_score']:.3f} (vs top {r['needle_diff_vs_top']:+.3f} {r['needle_diff_ci']})")
    print(f"-> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
