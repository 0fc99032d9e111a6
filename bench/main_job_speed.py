"""The needle stage of `oscar run` (its dominant cost), previous loop vs current, measured in one process.

Same model object, samples, artifact, protocol (serving) and methods (all 7 defaults):

- old: the previous `run_niah` loop — per sample, `PrefillPool` prefill, one `MethodBatchCache` of its
  methods, `greedy` (SDPA attention in the model dtype, every row decoding to the batch's last stop);
- new: `niah.decode_batch` — max(1, 4096 // length) samples per batch, all their methods as rows of
  one `RowBatchCache` (float32 K/V, `rows_attention`, finished rows leave the batch).

Both start each (task, length) from an empty prefill pool; the quantization primitives are the current
ones in both (their speed-up is bit-identical and timed separately: `quant` below, previous
`fake_quant` vs current on a 4k prefill's K/V for each method's spec). Predictions are compared row
by row; `--check-dtype float32` repeats the comparison in float32 (expected: identical).

    python bench/main_job_speed.py [--artifact A] [--dtype bfloat16] [--threads 1]
                                   [--cells 1024:4,2048:2,4096:2] [--tasks niah_single_1,niah_single_2]

Writes bench/results/main_job_speed.json: CPU (process) and wall seconds per path and cell, their
ratios, the prediction agreement, and a projection of the NIAH stage at the defaults (20 samples per
cell) from the per-sample costs and the stage time of the run the issue measured. The load average
is recorded: ratios, not absolute seconds, are what carries over between machines.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from oscar.stats.artifact import load_artifact
from oscar.validate import DEFAULT_METHODS, env
from oscar.validate.methods import PROTOCOLS, LayerQuant, MethodBatchCache, method_artifact
from oscar.validate.niah import PrefillPool, decode_batch, eos_ids, greedy
from oscar.validate.ruler import Sources, make_sample

OUT = Path(__file__).with_name("results") / "main_job_speed.json"
ISSUE_NIAH_S = 828.0  # the needle stage of the 20.2-min run issue 19 measured (the old loop)


class Clock:
    def __enter__(self):
        self.w, self.c = time.time(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.time() - self.w, time.process_time() - self.c


def old_loop(model, samples, arts, proto, eos) -> list[list[int]]:
    pool, out = PrefillPool(model), []
    for s in samples:
        exact = pool.prefill(s.context_ids)
        cache = MethodBatchCache.from_prefill(arts, proto, exact, capacity=s.total_tokens)
        out += greedy(model, cache, s.question_ids, s.max_new_tokens, eos, rows=len(arts))
    return out


def new_loop(model, samples, arts, proto, eos) -> list[list[int]]:
    pool, out = PrefillPool(model), []
    per = max(1, 4096 // samples[0].length)
    for b in range(0, len(samples), per):
        chunk = samples[b:b + per]
        out += decode_batch(model, chunk, [arts] * len(chunk), proto, pool, eos)
    return out


def niah_cells(model, tok, arts, cells, tasks, proto) -> list[dict]:
    src = Sources.from_text(env.heldout_text("pydoc"))
    eos = eos_ids(model, tok)
    rows = []
    with torch.no_grad():
        for task in tasks:
            for L, n in cells:
                samples = [make_sample(task, L, i, tok, src, seed=0) for i in range(n)]
                load = os.getloadavg()[0]
                with Clock() as o:
                    old = old_loop(model, samples, arts, proto, eos)
                with Clock() as w:
                    new = new_loop(model, samples, arts, proto, eos)
                same = sum(a == b for a, b in zip(old, new))
                texts = [(tok.decode(a, skip_special_tokens=True), tok.decode(b, skip_special_tokens=True)) for a, b in zip(old, new)]
                hits = [(any(x in p for x in s.answers), any(x in q for x in s.answers))
                        for (p, q), s in zip(texts, [s for s in samples for _ in arts])]
                rows.append({"task": task, "length": L, "samples": n, "rows": len(old), "old_cpu_s": o.cpu, "new_cpu_s": w.cpu,
                             "old_wall_s": o.wall, "new_wall_s": w.wall, "cpu_ratio": o.cpu / w.cpu, "wall_ratio": o.wall / w.wall,
                             "identical_predictions": same, "same_score": sum(a == b for a, b in hits), "loadavg": load})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def _fake_quant_previous(x, spec, clip):
    """`kernels.quant.fake_quant` before this change (aminmax, strided channel groups), for the timing."""
    from oscar.kernels import quant as Q

    xf = x.float()
    g = Q._grouped(xf, spec)
    if clip is not None and spec.clip_rule == "row-quantile":
        t = Q._row_quantile(g.abs(), clip)
        gc = torch.minimum(torch.maximum(g, -t), t)
        lo, hi = torch.aminmax(gc, dim=-1)
    else:
        lo, hi = torch.aminmax(g, dim=-1)
        r = torch.as_tensor(clip, dtype=torch.float32)
        lo, hi = lo * r, hi * r
    scale = ((hi - lo) / spec.levels).clamp_min(1e-8).to(spec.param_dtype).float().unsqueeze(-1)
    zero = lo.to(spec.param_dtype).float().unsqueeze(-1)
    codes = (g - zero).div_(scale).add_(0.5).floor_().clamp_(0, spec.levels)
    return Q._ungrouped(codes.mul_(scale).add_(zero), spec, x.shape).to(x.dtype)


def quant_timing(model, fitted, methods, T: int = 4032, reps: int = 5) -> list[dict]:
    """One layer's prefill K/V (1, Hkv, T, D) quantized per method: previous fake_quant (with the rotation
    matmuls always applied) vs LayerQuant.keys/values now; outputs compared bit for bit."""
    from oscar.kernels.quant import fake_quant

    g = torch.Generator().manual_seed(0)
    rows = []
    for m in methods:
        art = method_artifact(m, model.config, fitted)
        if art is None:
            continue
        lq = LayerQuant(art, 5)
        x = torch.randn(1, art.num_kv_heads, T, art.head_dim, generator=g).to(next(model.parameters()).dtype)

        def old():
            xk = x.float() - lq.k_mean if lq.k_mean is not None else x.float()
            k = _fake_quant_previous(xk @ lq.rot_k, lq.kspec, lq.clip_k) @ lq.unrot_k
            k = (k + lq.k_mean if lq.k_mean is not None else k).to(x.dtype)
            v = (_fake_quant_previous(x.float() @ lq.rot_v, lq.vspec, lq.clip_v) @ lq.rot_v.transpose(-1, -2)).to(x.dtype)
            return k, v

        def new():
            return lq.keys(x), lq.values(x)

        ok = all(torch.equal(a, b) for a, b in zip(old(), new()))
        assert torch.equal(fake_quant(x.float(), lq.kspec, lq.clip_k), _fake_quant_previous(x.float(), lq.kspec, lq.clip_k))
        t = {}
        for name, f in (("old", old), ("new", new)):
            c = time.process_time()
            for _ in range(reps):
                f()
            t[name] = (time.process_time() - c) / reps
        rows.append({"method": m, "old_ms": 1e3 * t["old"], "new_ms": 1e3 * t["new"], "ratio": t["old"] / t["new"],
                     "identical": ok})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def ppl_windows(model, tok, fitted) -> dict:
    """Placeholder until the perplexity path has an old/new pair (see `oscar.validate.ppl`)."""
    return {}


def project(rows: list[dict], samples: int = 20) -> dict:
    """NIAH stage at `samples` per cell: per-sample CPU cost of each path per (task, length), summed."""
    old = sum(r["old_cpu_s"] / r["samples"] * samples for r in rows)
    new = sum(r["new_cpu_s"] / r["samples"] * samples for r in rows)
    return {"old_cpu_s_at_defaults": old, "new_cpu_s_at_defaults": new, "ratio": old / new,
            "issue_niah_s": ISSUE_NIAH_S, "projected_niah_s": ISSUE_NIAH_S * new / old,
            "note": "cells measured here stand for all cells of their length; quant speed-ups are in both paths"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", default="runs/demo/artifact.safetensors",
                    help="oscar-int2 artifact whose calibration store still exists (default: the main job's, runs/demo)")
    ap.add_argument("--dtype", default="bfloat16", help="model compute dtype, as `oscar run` (default bfloat16)")
    ap.add_argument("--check-dtype", default="float32",
                    help="dtype of a second, smaller comparison (1k, 4 samples; '' to skip; default float32)")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads for both paths (default 1: robust on a shared machine)")
    ap.add_argument("--cells", default="1024:4,2048:2,4096:2", help="length:samples per cell (default 1024:4,2048:2,4096:2)")
    ap.add_argument("--tasks", default="niah_single_1,niah_single_2", help="tasks (default: the main job's two)")
    ap.add_argument("--sections", default="quant,niah,ppl",
                    help="what to measure (default quant,niah,ppl); results of other sections already in the JSON are kept")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cells = [tuple(int(x) for x in c.split(":")) for c in a.cells.split(",")]
    model, tok, _ = env.load_model("smollm2-135m")
    fitted = load_artifact(a.artifact)
    methods = list(DEFAULT_METHODS)
    proto = PROTOCOLS["serving"]
    sections = a.sections.split(",")
    res = json.loads(OUT.read_text()) if OUT.exists() else {}
    run = {"host": f"{platform.node()} ({os.cpu_count()} CPUs)", "threads": a.threads, "dtype": a.dtype,
           "artifact": a.artifact, "methods": methods, "protocol": proto.name, "loadavg_start": os.getloadavg()}
    env.with_dtype(model, a.dtype)
    arts = [method_artifact(m, model.config, fitted) for m in methods]
    if "quant" in sections:
        res["quant"] = {**run, "rows": quant_timing(model, fitted, methods)}
    if "niah" in sections:
        rows = niah_cells(model, tok, arts, cells, a.tasks.split(","), proto)
        res["niah"] = {**run, "cells": rows, "projection": project(rows)}
        if a.check_dtype:
            env.with_dtype(model, a.check_dtype)
            res["niah"]["check"] = {"dtype": a.check_dtype,
                                    "cells": niah_cells(model, tok, arts, [(1024, 4)], ["niah_single_2"], proto)}
            env.with_dtype(model, a.dtype)
        res["niah"]["loadavg_end"] = os.getloadavg()
    if "ppl" in sections:
        res["ppl"] = {**run, **ppl_windows(model, tok, fitted), "loadavg_end": os.getloadavg()}
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v.get("projection") for k, v in res.items() if isinstance(v, dict)}, indent=1))


if __name__ == "__main__":
    main()
