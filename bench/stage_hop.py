"""Stage hop: the activation bytes one pipeline stage hands the next, and the latency one more stage adds.

(a) Bytes per token crossing a stage boundary, from each model's config: hidden_size x dtype bytes (bfloat16,
float32); a decode step sends one token, a prefill chunk T tokens; `oscar plan`'s boundary adds the position ids
and the padding mask (16 B per token).

(b) The latency a hop adds, on a local Ray cluster bound to 127.0.0.1 (this host's CPUs, no GPU), through the
mechanism cluster/pipeline.py uses: the driver passes stage A's ObjectRef (the dict its `forward` returns: hidden
states (1, T, H) + mask) as the argument of stage B's `forward`; Ray resolves it in B (below 100 KiB the value is
inlined through the driver, above it goes through the object store). The actors compute nothing: A returns a
tensor made once, B reads one element and returns a small dict, as the last stage does.

    one stage:    driver -> A.last(small)                           -> driver
    two stages:   driver -> A.forward(small) -> B.last(A's output)  -> driver
    three stages: driver -> A.forward -> B.forward -> C.last        -> driver

hop = median(two stages - one stage), the rounds interleaved and paired; the three-stage chain checks that a
second hop adds the same again. Each figure is the median of `--repeats` rounds (`--repeats-large` for tensors
above 1 MiB), all measured in one run on one host.

    python bench/stage_hop.py --out bench/results/stage_hop.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from oscar.cluster.localray import LocalHead
from oscar.cluster.plan import activation_bytes, load_model_config
from oscar.host import describe, info

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "results", "stage_hop.json")
MODELS = ["tiny-llama", "tiny-qwen3", "tiny-glm4-moe", "smollm2-135m", "qwen2.5-0.5b", "glm-4.7"]
# Published hidden sizes, used only where a model's config is not readable here (its GGUF not installed).
PUBLISHED_HIDDEN = {"smollm2-135m": 576, "qwen2.5-0.5b": 896, "glm-4.7": 5120}
HIDDEN = [576, 896, 5120]       # SmolLM2-135M, Qwen2.5-0.5B, GLM-4.7
TOKENS = [1, 512, 4096]         # a decode step, prefill chunks
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LARGE = 1 << 20


class Stage:
    """A stage that computes nothing: what it passes on is made once (`load`), so a round is Ray's hop alone."""

    def __init__(self):
        torch.set_num_threads(1)
        self.out = None

    def load(self, t: int, h: int, dtype: str) -> int:
        hidden = torch.randn(1, t, h).to(DTYPES[dtype])
        self.out = {"block": 0, "mb": 0, "hidden": hidden, "mask": torch.ones(1, t, dtype=torch.int64)}
        return hidden.numel() * hidden.element_size()

    def forward(self, payload: dict) -> dict:
        payload["hidden"][0, -1, 0].item()  # the input is deserialized and readable
        return self.out

    def last(self, payload: dict) -> dict:
        return {"block": 0, "mb": 0, "value": float(payload["hidden"][0, -1, 0])}


def bytes_per_token() -> list[dict]:
    """(a): boundary bytes per token of each model, from its config."""
    rows = []
    for name in MODELS:
        try:
            c = load_model_config(name)
            hidden, source = c.get_text_config().hidden_size, "config"
            plan16 = activation_bytes(c, micro_batch=1, seq_len=1, act_bytes=2)["boundary"]
        except Exception as e:  # noqa: BLE001 - an installable model whose GGUF is not here
            hidden, source, plan16 = PUBLISHED_HIDDEN[name], f"published (config not readable here: {e})", None
        row = {"model": name, "hidden_size": hidden, "source": source}
        for dt, nb in (("bfloat16", 2), ("float32", 4)):
            row[f"{dt}_bytes_per_token"] = hidden * nb
            row[f"{dt}_bytes_decode"] = hidden * nb
            row.update({f"{dt}_bytes_prefill_{t}": t * hidden * nb for t in TOKENS if t > 1})
        row["plan_boundary_bytes_per_token_bf16"] = plan16 if plan16 is not None else hidden * 2 + 16
        rows.append(row)
    return rows


def rounds(ray, a, b, c, n: int) -> dict:
    """n interleaved rounds of the one-, two- and three-stage chains (seconds each)."""
    small = {"hidden": torch.zeros(1, 1, 1)}
    chains = {
        "one": lambda: a.last.remote(small),
        "two": lambda: b.last.remote(a.forward.remote(small)),
        "three": lambda: c.last.remote(b.forward.remote(a.forward.remote(small))),
    }
    for f in chains.values():  # warm-up: first calls, object store pages
        for _ in range(3):
            ray.get(f())
    t = {k: [] for k in chains}
    for _ in range(n):
        for k, f in chains.items():
            t0 = time.perf_counter()
            ray.get(f())
            t[k].append(time.perf_counter() - t0)
    return t


def measure(ray, actors, h: int, t: int, dtype: str, repeats: int, repeats_large: int) -> dict:
    nbytes = ray.get([s.load.remote(t, h, dtype) for s in actors])[0]
    n = repeats if nbytes <= LARGE else repeats_large
    r = rounds(ray, *actors, n)
    med = {k: statistics.median(v) for k, v in r.items()}
    hop = statistics.median([x - y for x, y in zip(r["two"], r["one"])])
    hop2 = statistics.median([(x - y) / 2 for x, y in zip(r["three"], r["one"])])
    return {"hidden": h, "tokens": t, "dtype": dtype, "bytes": nbytes, "repeats": n,
            "round_trip_s": med, "hop_s": hop, "hop_s_from_three_stages": hop2,
            "bytes_per_s": nbytes / hop if hop > 0 and t > 1 else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=200, help="rounds per case up to 1 MiB (median)")
    ap.add_argument("--repeats-large", type=int, default=30, help="rounds per case above 1 MiB (median)")
    ap.add_argument("--out", default=OUT, help="result JSON (default bench/results/stage_hop.json)")
    args = ap.parse_args()

    per_token = bytes_per_token()
    head = LocalHead(num_cpus=4, object_store_mb=2048)
    head.use()
    head.start()
    started = time.time()
    cases = []
    try:
        # late: ray reads its cluster mode when imported; head.use() sets LOOPBACK_ENV first (cluster/localray.py)
        import ray

        ray.init(address=head.address, log_to_driver=False)
        try:
            actor = ray.remote(num_cpus=1)(Stage)
            actors = [actor.remote() for _ in range(3)]
            for dtype in DTYPES:
                for h in HIDDEN:
                    for t in TOKENS:
                        r = measure(ray, actors, h, t, dtype, args.repeats, args.repeats_large)
                        print(json.dumps({k: r[k] for k in ("hidden", "tokens", "dtype", "bytes", "hop_s",
                                                             "hop_s_from_three_stages")}), flush=True)
                        cases.append(r)
        finally:
            ray.shutdown()
    finally:
        head.stop()
    decode = [c for c in cases if c["tokens"] == 1]
    out = {
        "what": "activation bytes between pipeline stages per token (from configs), and the latency one more stage "
                "adds on a local Ray cluster (ObjectRef chaining as cluster/pipeline.py does; no compute)",
        "mechanism": "driver -> A.forward -> B.last with A's ObjectRef as B's argument; hop = median over paired "
                     "rounds of (two-stage round trip - one-stage round trip); loopback only, one node, CPU tensors",
        "host": describe(), "host_info": info(), "load_avg_end": os.getloadavg(),
        "ray": ray.__version__, "torch": torch.__version__,
        "bytes_per_token": per_token,
        "cases": cases,
        "decode_hop_s_median": statistics.median(c["hop_s"] for c in decode),
        "decode_hop_s_max": max(c["hop_s"] for c in decode),
        "total_s": time.time() - started,
        "command": "python bench/stage_hop.py " + " ".join(sys.argv[1:]),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
