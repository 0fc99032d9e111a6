"""How compute-bound work scales over this host's CPUs: one process vs N concurrent processes, one thread each.

A bf16 2048x2048 matmul loop (the shape class of a prefill's linears) run alone, then in N processes at once;
the ratio of total throughput tells whether the CPUs are independent cores (~N x) or share execution units
(SMT siblings, a throttled VM: ~1 x). It explains why spreading validation over worker processes bought little
on the 2-vCPU host (docs/decisions/0059-a-native-causal-attention-for-cpu-prefills.md, "A native causal attention for CPU").

    python bench/cpu_scaling.py [--procs 2] [--out bench/results/cpu_scaling.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
from pathlib import Path


def _gflops(reps: int, q=None) -> float:
    import torch

    torch.set_num_threads(1)
    a = torch.randn(2048, 2048, dtype=torch.bfloat16)
    b = torch.randn(2048, 2048, dtype=torch.bfloat16)
    a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    g = reps * 2 * 2048 ** 3 / (time.perf_counter() - t) / 1e9
    if q is not None:
        q.put(g)
    return g


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=os.cpu_count() or 2, help="concurrent processes (default: CPU count)")
    ap.add_argument("--reps", type=int, default=40, help="matmuls per process (default 40)")
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("results") / "cpu_scaling.json",
                    help="JSON output (default bench/results/cpu_scaling.json)")
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    alone = []
    for _ in range(3):
        q = ctx.Queue()
        p = ctx.Process(target=_gflops, args=(a.reps, q))
        p.start()
        alone.append(q.get())
        p.join()
    q = ctx.Queue()
    ps = [ctx.Process(target=_gflops, args=(a.reps, q)) for _ in range(a.procs)]
    for p in ps:
        p.start()
    together = [q.get() for _ in ps]
    for p in ps:
        p.join()
    single = max(alone)
    res = {"command": f"python bench/cpu_scaling.py --procs {a.procs} --reps {a.reps}", "cpus": os.cpu_count(),
           "loadavg_start": os.getloadavg(), "alone_gflops": alone, "together_gflops": together,
           "scaling": sum(together) / single, "ideal_scaling": a.procs}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
