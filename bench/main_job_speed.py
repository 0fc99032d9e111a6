"""The needle stage of `oscar run` (its dominant cost), previous loop vs current, measured in one process.

Same model object, samples, artifact, protocol (serving) and methods (all 7 defaults):

- old: the previous `run_niah` loop — per sample, `PrefillPool` prefill, one `MethodBatchCache` of its
  methods, `greedy` (SDPA attention in the model dtype, every row decoding to the batch's last stop);
- new: `niah.decode_batch` — max(1, 4096 // length) samples per batch, all their methods as rows of
  one `RowBatchCache` (float32 K/V, `rows_attention`, finished rows leave the batch).

Both start each (task, length) from an empty prefill pool; the quantization primitives are the current
ones in both (their speed-up is bit-identical and timed separately: `quant` below, previous
`fake_quant` vs current on a 4k prefill's K/V for each method's spec). Predictions are compared row
by row; `--check-dtype float32` repeats the comparison in float32 arithmetic (expected: identical
predictions) on the same model object (its weights were rounded to bfloat16 once by the first part).

    python bench/main_job_speed.py [--artifact A] [--dtype bfloat16] [--threads 1]
                                   [--cells 1024:4,2048:2,4096:2] [--tasks niah_single_1,niah_single_2]

Sections beyond those: `profile` (the current needle loop's CPU time by phase, one
thread), `rows_attention` (question-chunk scores in one block vs cache-sized row chunks) and `workers` (the
NIAH and perplexity stage loops in this process vs on worker processes, validate/workers.py):

    python bench/main_job_speed.py --artifact A --sections profile,rows_attention,workers --check-dtype ''

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
from oscar.defaults import DEFAULT_METHODS
from oscar.validate import env
from oscar.scoring.dtype import with_dtype
from oscar.kernels.simulate import LayerQuant, MethodBatchCache
from oscar.validate.methods import method_artifact
from oscar.scoring.protocols import PROTOCOLS
from oscar.kernels import window_attention as W
from oscar.validate import ppl as P
from oscar.scoring.nll import window_nll
from oscar.kernels import window_attention
from oscar.validate.niah import decode_batch, eos_ids, greedy
from oscar.scoring.prefill import PrefillPool
from oscar.validate.ruler import Sources, make_sample

OUT = Path(__file__).with_name("results") / "main_job_speed.json"
ISSUE_NIAH_S = 828.0  # the needle stage of the 20.2-min run measured before the loop was rewritten (the old loop)


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


def niah_cells(model, tok, arts, cells, tasks, proto, save=lambda rows: None) -> list[dict]:
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
                save(rows)
    return rows


def _fake_quant_previous(x, spec, clip):
    """`oscar.quant.fake_quant` before this change (aminmax, strided channel groups), for the timing."""
    from oscar import quant as Q

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
    from oscar.quant import fake_quant

    g = torch.Generator().manual_seed(0)
    rows = []
    for m in methods:
        art = method_artifact(m, model.config, fitted)
        if art is None:
            continue
        lq = LayerQuant(art, 5)
        x = torch.randn(1, art.num_kv_heads, T, art.head_dim, generator=g).to(next(model.parameters()).dtype)

        def old():
            r = lq.rot  # the layer's LayerRotation
            mu = r.k_mean[None, :, None, :] if r.k_mean is not None else None  # (1, Hkv, 1, D)
            xk = x.float() - mu if mu is not None else x.float()
            k = _fake_quant_previous(xk @ r.rot_k, lq.kspec, lq.clip_k) @ r.rot_q.transpose(-1, -2)
            k = (k + mu if mu is not None else k).to(x.dtype)
            v = (_fake_quant_previous(x.float() @ r.rot_v, lq.vspec, lq.clip_v) @ r.rot_v.transpose(-1, -2)).to(x.dtype)
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


def _sim_attention_previous(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """`oscar.validate.window_attention.sim_attention` before this change (the baseline). query (B, Hq, T, D), key/value (B, Hkv, T, D) post-RoPE; a whole window from an empty cache.

    With W = recent + key_group, every key j <= i - W is read from the stored cache (INT2, or an
    exact sink) by query i: that part is one causal flash attention over the stored keys shifted
    by W. The band i - W < j <= i mixes exact and INT2 keys per (i, j) (the fresh mask); it is
    computed in query blocks, and the two parts are merged through their log-sum-exps. Same
    result as the dense masked softmax (tests compare it with token-by-token decoding).
    """
    lq = W._SIM["quant"][module.layer_idx]
    p = W._SIM["protocol"]
    B, Hq, T, D = query.shape
    sink = min(p.sink, T)
    b = lq.quantized_until(T, sink, 0)  # everything from sink, keys in whole groups
    kh, vh = key.clone(), value.clone()  # (B, Hkv, T, D): the stored cache (sink exact, [sink, b) INT2)
    kh[..., sink:b, :] = lq.keys(key[..., sink:b, :])
    vh[..., sink:b, :] = lq.values(value[..., sink:b, :])
    rep = Hq // key.shape[1]
    scale = scaling if scaling is not None else D ** -0.5
    W = p.recent + lq.key_group  # j <= i - W: read from the stored cache by every query i
    far = None
    if T > W:
        Kf, Vf = kh[..., :T - W, :].repeat_interleave(rep, 1), vh[..., :T - W, :].repeat_interleave(rep, 1)
        far = W._flash_lse(query[:, :, W:], Kf, Vf, scale, causal=True)  # rows: queries W..T-1
    out = torch.empty_like(query)
    pos = torch.arange(T, device=query.device)
    C = 256  # the previous fixed query block
    for q0 in range(0, T, C):
        q1 = min(T, q0 + C)
        k0 = max(0, q0 - W + 1)
        qi, kj = pos[q0:q1], pos[k0:q1]
        fr = W.fresh(qi, kj, sink, p.recent, lq.key_group)  # (c, n) exact?
        band = (kj[None, :] <= qi[:, None]) & (kj[None, :] > qi[:, None] - W)
        K, V = key[..., k0:q1, :].repeat_interleave(rep, 1), value[..., k0:q1, :].repeat_interleave(rep, 1)
        q = query[:, :, q0:q1]  # (B, Hq, c, D)
        mixed = not bool((fr | ~band).all())  # per-token groups: the band is all exact
        s = q @ K.transpose(-1, -2)  # (B, Hq, c, n)
        if mixed:
            Kh, Vh = kh[..., k0:q1, :].repeat_interleave(rep, 1), vh[..., k0:q1, :].repeat_interleave(rep, 1)
            s = torch.where(fr, s, q @ Kh.transpose(-1, -2))
        s = s.float().mul_(scale).masked_fill_(~band, float("-inf"))
        m = s.amax(-1, keepdim=True)  # every row has its own key in the band: finite
        e = torch.exp(s - m)
        z = e.sum(-1, keepdim=True)
        if mixed:
            frf = fr.to(e.dtype)
            o = ((e * frf) @ V.float() + (e * (1 - frf)) @ Vh.float()) / z  # (B, Hq, c, D)
        else:
            o = (e @ V.float()) / z
        if far is not None and q1 > W:
            a = max(q0, W)  # queries [a, q1) also have a far part
            of, lf = far[0][:, :, a - W:q1 - W].float(), far[1][:, :, a - W:q1 - W].float().unsqueeze(-1)
            ln = (m + torch.log(z))[:, :, a - q0:]
            lse = torch.logaddexp(ln, lf)
            o[:, :, a - q0:] = torch.exp(ln - lse) * o[:, :, a - q0:] + torch.exp(lf - lse) * of
        out[:, :, q0:q1] = o.to(query.dtype)
    return out.transpose(1, 2).contiguous(), None




def ppl_windows(model, tok, fitted, configs=(("oscar-int2", "strict"), ("oscar-int2", "serving"), ("kivi2", "strict")),
                context: int = 4096, prefix: int = 1024) -> dict:
    """One `context`-token window (its first `prefix` tokens scored as the shorter window, as `run_ppl` does)
    per (method, protocol): the previous band loop vs the current batched band; NLLs compared."""
    from transformers import AttentionInterface



    AttentionInterface.register("oscar_sim", W.sim_attention)
    ids = torch.tensor([P.heldout_ids(tok, "pydoc", context)])
    rows = []
    for m, proto in configs:
        art = method_artifact(m, model.config, fitted)
        t, nll = {}, {}
        for name, fn in (("old", _sim_attention_previous), ("new", W.sim_attention)):
            with W.simulated(model, art, PROTOCOLS[proto]):
                AttentionInterface.register("oscar_sim", fn)  # `simulated` registered the current one
                c = time.process_time()
                nll[name] = window_nll(model, ids, prefixes=(prefix,))
                t[name] = time.process_time() - c
            AttentionInterface.register("oscar_sim", W.sim_attention)
        rows.append({"method": m, "protocol": proto, "context": context, "old_cpu_s": t["old"], "new_cpu_s": t["new"],
                     "cpu_ratio": t["old"] / t["new"], "nll_old": nll["old"][0], "nll_new": nll["new"][0],
                     "nll_rel_diff": abs(nll["new"][0] / nll["old"][0] - 1),
                     "prefix_nll_rel_diff": abs(nll["new"][2][0][0] / nll["old"][2][0][0] - 1)})
        print(json.dumps(rows[-1]), flush=True)
    return {"windows": rows, "ratio": sum(r["old_cpu_s"] for r in rows) / sum(r["new_cpu_s"] for r in rows)}


def rows_attention_timing(reps: int = 3) -> list[dict]:
    """`rows_attention` with scores in one 64 MiB block (previous) vs cache-sized row chunks (current), on
    the question-chunk and decode shapes of a 1k batch (28 rows) and a 4k batch (7 rows); outputs compared."""
    from oscar.kernels import rowbatch as RB

    rows, cur = [], RB._SCORE_ELEMS
    for A, S, t in ((28, 1100, 40), (7, 4150, 40), (28, 1100, 1), (7, 4150, 1)):
        g = torch.Generator().manual_seed(A + t)
        q = torch.randn(A, 9, t, 64, generator=g).bfloat16()
        k, v = (torch.randn(A, 3, S, 64, generator=g).bfloat16().float() for _ in range(2))
        pos = torch.full((A, 1), S - t) + torch.arange(t)
        res, out = {}, {}
        for name, elems in (("old", 1 << 24), ("new", cur)):
            RB._SCORE_ELEMS = elems
            RB.rows_attention(None, q, k, v, position_ids=pos)
            c = time.process_time()
            for _ in range(reps):
                out[name] = RB.rows_attention(None, q, k, v, position_ids=pos)[0]
            res[name] = (time.process_time() - c) / reps
        RB._SCORE_ELEMS = cur
        rows.append({"rows": A, "keys": S, "queries": t, "old_ms": 1e3 * res["old"], "new_ms": 1e3 * res["new"],
                     "ratio": res["old"] / res["new"], "identical": bool(torch.equal(out["old"], out["new"]))})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def profile_niah(model, tok, arts, proto, cells=((1024, 4), (4096, 1)), task: str = "niah_single_2") -> dict:
    """Where the current needle loop's CPU time goes (one thread): prefill, cache load (quantization),
    question-chunk and decode-step attention, cache updates; the rest is the linears and Python."""
    from oscar.kernels import rowbatch as RB

    T: dict = {}

    def timed(obj, name, key):
        f = getattr(obj, name)

        def g(*a, **k):
            c = time.process_time()
            r = f(*a, **k)
            k_ = key(a) if callable(key) else key
            T[k_] = T.get(k_, 0.0) + time.process_time() - c
            return r
        setattr(obj, name, g)
        return f

    saved = [(PrefillPool, "prefill", timed(PrefillPool, "prefill", "prefill")),
             (RB.RowBatchCache, "load", timed(RB.RowBatchCache, "load", "cache_load")),
             (RB.RowLayer, "update", timed(RB.RowLayer, "update", "cache_update")),
             (RB, "rows_attention", timed(RB, "rows_attention", lambda a: "attn_question" if a[1].shape[2] > 1 else "attn_decode"))]
    src = Sources.from_text(env.heldout_text("pydoc"))
    eos = eos_ids(model, tok)
    try:
        with torch.no_grad():
            c = time.process_time()
            for L, n in cells:
                samples = [make_sample(task, L, i, tok, src, seed=0) for i in range(n)]
                new_loop(model, samples, arts, proto, eos)
            T["total"] = time.process_time() - c
    finally:
        for obj, name, f in saved:
            setattr(obj, name, f)
    T["rest"] = T["total"] - sum(v for k, v in T.items() if k not in ("total", "cache_update"))
    out = {"task": task, "cells": [list(c) for c in cells], "threads": torch.get_num_threads(), "cpu_s": T,
           "share": {k: v / T["total"] for k, v in T.items() if k != "total"}, "loadavg": os.getloadavg()}
    print(json.dumps(out), flush=True)
    return out


def _children_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def stage_workers(loaded, artifact: str, dtype: str, workers: int) -> dict:
    """The needle and perplexity stages' loops (run_niah / run_ppl) at reduced sizes: previous = in this
    process, intra-op threads by load (what `oscar run` ran: 2 on a quiet 2-core host, 1 on a busy one) vs
    current = `workers` processes of one intra-op thread. CPU seconds of this process and of the workers
    (joined children) show the work is the same; predictions and window NLLs are compared."""
    import tempfile

    from oscar.validate.niah import NiahConfig, run_niah
    from oscar.validate.ppl import PplConfig, run_ppl

    niah_kw = dict(model="smollm2-135m", artifact=artifact, tasks=["niah_single_2"], lengths=[1024, 2048], samples=4,
                   protocol="serving", dtype=dtype)  # 3 batches (1k x 4, 2k x 2, 2k x 2), all 7 methods
    ppl_kw = dict(model="smollm2-135m", artifact=artifact, methods=["bf16", "oscar-int2"], contexts=[1024],
                  tokens=4096, dtype=dtype)  # 3 configs x 4 windows
    out: dict = {"workers": workers, "niah": niah_kw, "ppl": ppl_kw}
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="oscar-bench-") as d:
        for stage, fn, cfg in (("niah", run_niah, NiahConfig), ("ppl", run_ppl, PplConfig)):
            kw = niah_kw if stage == "niah" else ppl_kw
            res = {}
            for name, w in (("previous", 1), ("current", workers)):
                torch.set_num_threads(os.cpu_count() or 1)  # the in-process path picks its threads by load
                load = os.getloadavg()
                w0, c0, k0 = time.time(), time.process_time(), _children_cpu()
                fn(cfg(out=os.path.join(d, f"{stage}-{name}"), **kw), loaded=loaded, progress=False, workers=w)
                res[name] = {"wall_s": time.time() - w0, "cpu_s": time.process_time() - c0,
                             "worker_cpu_s": _children_cpu() - k0, "loadavg_before": load, "loadavg_after": os.getloadavg()}
            lines = {n: [json.loads(x) for x in open(os.path.join(d, f"{stage}-{n}",
                                                                  "niah_samples.jsonl" if stage == "niah" else "ppl_windows.jsonl"))]
                     for n in res}
            if stage == "niah":
                key = lambda r: (r["task"], r["length"], r["index"], r["method"])  # noqa: E731
                a, b = ({key(r): r["pred"] for r in lines[n]} for n in ("previous", "current"))
                res["rows"], res["identical_predictions"] = len(a), sum(a[k] == b.get(k) for k in a)
                res["same_score"] = sum(ra["score"] == rb["score"] for ra in lines["previous"] for rb in lines["current"]
                                        if key(ra) == key(rb))
            else:
                key = lambda r: (r["method"], r["protocol"], r["context"], r["window"])  # noqa: E731
                a, b = ({key(r): r["nll"] for r in lines[n]} for n in ("previous", "current"))
                res["windows"] = len(a)
                res["max_nll_rel_diff"] = max(abs(b[k] / a[k] - 1) for k in a)
                res["identical_nll"] = sum(a[k] == b[k] for k in a)
            res["wall_ratio"] = res["previous"]["wall_s"] / res["current"]["wall_s"]
            res["cpu_work_ratio"] = (res["current"]["cpu_s"] + res["current"]["worker_cpu_s"]) / res["previous"]["cpu_s"]
            out[stage] = {**kw, **res}
            print(json.dumps({stage: res}), flush=True)
    torch.set_num_threads(threads)
    return out


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
                    help="dtype of a second, smaller comparison (NIAH 1k x 4 samples, ppl 1k windows; '' to skip; "
                         "default float32)")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads for both paths (default 1: robust on a shared machine)")
    ap.add_argument("--cells", default="1024:4,2048:2,4096:2", help="length:samples per cell (default 1024:4,2048:2,4096:2)")
    ap.add_argument("--tasks", default="niah_single_1,niah_single_2", help="tasks (default: the main job's two)")
    ap.add_argument("--ppl-context", type=int, default=4096,
                    help="perplexity window scored per config, its first quarter as the shorter window (default 4096)")
    ap.add_argument("--out", default=str(OUT), help=f"JSON written after every measured cell (default {OUT})")
    ap.add_argument("--sections", default="quant,niah,ppl",
                    help="what to measure (default quant,niah,ppl; also: profile = where the needle loop's time goes, "
                         "rows_attention, workers = the NIAH and "
                         "perplexity stage loops in this process vs on worker processes); results of other sections "
                         "already in the JSON are kept")
    ap.add_argument("--workers", type=int, default=2, help="worker processes of the `workers` section (default 2)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cells = [tuple(int(x) for x in c.split(":")) for c in a.cells.split(",")]
    model, tok, _info = env.load_model("smollm2-135m")
    fitted = load_artifact(a.artifact)
    methods = list(DEFAULT_METHODS)
    proto = PROTOCOLS["serving"]
    sections = a.sections.split(",")
    out = Path(a.out)
    res = json.loads(out.read_text()) if out.exists() else {}

    def save() -> None:
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(res, indent=1))

    run = {"host": f"{platform.node()} ({os.cpu_count()} CPUs)", "threads": a.threads, "dtype": a.dtype,
           "artifact": a.artifact, "methods": methods, "protocol": proto.name, "loadavg_start": os.getloadavg()}
    with_dtype(model, a.dtype)
    arts = [method_artifact(m, model.config, fitted) for m in methods]
    if "rows_attention" in sections:
        res["rows_attention"] = {**run, "rows": rows_attention_timing()}
        save()
    if "profile" in sections:
        res["profile"] = {**run, **profile_niah(model, tok, arts, proto)}
        save()
    if "workers" in sections:
        res["workers"] = {**run, **stage_workers((model, tok, _info), a.artifact, a.dtype, a.workers)}
        save()
    if "quant" in sections:
        res["quant"] = {**run, "rows": quant_timing(model, fitted, methods)}
        save()
    if "niah" in sections:
        def part(rows):
            res["niah"] = {**run, "cells": rows, "projection": project(rows), "loadavg_now": os.getloadavg()}
            save()

        rows = niah_cells(model, tok, arts, cells, a.tasks.split(","), proto, save=part)
        if a.check_dtype:
            with_dtype(model, a.check_dtype)

            def part_check(rows):
                res["niah"]["check"] = {"dtype": a.check_dtype, "cells": rows}
                save()

            niah_cells(model, tok, arts, [(1024, 4)], ["niah_single_2"], proto, save=part_check)
            with_dtype(model, a.dtype)
    if "ppl" in sections:
        res["ppl"] = {**run, **ppl_windows(model, tok, fitted, context=a.ppl_context, prefix=a.ppl_context // 4)}
        if a.check_dtype:
            with_dtype(model, a.check_dtype)
            res["ppl"]["check"] = {"dtype": a.check_dtype, **ppl_windows(model, tok, fitted, context=1024, prefix=256)}
            with_dtype(model, a.dtype)
        res["ppl"]["loadavg_end"] = os.getloadavg()
    save()
    print(json.dumps({k: v.get("projection", v.get("ratio"))  for k, v in res.items() if isinstance(v, dict)}, indent=1))


if __name__ == "__main__":
    main()
