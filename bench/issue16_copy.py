"""Issue 16 diagnostic: does a retrieval objective on calibration text choose a different key clip than NLL?

`oscar validate tune` picks the key-clip factor by next-token NLL on a calibration window under the strict
protocol. Needles are retrieval: the answer is a token far back in the INT2 history that must out-score every
other key. This measures, per clip factor, the NLL of a **copied span** read from the INT2 history under the
serving protocol: a calibration window of T tokens whose last S tokens repeat a span from its middle (after
the sinks, before the recent window). The model can only predict the copy by attending back to the span
(induction), so its NLL is a needle-like proxy built from calibration text alone: no needle template, no
validation sample. The first COPY_SKIP tokens of the copy are not scored (nothing points at the span yet).

    python bench/issue16_copy.py --artifact runs/i16d/artifact.fit.safetensors --out bench/results/issue16/copy_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

COPY_SKIP = 2


def copy_windows(ids: list[int], n: int, T: int, S: int, sink: int, recent: int, seed: int = 0):
    """n (window, scored positions) pairs: T - S haystack tokens of calibration text, then a copy of S of them.

    Windows are consecutive slices of the calibration split; the copied span's start is drawn uniformly
    between the sinks and the last token that is INT2 when the copy is read (serving: T - recent)."""
    g = torch.Generator().manual_seed(seed)
    H = T - S
    out = []
    for w in range(n):
        hay = ids[w * H:(w + 1) * H]
        hi = T - recent - S  # the whole span is older than the recent window while the copy is read
        p = int(torch.randint(sink, hi, (1,), generator=g))
        win = torch.tensor([hay + hay[p:p + S]])  # (1, T)
        pos = torch.arange(H + COPY_SKIP - 1, T - 1)  # logits at these positions predict copy tokens COPY_SKIP..S-1
        out.append((win, pos, p))
    return out


@torch.no_grad()
def copy_nll(model, win: torch.Tensor, pos: torch.Tensor) -> tuple[float, float]:
    """(sum NLL, top-1 hits) of the copy's scored tokens."""
    h = model.model(input_ids=win, use_cache=False).last_hidden_state  # (1, T, H)
    logits = model.lm_head(h[0, pos]).float()  # (n, V)
    tgt = win[0, pos + 1]  # (n,)
    return F.cross_entropy(logits, tgt, reduction="sum").item(), (logits.argmax(-1) == tgt).sum().item()


def main() -> int:
    from oscar.stats.artifact import load_artifact
    from oscar.validate.env import load_model, with_dtype
    from oscar.validate.methods import PROTOCOLS
    from oscar.validate.ppl import simulated
    from oscar.validate.tune import TuneConfig, calibration_ids, scale_key_clips, tune_key_clip

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
