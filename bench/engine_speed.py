"""The two validation engines on the same inputs: CPU time and agreement (`--engine simulate` vs `cache`).

Same process, same model object (SmolLM2-135M, float32), same artifacts, same windows and samples:

- perplexity: one held-out window of `--context` tokens per (method, protocol), scored by the simulator
  (`window_attention.simulated` + `window_nll`) and through OscarCache (`engine.window_nll`: prefill, then the
  last 16 tokens one decode step each), under the named protocol (strict, serving) and under the
  simulator protocol matched to the cache (`engine.simulator_protocol`: recent R - 1);
- needles: `--samples` niah_single_1 samples at `--length`, every method: the simulator's batched rows
  (`niah.decode_batch`) vs the cache engine (`engine.niah_answers`), the named protocol; and the cache
  engine with the simulator's exact haystack prefill (`prefill="exact"`), which separates the prefill
  semantics from the rest.

Artifacts: a small real calibration store of the held-out-disjoint calibration split, fitted without
clip search, one artifact per INT2 cache format (the methods' formats: see `artifacts` below).

    python bench/engine_speed.py [--context 1024] [--length 1024] [--samples 2] [--threads 1]

Writes bench/results/engine_speed.json: CPU seconds of both engines per stage, their ratio (cache /
simulate), the NLL relative differences and the needle predictions agreement.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

OUT = Path(__file__).with_name("results") / "engine_speed.json"


def artifacts(model, store: str) -> dict:
    """One artifact per INT2 method's cache format, fitted on `store` without clip search (the formats the
    engines must agree on; clip values do not change the code path)."""
    from oscar.stats.fit import FitConfig, fit
    from oscar.validate.methods import method_artifact

    fc = lambda **kw: fit(store, FitConfig(progress=False, clip=False, **kw))  # noqa: E731
    scaled = fc(variant="scaled")
    D = scaled.head_dim
    arts = {m: method_artifact(m, model.config, None) for m in ("naive-int2", "kivi2", "hadamard-int2")}
    arts["oscar-int2"] = scaled
    arts["oscar-ref-int2"] = fc(variant="oscar-ref")
    arts["oscar-kc-int2"] = fc(variant="scaled", quant=replace(scaled.quant, key_axis="channel", group_size=D))
    arts["kivi2-clip"] = fc(variant="identity", quant=replace(scaled.quant, key_axis="channel", group_size=64))
    arts["hadamard-clip-int2"] = fc(variant="hadamard-centered", quant=replace(scaled.quant, group_size=None))
    return arts


def small_store(path: str, model: str = "smollm2-135m") -> str:
    from oscar.pipeline.calibrate import CalibConfig, calibrate

    if not os.path.isdir(path):
        calibrate(CalibConfig(model=model, corpus="pydoc", store=path, seq_len=320, sink=16, seqs_per_block=1,
                              tokens=2 * 320, reservoir=64, seed=0), progress=False)
    return path


def cpu() -> float:
    return time.process_time()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=1024, help="perplexity window (tokens)")
    ap.add_argument("--length", type=int, default=1024, help="needle haystack length (tokens)")
    ap.add_argument("--samples", type=int, default=2, help="needle samples")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--out", default=str(OUT), help="result JSON")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    from oscar.scoring import engine

    from oscar.validate import env
    from oscar.scoring.protocols import PROTOCOLS
    from oscar.validate.niah import decode_batch, eos_ids
    from oscar.scoring.prefill import PrefillPool
    from oscar.validate.ppl import heldout_ids
    from oscar.scoring.nll import window_nll
    from oscar.kernels.window_attention import simulated
    from oscar.validate.ruler import Sources, make_sample, score_one

    model, tok, _ = env.load_model("smollm2-135m")
    with tempfile.TemporaryDirectory() as d:
        arts = artifacts(model, small_store(os.path.join(d, "s.zarr")))
    ids = torch.tensor([heldout_ids(tok, "pydoc", a.context)])
    res: dict = {"host": f"{platform.node()} ({os.cpu_count()} CPUs)", "load_avg": os.getloadavg()[0],
                 "threads": a.threads, "context": a.context, "length": a.length, "samples": a.samples, "ppl": {}, "niah": {}}
    t_sim = t_cache = 0.0
    for pname in ("strict", "serving"):
        p = PROTOCOLS[pname]
        for m, art in arts.items():
            t0 = cpu()
            with simulated(model, art, p):
                s_named = window_nll(model, ids)[0]
            t1 = cpu()
            c = engine.window_nll(model, m, art, p, ids)[0]
            t2 = cpu()
            row = {"sim": s_named, "cache": c, "rel_diff_named": abs(c - s_named) / s_named,
                   "sim_cpu_s": t1 - t0, "cache_cpu_s": t2 - t1}
            if p.recent >= 1:
                with simulated(model, art, engine.simulator_protocol(p)):
                    s_m = window_nll(model, ids)[0]
                row.update(sim_matched=s_m, rel_diff_matched=abs(c - s_m) / s_m)
            t_sim += t1 - t0
            t_cache += t2 - t1
            res["ppl"][f"{m} {pname}"] = row
            print(m, pname, {k: round(v, 6) for k, v in row.items()}, flush=True)
    res["ppl_cpu_s"] = {"simulate": t_sim, "cache": t_cache, "ratio_cache_over_simulate": t_cache / t_sim}

    src = Sources.from_text(env.heldout_text("pydoc"))
    samples = [make_sample("niah_single_1", a.length, i, tok, src) for i in range(a.samples)]
    eos = eos_ids(model, tok)
    names = list(arts)
    for pname in ("serving", "strict"):
        p = PROTOCOLS[pname]
        t0 = cpu()
        sim = decode_batch(model, samples, [[arts[m] for m in names]] * len(samples), p, PrefillPool(model), eos)
        t1 = cpu()
        cache = engine.niah_answers(model, samples, [[arts[m] for m in names]] * len(samples), [names] * len(samples),
                                    p, eos)
        t2 = cpu()
        exact = engine.niah_answers(model, samples, [[arts[m] for m in names]] * len(samples), [names] * len(samples),
                                    p, eos, prefill="exact")
        rows = [(i, m) for i, s in enumerate(samples) for m in names]
        score = lambda s, x: score_one(tok.decode(x, skip_special_tokens=True), s.answers, s.metric)  # noqa: E731
        ss = [(samples[i], x, y, z) for (i, _), x, y, z in zip(rows, sim, cache, exact)]
        res["niah"][pname] = {
            "sim_cpu_s": t1 - t0, "cache_cpu_s": t2 - t1, "ratio_cache_over_simulate": (t2 - t1) / (t1 - t0),
            "rows": len(rows), "same_prediction": sum(x == y for _, x, y, _ in ss),
            "same_score": sum(score(s, x) == score(s, y) for s, x, y, _ in ss),
            "score_sim": sum(score(s, x) for s, x, _, _ in ss), "score_cache": sum(score(s, y) for s, _, y, _ in ss),
            "exact_prefill_same_prediction": sum(x == z for _, x, _, z in ss),
            "exact_prefill_same_score": sum(score(s, x) == score(s, z) for s, x, _, z in ss),
            "predictions": [f"{m} #{i}: sim {tok.decode(x)!r} cache {tok.decode(y)!r} cache-exact-prefill {tok.decode(z)!r}"
                            for (i, m), (_, x, y, z) in zip(rows, ss)]}
        print(pname, res["niah"][pname], flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
