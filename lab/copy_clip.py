"""Diagnostic: does a retrieval objective on calibration text choose a different key clip than NLL?

`oscar validate tune` picks the key-clip factor by next-token NLL on a calibration window under the strict
protocol. Needles are retrieval: the answer is a token far back in the INT2 history that must out-score every
other key. This measures, per clip factor, the NLL of a **copied span** read from the INT2 history under the
serving protocol: a calibration window of T tokens whose last S tokens repeat a span from its middle (after
the sinks, before the recent window). The model can only predict the copy by attending back to the span
(induction), so its NLL is a needle-like proxy built from calibration text alone: no needle template, no
validation sample. The first COPY_SKIP tokens of the copy are not scored (nothing points at the span yet).

    python lab/copy_clip.py --artifact runs/i16d/artifact.fit.safetensors --out lab/results/copy_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import time

def main() -> int:
    from oscar.stats.artifact import load_artifact
    from oscar.validate.env import load_model
    from oscar.scoring.dtype import with_dtype
    from oscar.scoring.protocols import PROTOCOLS
    from oscar.kernels.window_attention import simulated
    from oscar.recipe.tune import COPY_SKIP, TuneConfig, calibration_ids, copy_nll, copy_windows, scale_key_clips, tune_key_clip

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--factors", default="1.0,1.1,1.2,1.3,1.5,2.0")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--span", type=int, default=48)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    model, tok, _ = load_model(a.model)
    with_dtype(model, "float32")
    art = load_artifact(a.artifact)
    serving = PROTOCOLS["serving"]
    factors = [float(x) for x in a.factors.split(",")]
    # the tune's own objective per factor, for comparison (its record lists every factor's NLL)
    strict = tune_key_clip(model, tok, art, TuneConfig(factors=tuple(factors)))[1]["nll_per_token"]
    ids = calibration_ids(tok, "pydoc", a.windows * (a.length - a.span))
    wins = copy_windows(ids, a.windows, a.length, a.span, serving.sink, serving.recent)
    rows = []
    t0 = time.perf_counter()
    for f in [None] + factors:
        r = {"factor": f, "windows": []}
        for win, pos, p in wins:
            if f is None:
                s, hits = copy_nll(model, win, pos)
            else:
                with simulated(model, scale_key_clips(art, f), serving):
                    s, hits = copy_nll(model, win, pos)
            r["windows"].append({"span_start": p, "nll": s, "hits": hits, "n": len(pos)})
        if f is not None:
            r["strict_nll_per_token"] = strict[str(f)]
        n = sum(w["n"] for w in r["windows"])
        r["copy_nll_per_token"] = sum(w["nll"] for w in r["windows"]) / n
        r["copy_top1"] = sum(w["hits"] for w in r["windows"]) / n
        rows.append(r)
        print(f"factor {f}: copy NLL {r['copy_nll_per_token']:.4f} top1 {r['copy_top1']:.3f} "
              f"strict NLL {r.get('strict_nll_per_token', float('nan')):.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    json.dump({"artifact": a.artifact, "model": a.model, "length": a.length, "span": a.span, "copy_skip": COPY_SKIP,
               "protocol": "serving", "rows": rows}, open(a.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
