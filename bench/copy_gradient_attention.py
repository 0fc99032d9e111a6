"""The per-layer widths' autograd attention: query blocks against one attention over all 2T columns.

The copy probe to first order (oscar/recipe/widths.py) runs each window forward and backward through
`kernels.grad_attention._grad_attention`: every query reads key j exactly or from INT2 by the fresh mask. By query
blocks (`QUERY_BLOCK`, 256) each call reads only the columns its block can see; one block of the whole window is
one attention over every column some query reads, exact and stored (~2T), under one dense mask: the form the
blocks replaced. Both,
forward + backward of one layer on random q / k / v and INT2 error leaves at SmolLM2's shapes (9 query heads, 3 KV
heads, head_dim 64), sink 64 + recent 256, pages of 16, are timed interleaved in one run (median of --repeats),
with the largest difference of the output and of each gradient against the one-block form relative to its largest
entry. One record per host (run.json's host line: an AVX2-only run, `ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2`, is its own).

    python bench/copy_gradient_attention.py [--out bench/results/copy_gradient_attention.json] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from types import SimpleNamespace

import torch

from oscar.host import describe, info
from oscar.kernels import grad_attention as ga

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "results", "copy_gradient_attention.json")
SINK, RECENT, GROUP = 64, 256, 16


class Quant:
    """Stands in for a layer's INT2 quantizer: a fixed error per stored key / value (the timing does not depend on it)."""

    key_group = GROUP

    def __init__(self, kerr: torch.Tensor, verr: torch.Tensor):
        self.kerr, self.verr = kerr, verr

    def quantized_until(self, T: int, sink: int, recent: int) -> int:
        return sink + (T - sink) // GROUP * GROUP

    def keys(self, x):
        return x + self.kerr[..., :x.shape[2], :]

    def values(self, x):
        return x + self.verr[..., :x.shape[2], :]


def attention(q, k, v, lq, block: int):
    """`_grad_attention` with queries in blocks of `block`: (output (B, Hq, T, D), key error leaf, value error leaf)."""
    ga._GRAD.update(quant=[lq], protocol=SimpleNamespace(sink=SINK, recent=RECENT), deltas=[None], keys=[None],
                    vdeltas=[None], values=[None])
    prev, ga.QUERY_BLOCK = ga.QUERY_BLOCK, block
    try:
        out = ga._grad_attention(SimpleNamespace(layer_idx=0), q, k, v)[0].transpose(1, 2)  # (B, Hq, T, D)
    finally:
        ga.QUERY_BLOCK = prev
    return out, ga._GRAD["deltas"][0], ga._GRAD["vdeltas"][0]


def step(block: int, q, k, v, lq, R):
    for t in (q, k, v):
        t.grad = None
    t0 = time.perf_counter()
    out, d, dv = attention(q, k, v, lq, block)
    (out * R).sum().backward()
    s = time.perf_counter() - t0
    return s, [out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone(), d.grad.clone(), dv.grad.clone()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    rows = []
    for T in (int(x) for x in a.lengths.split(",")):
        q, k, v = (torch.randn(1, h, T, 64, generator=g).requires_grad_() for h in (9, 3, 3))  # (B, H, T, D)
        lq = Quant(0.1 * torch.randn(1, 3, T, 64, generator=g), 0.1 * torch.randn(1, 3, T, 64, generator=g))
        R = torch.randn(1, 9, T, 64, generator=g)
        times = {"dense": [], "blocked": []}
        for _ in range(a.repeats):  # interleaved: a drift of the host's speed hits both
            for name, block in (("dense", T), ("blocked", ga.QUERY_BLOCK)):
                s, res = step(block, q, k, v, lq, R)
                times[name].append(s)
                if name == "dense":
                    ref = res
                else:
                    err = [float((x - y).abs().max() / y.abs().max()) for x, y in zip(res, ref)]
        med = {n: statistics.median(t) for n, t in times.items()}
        rows.append({"tokens": T, "dense_s": med["dense"], "blocked_s": med["blocked"],
                     "speedup": med["dense"] / med["blocked"], "query_block": ga.QUERY_BLOCK,
                     "max_rel_diff": dict(zip(["out", "dq", "dk", "dv", "dkey_err", "dvalue_err"], err))})
        print(f"T={T}: dense {med['dense']:.3f} s, blocked {med['blocked']:.3f} s, x{rows[-1]['speedup']:.2f}; "
              f"max rel diff {max(err):.1e}")
    rec = {"host": describe(), "host_info": info(), "threads": torch.get_num_threads(), "repeats": a.repeats,
           "date": time.strftime("%Y-%m-%d"), "rows": rows}
    try:
        with open(a.out) as f:
            runs = json.load(f)["runs"]
    except (OSError, ValueError, KeyError):
        runs = {}
    runs[rec["host"]] = rec
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"shapes": "SmolLM2: 9 query heads, 3 KV heads, head_dim 64, float32, forward + backward of one layer",
                   "runs": runs}, f, indent=1)
    print(f"wrote {a.out}: {rec['host']} ({len(runs)} records)")


if __name__ == "__main__":
    main()
