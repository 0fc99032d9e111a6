"""CPU prefill cost of OscarCache (decode-semantics torch path) vs DynamicCache + SDPA, same run.

    python bench/prefill.py [--tokens 2048] [--chunk 1024] [--threads 1]

Writes bench/results/prefill_cpu.json: seconds for each and the ratio. The OscarCache
path is correctness-first (float32, scores over the whole context plus a mixed band);
this measures what that costs when a validation run prefills a haystack on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "prefill_cpu.json"))
    args = ap.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(args.threads)
    from transformers import DynamicCache

    from oscar.kernels.cache import OscarCache
    from oscar.kernels.generation import prefill
    from oscar.pipeline.models import load_model
    from oscar.stats.artifact import identity_artifact

    m = load_model(args.model)[0]
    ids = torch.randint(100, 20000, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    res = {"model": args.model, "tokens": args.tokens, "chunk": args.chunk, "threads": args.threads,
           "load_average": os.getloadavg()}
    t = time.perf_counter()
    prefill(m, DynamicCache(config=m.config), ids, chunk=args.chunk)
    res["dynamic_sdpa_s"] = time.perf_counter() - t
    cache = OscarCache.from_artifact(m, identity_artifact(m.config))
    t = time.perf_counter()
    prefill(m, cache, ids, chunk=args.chunk)
    res["oscar_int2_s"] = time.perf_counter() - t
    res["ratio_oscar_vs_dynamic"] = res["oscar_int2_s"] / res["dynamic_sdpa_s"]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
