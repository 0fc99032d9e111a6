"""Projected stage times of `oscar run --full` (the evidence sizes), from a few measured samples and windows.

Per dtype (float32, bfloat16): one niah_single_2 sample at 1k, 2k, 4k (no prefix reuse: the
expensive task) timed as the NIAH loop runs it (exact prefill with the default threads, the
6-method `MethodBatchCache`, batched greedy decode with `decode_threads()`), then the perplexity
stage on 3 of the 6 methods (bf16 + 2 INT2 methods = 5 of the 11 method x protocol configs).

    python bench/run_projection.py [--artifact A] [--dtypes float32,bfloat16]

Projection (written with the raw figures to bench/results/run_projection.json):
NIAH = samples x (single_2 triple + single_1 triple), single_1's prefill taken as
`--single1-prefill` (0.55: measured prefix reuse of noise haystacks) of single_2's;
ppl = measured x 11 / 5; plus calibrate + fit + attention from the committed example's run.json.
The load average is recorded: figures are only meaningful on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from oscar.stats.artifact import load_artifact
from oscar.defaults import DEFAULT_METHODS
from oscar.validate import env
from oscar.scoring.dtype import with_dtype
from oscar.kernels.simulate import MethodBatchCache
from oscar.validate.methods import method_artifact
from oscar.scoring.protocols import PROTOCOLS
from oscar.validate.niah import eos_ids, greedy
from oscar.scoring.prefill import PrefillPool, decode_threads
from oscar.validate.ppl import PplConfig, run_ppl
from oscar.validate.ruler import Sources, make_sample

OUT = Path(__file__).with_name("results") / "run_projection.json"
EXAMPLE = Path(__file__).parents[1] / "reports" / "examples" / "smollm2" / "run.json"


def niah_times(model, tok, arts, lengths) -> list[dict]:
    src = Sources.from_text(env.heldout_text("pydoc"))
    eos = eos_ids(model, tok)
    rows = []
    for L in lengths:
        s = make_sample("niah_single_2", L, 0, tok, src, seed=0)
        pool = PrefillPool(model)  # empty: no reuse
        load = os.getloadavg()[0]
        t0 = time.time()
        exact = pool.prefill(s.context_ids)
        t1 = time.time()
        cache = MethodBatchCache.from_prefill(arts, PROTOCOLS["serving"], exact, capacity=s.total_tokens)
        t2 = time.time()
        th = decode_threads()
        greedy(model, cache, s.question_ids, s.max_new_tokens, eos, rows=len(arts), threads=th)
        t3 = time.time()
        rows.append({"length": L, "prompt_tokens": s.prompt_tokens, "prefill_s": t1 - t0, "cache_load_s": t2 - t1,
                     "decode_s": t3 - t2, "decode_threads": th, "loadavg": load})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", default="reports/examples/smollm2/artifact.safetensors")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--single1-prefill", type=float, default=0.55)
    a = ap.parse_args()
    fixed = {k: v for k, v in json.loads(EXAMPLE.read_text())["stage_seconds"].items() if k in ("calibrate", "fit", "attention")}
    res = {"host": f"{os.uname().nodename} ({os.cpu_count()} CPUs)", "threads": torch.get_num_threads(),
           "samples": a.samples, "fixed_stages_s": fixed, "dtypes": {}}
    for dt in a.dtypes.split(","):
        model, tok, _ = env.load_model("smollm2-135m")
        with_dtype(model, dt)
        fitted = load_artifact(a.artifact)
        arts = [method_artifact(m, model.config, fitted) for m in DEFAULT_METHODS]
        niah = niah_times(model, tok, arts, [1024, 2048, 4096])
        out = tempfile.mkdtemp(prefix="oscar-proj-")
        try:
            t = time.time()
            run_ppl(PplConfig(out=out, artifact=a.artifact, methods=["bf16", "oscar-int2", "kivi2"], tokens=4096, dtype=dt),
                    loaded=(model, tok, None), progress=False)
            ppl5 = time.time() - t
        finally:
            shutil.rmtree(out, ignore_errors=True)
        s2 = sum(r["prefill_s"] + r["cache_load_s"] + r["decode_s"] for r in niah)
        s1 = s2 - (1 - a.single1_prefill) * sum(r["prefill_s"] for r in niah)
        proj = {"niah": a.samples * (s1 + s2), "ppl": ppl5 * 11 / 5, **fixed}
        res["dtypes"][dt] = {"niah_samples": niah, "ppl_5_configs_s": ppl5, "projected_stage_s": proj,
                             "projected_total_min": sum(proj.values()) / 60, "loadavg_end": os.getloadavg()[0]}
        print(json.dumps(res["dtypes"][dt]), flush=True)
        del model
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
