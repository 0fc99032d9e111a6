"""Loading SmolLM2 from its GGUF (transformers, every time) vs from the converted safetensors cache.

Also records the pydoc corpus split in SmolLM2 tokens. Writes bench/results/model_cache.json.
Run: python bench/model_cache.py   (uses a fresh temporary $OSCAR_CACHE unless --cache is given)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", default=None, help="cache root (default: a fresh temporary directory)")
    args = ap.parse_args()
    tmp = None if args.cache else tempfile.mkdtemp(prefix="oscar-bench-cache-")
    os.environ["OSCAR_CACHE"] = args.cache or tmp
    try:
        run()
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def run() -> None:

    import torch
    from transformers import AutoModelForCausalLM

    from oscar.pipeline import corpus as C
    from oscar.pipeline import models as M

    gguf = M.smollm2_gguf_path()
    t = time.perf_counter()
    ref = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=M.SMOLLM2_GGUF, dtype=torch.float32)
    gguf_load = time.perf_counter() - t

    t = time.perf_counter()
    d = M.resolve_model("smollm2-135m")
    first_convert = time.perf_counter() - t

    t = time.perf_counter()
    model, tok, info = M.load_model("smollm2-135m")
    cached_load = time.perf_counter() - t

    ids = torch.arange(100, 356)[None]  # (1, 256)
    with torch.no_grad():
        same = torch.equal(ref(ids).logits, model(ids).logits)

    c = C.load_corpus("pydoc")
    n_cal = len(C._token_stream(tok, c.calibration))
    n_ho = len(C._token_stream(tok, c.heldout))
    out = {
        "model": info.name, "cache_dir": d,
        "gguf_load_s": round(gguf_load, 3),
        "first_convert_s": round(first_convert, 3),
        "cached_load_s": round(cached_load, 3),
        "speedup_cached_vs_gguf": round(gguf_load / cached_load, 2),
        "logits_bit_identical": same,
        "num_shards": len(set(json.load(open(os.path.join(d, M.INDEX)))["weight_map"].values())),
        "corpus": {**c.to_dict(), "tokens": {"calibration": n_cal, "heldout": n_ho,
                                             "heldout_share": round(n_ho / (n_cal + n_ho), 4)}},
        "threads": torch.get_num_threads(),
    }
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "model_cache.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
