"""Each native CPU path against the torch ops it replaces, on this host, in one process; and the GEMM dtypes.

Sections (the two sides of each ratio alternate rep by rep, so they see the same machine):

- attention: causal attention (kernels/cpu_attention.py, `_flash_cpu.c`) against torch's SDPA, SmolLM2's
  heads (9 query / 3 KV, head_dim 64), float32 and bfloat16 inputs, 1k and 4k tokens;
- moments:   one sequence's Gram + moments and value target (pipeline/native.py, `_moments.c`) against the
  capture's torch ops for the same sums, SmolLM2's 24 heads at 1k and 4k rows;
- gemm:      torch's float32 and bfloat16 matmul (the model's compute dtype: oscar/host.py chooses bfloat16
  only where the CPU multiplies it natively).

One thread (the per-core speed each host choice compares). The JSON keeps one record per host and build
(`hosts`, keyed "CPU / build ISA"): a run replaces its own host's record and keeps the others, so the figures of
every kind of host stay side by side in one file.

    python bench/native_paths.py [--out bench/results/native_paths.json] [--reps 5]
    OSCAR_NATIVE_ISA=avx2 python bench/native_paths.py --out ...   # an AVX-512 host running the AVX2 build
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from oscar import host
from oscar.kernels import cpu_attention as CA
from oscar import native_build
from oscar.pipeline import native

OUT = Path(__file__).with_name("results") / "native_paths.json"


def _pair(a, b, reps: int) -> dict:
    """Median seconds of a and b, alternating, after one warm-up each; ratio = torch / native per rep."""
    a(), b()
    ta, tb = [], []
    for _ in range(reps):
        for fn, t in ((a, ta), (b, tb)):
            s = time.perf_counter()
            fn()
            t.append(time.perf_counter() - s)
    ratios = [y / x for x, y in zip(ta, tb)]
    return {"native_s": statistics.median(ta), "torch_s": statistics.median(tb), "speedup": statistics.median(ratios),
            "speedup_min": min(ratios), "speedup_max": max(ratios)}


def attention(reps: int) -> list[dict]:
    rows, g = [], torch.Generator().manual_seed(0)
    for dt in (torch.float32, torch.bfloat16):
        for T in (1024, 4096):
            q = torch.randn(1, 9, T, 64, generator=g).to(dt)                          # (B, Hq, T, D)
            k, v = (torch.randn(1, 3, T, 64, generator=g).to(dt) for _ in range(2))    # (B, Hkv, T, D)
            K, V = k.repeat_interleave(3, 1), v.repeat_interleave(3, 1)               # what transformers hands SDPA
            r = _pair(lambda: CA.causal_attention(q, k, v, threads=1),
                      lambda: F.scaled_dot_product_attention(q, K, V, is_causal=True), reps if T <= 1024 else max(2, reps // 2))
            r.update(path="attention", dtype=str(dt).split(".")[-1], tokens=T,
                     native_gflops=4 * 9 * 64 * T * (T + 1) / 2 / r["native_s"] / 1e9)
            rows.append(r)
            print(json.dumps(r), flush=True)
    return rows


def moments(reps: int) -> list[dict]:
    rows = []
    for T in (1024, 4096):
        nat, tor = native._probe(rows=T)
        r = _pair(nat, tor, reps)
        r.update(path="moments", rows=T, heads=24, head_dim=64)
        rows.append(r)
        print(json.dumps(r), flush=True)
    return rows


def gemm(reps: int) -> list[dict]:
    rows, n = [], 1024
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, 576, generator=g), torch.randn(576, 1536, generator=g)     # SmolLM2's MLP up-projection
    ab, bb = a.bfloat16(), b.bfloat16()
    r = _pair(lambda: a @ b, lambda: ab @ bb, reps)  # "native" = float32 here, "torch" = bfloat16
    fl = 2 * n * 576 * 1536
    rows.append({"path": "gemm", "shape": [n, 576, 1536], "float32_s": r["native_s"], "bfloat16_s": r["torch_s"],
                 "float32_gflops": fl / r["native_s"] / 1e9, "bfloat16_gflops": fl / r["torch_s"] / 1e9,
                 "bfloat16_slowdown": r["speedup"]})
    print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    assert CA.available() and native.available(), f"native kernels unavailable: {CA.WHY_NOT or native.WHY_NOT}"
    res = {"host": host.describe(), "host_info": host.info(), "threads": 1,
           "isa_build": os.environ.get("OSCAR_NATIVE_ISA", "native"),
           "emulated": os.environ.get("OSCAR_NATIVE_ISA", "native") != "native" and "avx512f" in host.cpu_flags(),
           "auto_dtype_cpu": host.compute_dtype("auto", "cpu"),
           "attention": attention(a.reps), "moments": moments(a.reps), "gemm": gemm(a.reps)}
    # what each product path chooses here (measured once per machine and build: oscar/native_build.measured_choice)
    os.environ.pop("OSCAR_NATIVE", None)
    res["choices"] = {"moments": native.chosen(), "flash_cpu": CA.chosen(), "flash_cpu_bf16": CA.chosen(torch.bfloat16),
                      "records": native_build.CHOICES}
    out = Path(a.out)
    hosts = _hosts(out)
    hosts[f"{res['host']} / build {res['isa_build']}"] = res
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"hosts": hosts}, indent=1) + "\n")
    print(f"wrote {a.out}: {res['host']} ({len(hosts)} host records)")


def _hosts(path: Path) -> dict:
    """The host records already in `path` (a single-host file of the older layout becomes one record)."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if "hosts" in old:
        return old["hosts"]
    return {f"{old['host']} / build {old.get('isa_build', 'native')}": old}


if __name__ == "__main__":
    main()
