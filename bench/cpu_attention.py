"""The native CPU attention (kernels/cpu_attention.py) against torch's SDPA, measured in one process.

Sections (each path alternates with the other rep by rep, so the ratios see the same machine):

- kernel:  causal attention alone, SmolLM2's shape (9 query / 3 KV heads, head_dim 64), bf16 and float32,
           1k / 4k / 16k tokens (--lengths, --dtypes); error of each against a float64 softmax on the first 512
           queries.
- prefill: SmolLM2 bf16 prefill (`oscar run`'s dtype) of held-out text at 1k and 4k tokens, native vs
           SDPA; the last 256 positions' logits of each against the same model in float32 (argmax agreement,
           mean absolute difference).
- niah:    the needle loop (`decode_batch` over a PrefillPool, serving protocol) on niah_single_2,
           1k x 4 + 4k x 2 samples, bf16 plus the data-free INT2 methods, with OSCAR_CPU_FLASH=0 vs 1:
           CPU seconds, identical predictions and identical needle verdicts; the same on 1k x 4 in float32.
- ppl:     perplexity windows of 4096 tokens (bf16 plain, hadamard-int2 strict and serving): seconds and
           the NLL difference.

    python bench/cpu_attention.py [--threads 1] [--sections kernel,prefill,niah,ppl] [--out bench/results/cpu_attention.json]
    python bench/cpu_attention.py --sections kernel --lengths 512,2048 --dtypes float32 --as-avx2 \
        --out runs/cpu_attention_avx2.json   # the probe length of kernels/cpu_attention.py's host choice

--as-avx2 measures as an AVX2-only host runs (oscar.host.AVX2); every record names the host and a one-thread
GEMM's speed measured just before it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from oscar.host import avx2_env, gemm_gflops, is_avx2_env
from oscar import host
from oscar.kernels import cpu_attention as CA

OUT = Path(__file__).with_name("results") / "cpu_attention.json"


def _flag(on: bool) -> None:
    os.environ["OSCAR_CPU_FLASH"] = "1" if on else "0"


def _timed(fn) -> tuple[float, float, object]:
    w, c = time.perf_counter(), time.process_time()
    r = fn()
    return time.perf_counter() - w, time.process_time() - c, r


def kernel(reps: int, lengths=(1024, 4096, 16384), dtypes=(torch.bfloat16, torch.float32)) -> list[dict]:
    rows = []
    g = torch.Generator().manual_seed(0)
    for dt in dtypes:
        for T in lengths:
            q = torch.randn(1, 9, T, 64, generator=g).to(dt)
            k, v = (torch.randn(1, 3, T, 64, generator=g) + 0.2).to(dt), torch.randn(1, 3, T, 64, generator=g).to(dt)
            K, V = k.repeat_interleave(3, 1), v.repeat_interleave(3, 1)  # what transformers hands SDPA
            paths = {"native": lambda: CA.causal_attention(q, k, v)[0],
                     "sdpa": lambda: F.scaled_dot_product_attention(q, K, V, is_causal=True)}
            n = reps if T <= 4096 else 1
            t = {p: [] for p in paths}
            for p, fn in paths.items():
                fn() if T <= 4096 else None  # warm-up (16k: one timed call each)
            for _ in range(n):
                for p, fn in paths.items():
                    t[p].append(_timed(fn)[0])
            m = 512  # error on the first 512 queries (their keys: the first 512)
            ref = torch.softmax((q[:, :, :m].double() @ K[:, :, :m].double().transpose(-1, -2) * 0.125).masked_fill(
                ~torch.ones(m, m, dtype=torch.bool).tril(), float("-inf")), -1) @ V[:, :, :m].double()
            err = {"native": (CA.causal_attention(q[:, :, :m], k[:, :, :m], v[:, :, :m])[0].double() - ref).abs().max().item(),
                   "sdpa": (F.scaled_dot_product_attention(q[:, :, :m], K[:, :, :m], V[:, :, :m], is_causal=True).double()
                            - ref).abs().max().item()}
            ratios = [b / a for a, b in zip(t["native"], t["sdpa"])]
            rows.append({"dtype": str(dt).split(".")[-1], "tokens": T, "native_s": statistics.median(t["native"]),
                         "sdpa_s": statistics.median(t["sdpa"]), "speedup": statistics.median(ratios),
                         "speedup_per_rep": ratios, "max_abs_err_vs_float64": err,
                         "native_gflops": 4 * 9 * 64 * T * (T + 1) / 2 / statistics.median(t["native"]) / 1e9})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _model():
    from oscar.pipeline.models import load_model

    m = load_model("smollm2-135m", dtype=torch.bfloat16)
    return m[0] if isinstance(m, tuple) else m


def prefill(model, reps: int) -> list[dict]:
    """Held-out text (pydoc), bf16 model, native vs SDPA; both against the same model in float32."""
    from oscar.pipeline.models import load_model, load_tokenizer
    from oscar.validate import ppl as P

    tok = load_tokenizer("smollm2-135m")
    text = torch.tensor([P.heldout_ids(tok, "pydoc", 4096)])
    m32 = load_model("smollm2-135m", dtype=torch.float32)
    m32 = m32[0] if isinstance(m32, tuple) else m32
    rows = []
    for T in (1024, 4096):
        ids = text[:, :T]
        t = {"native": [], "sdpa": []}
        out = {}
        with torch.no_grad():
            ref = m32(input_ids=ids, logits_to_keep=256).logits[0].float()
            for _ in range(reps):
                for p in ("native", "sdpa"):
                    _flag(p == "native")
                    with CA.native_prefill(model):
                        w, _, r = _timed(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=256).logits[0])
                    t[p].append(w)
                    out[p] = r.float()
        _flag(True)
        ratios = [b / a for a, b in zip(t["native"], t["sdpa"])]
        agree = {p: (out[p].argmax(-1) == ref.argmax(-1)).float().mean().item() for p in out}
        dev = {p: (out[p] - ref).abs().mean().item() for p in out}
        rows.append({"tokens": T, "native_s": statistics.median(t["native"]), "sdpa_s": statistics.median(t["sdpa"]),
                     "speedup": statistics.median(ratios), "speedup_per_rep": ratios,
                     "argmax_agreement_with_float32_model_last_256": agree,
                     "mean_abs_logit_diff_vs_float32_model": dev,
                     "argmax_agreement_native_vs_sdpa": (out["native"].argmax(-1) == out["sdpa"].argmax(-1)).float().mean().item()})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def niah(model, cells=((1024, 4), (4096, 2))) -> dict:
    from oscar.pipeline.models import load_tokenizer
    from oscar.validate import env
    from oscar.validate.methods import method_artifact
    from oscar.scoring.protocols import PROTOCOLS
    from oscar.validate.niah import decode_batch, eos_ids
    from oscar.scoring.prefill import PrefillPool
    from oscar.validate.ruler import Sources, make_sample

    tok = load_tokenizer("smollm2-135m")
    src = Sources.from_text(env.heldout_text("pydoc"))
    methods = ["bf16", "naive-int2", "kivi2", "hadamard-int2"]
    arts = [method_artifact(m, model.config, None) for m in methods]
    eos, proto = eos_ids(model, tok), PROTOCOLS["serving"]
    res, answers = {}, []
    for p in ("sdpa", "native"):
        _flag(p == "native")
        gens, cpu, answers = [], 0.0, []
        with torch.no_grad():
            for L, n in cells:
                samples = [make_sample("niah_single_2", L, i, tok, src, seed=0) for i in range(n)]
                answers += [s.answers for s in samples for _ in methods]
                pool, per = PrefillPool(model), max(1, 4096 // L)
                for b in range(0, n, per):
                    chunk = samples[b:b + per]
                    _, c, r = _timed(lambda: decode_batch(model, chunk, [arts] * len(chunk), proto, pool, eos))
                    gens += r
                    cpu += c
        res[p] = {"cpu_s": cpu, "gens": gens}
    _flag(True)
    same = sum(a == b for a, b in zip(res["sdpa"]["gens"], res["native"]["gens"]))
    score = {p: [all(x in tok.decode(g, skip_special_tokens=True) for x in a) for g, a in zip(res[p]["gens"], answers)]
             for p in res}
    row = {"task": "niah_single_2", "dtype": str(next(model.parameters()).dtype).split(".")[-1], "cells": cells, "methods": methods, "rows": len(res["sdpa"]["gens"]),
           "sdpa_cpu_s": res["sdpa"]["cpu_s"], "native_cpu_s": res["native"]["cpu_s"],
           "cpu_ratio": res["sdpa"]["cpu_s"] / res["native"]["cpu_s"], "identical_predictions": same,
           "same_score": sum(a == b for a, b in zip(score["sdpa"], score["native"])),
           "found": {p: sum(v) for p, v in score.items()},
           "note": "greedy continuations of bf16 rows drift apart after a first differing token (rounding); "
                   "identical_predictions counts whole texts, same_score the needle verdicts"}
    print(json.dumps(row), flush=True)
    return row


def ppl(model) -> list[dict]:
    from oscar.pipeline.models import load_tokenizer
    from oscar.validate.methods import method_artifact
    from oscar.validate import ppl as P

    tok = load_tokenizer("smollm2-135m")
    ids = torch.tensor([P.heldout_ids(tok, "pydoc", 4096)])
    rows = []
    for m, proto in (("bf16", "strict"), ("hadamard-int2", "strict"), ("hadamard-int2", "serving")):
        art = method_artifact(m, model.config, None)
        r = {}
        for p in ("sdpa", "native"):
            _flag(p == "native")
            w, c, (nll, n, *_) = _timed(lambda: P._window(model, art, proto, ids, ()))
            r[p] = (w, c, nll / n)
        _flag(True)
        rows.append({"method": m, "protocol": proto, "tokens": 4096, "sdpa_cpu_s": r["sdpa"][1], "native_cpu_s": r["native"][1],
                     "cpu_ratio": r["sdpa"][1] / r["native"][1], "nll_sdpa": r["sdpa"][2], "nll_native": r["native"][2],
                     "nll_rel_diff": abs(r["native"][2] - r["sdpa"][2]) / r["sdpa"][2]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads for both paths (default 1)")
    ap.add_argument("--reps", type=int, default=5, help="alternating repetitions of the kernel and prefill timings (default 5)")
    ap.add_argument("--sections", default="kernel,prefill,niah,ppl", help="sections to run (default all four)")
    ap.add_argument("--out", default=str(OUT), help=f"JSON output (default {OUT})")
    ap.add_argument("--lengths", default="1024,4096,16384", help="kernel section's lengths (default 1024,4096,16384)")
    ap.add_argument("--dtypes", default="bfloat16,float32", help="kernel section's dtypes (default bfloat16,float32)")
    ap.add_argument("--as-avx2", action="store_true", help="measure as an AVX2-only host runs (module docstring)")
    a = ap.parse_args()
    if a.as_avx2 and not is_avx2_env():  # the restriction must be set before torch starts: run again under it
        sys.exit(subprocess.run([sys.executable, *sys.argv], env=avx2_env()).returncode)
    gflops = gemm_gflops()
    torch.set_num_threads(a.threads)
    assert CA.available(), f"native kernel unavailable: {CA.WHY_NOT}"
    res = {"command": "python bench/cpu_attention.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items()
                                                                   if k not in ("out", "as_avx2"))
                      + (" --as-avx2" if a.as_avx2 else ""),
           "host": host.describe(), "node": f"{platform.node()} ({os.cpu_count()} CPUs)", "gemm_gflops_1thread": gflops,
           "threads": a.threads, "torch": torch.__version__, "loadavg_start": os.getloadavg()}
    secs = a.sections.split(",")
    if "kernel" in secs:
        res["kernel"] = kernel(a.reps, [int(x) for x in a.lengths.split(",")],
                               [getattr(torch, x) for x in a.dtypes.split(",")])
    model = _model() if {"prefill", "niah", "ppl"} & set(secs) else None
    if "prefill" in secs:
        res["prefill"] = prefill(model, a.reps)
    if "niah" in secs:
        res["niah"] = niah(model)
        from oscar.pipeline.models import load_model

        m32 = load_model("smollm2-135m", dtype=torch.float32)  # float32: the kernel equals SDPA to ~1e-6
        res["niah_float32"] = niah(m32[0] if isinstance(m32, tuple) else m32, cells=((1024, 4),))
    if "ppl" in secs:
        res["ppl"] = ppl(model)
    res["loadavg_end"] = os.getloadavg()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print("wrote", a.out)


if __name__ == "__main__":
    main()
