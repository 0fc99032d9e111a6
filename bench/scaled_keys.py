"""Scaled keys (`--variant scaled`) vs the orthogonal centred recipe, same store, same samples.

    python bench/scaled_keys.py [--store reports/examples/smollm2/calib.zarr] [--lengths 2048,4096]
                                [--samples 10] [--ppl-tokens 4096] [--dtype bfloat16] [--no-niah] [--no-ppl]

Both artifacts are fitted here from one calibration store (`centered`: R_K = U_Q H P_br;
`scaled`: R_K = U_Q diag(d) H P_br with queries read through U_Q diag(1/d) H P_br,
d = (λ/σ²)^¼ — docs/decisions/0033-scaled-keys-oscar-run-fits-variant-scaled-behind.md, "Scaled keys"). Then:
  A. the fit's own objective: relative q-weighted logit MSE of the INT2 keys at the searched clip,
     per layer (calibration reservoir rows), and the attention-output error of the values (unchanged);
  B. NIAH (niah_single_1/2, serving protocol, as `oscar run`) with bf16 and both recipes as methods
     of one run, so every method reads the same prompts;
  C. held-out perplexity under both protocols (strict: every non-sink token from INT2).
Writes bench/results/scaled_keys.json and scaled_keys.png (per-layer key error).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from oscar.common import set_threads
from oscar.stats.fit import FitConfig, fit
from oscar.validate import methods as M

OUT = Path(__file__).with_name("results") / "scaled_keys.json"
RECIPES = ("centered", "scaled")


def _register(arts: dict) -> list[str]:
    names = []
    for v, art in arts.items():
        name = f"oscar-int2-{v}"

        def factory(config, _art, art=art):
            art.check_model(config)
            return art

        M.register_method(name, factory)
        names.append(name)
    return names


def _plot(err: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    for v, e in err.items():
        ax.plot(range(len(e)), e, marker="o", ms=3, label=v)
    ax.set_xlabel("layer")
    ax.set_ylabel("relative q-weighted logit MSE")
    ax.set_title("INT2 key error at the searched clip (SmolLM2, calibration reservoir)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", default="reports/examples/smollm2/calib.zarr")
    ap.add_argument("--tasks", default="niah_single_1,niah_single_2")
    ap.add_argument("--lengths", default="2048,4096")
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--ppl-tokens", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--no-niah", action="store_true")
    ap.add_argument("--no-ppl", action="store_true")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    threads = set_threads()
    t0 = time.perf_counter()
    arts = {v: fit(args.store, FitConfig(variant=v, progress=False)) for v in RECIPES}
    key_err = {v: [float(np.mean(lm["clip"]["k"]["err"])) for lm in a.meta["layers"]] for v, a in arts.items()}
    val_err = {v: [float(np.mean(lm["clip"]["v"]["err"])) for lm in a.meta["layers"]] for v, a in arts.items()}
    res: dict = {
        "store": args.store, "dtype": args.dtype, "threads": threads,
        "key_logit_err": {v: {"mean": float(np.mean(e)), "per_layer": e} for v, e in key_err.items()},
        "value_attn_err_mean": {v: float(np.mean(e)) for v, e in val_err.items()},
        "command": "python bench/scaled_keys.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out" and v not in (False, None)),
    }
    print("key error (mean over layers):", {v: round(r["mean"], 4) for v, r in res["key_logit_err"].items()})
    methods = ["bf16"] + _register(arts)
    with tempfile.TemporaryDirectory(prefix="oscar-scaled-") as d:  # the registered methods bring their artifacts
        if not args.no_niah:
            from oscar.validate.niah import NiahConfig, run_niah

            df = run_niah(NiahConfig(out=str(Path(d) / "niah"), methods=methods, tasks=args.tasks.split(","),
                                     lengths=[int(x) for x in args.lengths.split(",")], samples=args.samples,
                                     protocol="serving", dtype=args.dtype))
            res["niah_score_percent"] = {t: {str(L): dict(zip(g.method, g.score)) for L, g in gt.groupby("length")}
                                         for t, gt in df.groupby("task")}
            res["niah"] = {"protocol": "serving", "samples": args.samples}
            print(json.dumps(res["niah_score_percent"], indent=1))
        if not args.no_ppl:
            from oscar.validate.ppl import PplConfig, run_ppl

            df = run_ppl(PplConfig(out=str(Path(d) / "ppl"), methods=methods, contexts=[1024, 4096],
                                   tokens=args.ppl_tokens, dtype=args.dtype))
            base = df[df.method == "bf16"].set_index(["protocol", "context"]).ppl
            res["ppl"] = [{"method": r.method, "protocol": r.protocol, "context": int(r.context), "ppl": round(float(r.ppl), 4),
                           "ratio_vs_bf16": round(float(r.ppl / base[(r.protocol, r.context)]), 4),
                           "bits_per_element": float(r.bits_per_element)} for r in df.itertuples()]
            for r in res["ppl"]:
                print(r)
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    _plot(key_err, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
