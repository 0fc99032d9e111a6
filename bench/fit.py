"""Fit speed and memory: `python bench/fit.py [--case smollm2|glm|all]` -> bench/results/fit.json.

Cases (synthetic stores in the documented format, written under --tmp and deleted after):
- smollm2: 30 layers x 3 KV heads x D 64, 8 blocks, reservoir 256 (SmolLM2-135M shapes; the
  real store is used instead when --store is given). Target: fit < 10 s.
- glm: 92 layers x 8 KV heads x D 128, 16 blocks, reservoir 128, only the arrays fit reads
  (GLM-4.7 shapes; several GB on disk). Target: peak RSS <= 2 GB (streaming layer by layer).

Each measurement runs in a fresh child process that reports its own peak RSS. The baseline in
the same run is a read-only pass over every array the fit reads (the I/O floor).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

CHILD = r"""
import json, os, resource, sys, time
store, mode, variant = sys.argv[1], sys.argv[2], sys.argv[3]
t0 = time.perf_counter()
if mode == "read":
    import numpy as np
    from oscar.stats.reduce import open_store
    v = open_store(store)
    names = ["q_gram", "o_gram", "q_count", "kv_count", "q_sum", "q_m3", "q_m4", "o_sum", "o_m3", "o_m4",
             "q_res", "k_res", "v_res", "res_count"]
    nbytes = 0
    for l in range(v.num_layers):
        a = v.layer(l, names)
        nbytes += sum(x.nbytes for x in a.values())
        del a
    out = {"bytes_read": nbytes}
else:
    from oscar.stats.fit import FitConfig, fit
    art = fit(store, FitConfig(variant=variant, progress=False, threads=int(os.environ.get("OSCAR_THREADS", "1"))))
    out = {"fallbacks": len(art.meta["fallbacks"]), "layers": art.num_layers}
out["seconds"] = time.perf_counter() - t0
ru = resource.getrusage(resource.RUSAGE_SELF)
# VmHWM: this process's own high-water mark (ru_maxrss would carry the parent's over fork+exec)
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")]
out["peak_rss_mb"] = int(hwm[0].split()[1]) / 1024 if hwm else ru.ru_maxrss / 1024
out["cpu_s"] = ru.ru_utime + ru.ru_stime  # includes interpreter start-up and imports
print(json.dumps(out))
"""


def child(store: str, mode: str, variant: str = "oscar") -> dict:
    env = dict(os.environ, OPENBLAS_NUM_THREADS=os.environ.get("OSCAR_THREADS", "1"),
               OMP_NUM_THREADS=os.environ.get("OSCAR_THREADS", "1"))
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", CHILD, store, mode, variant], capture_output=True, text=True, env=env)
    if r.returncode:
        raise RuntimeError(r.stderr[-3000:])
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["wall_with_startup_s"] = time.perf_counter() - t0
    return out


def run_case(name: str, spec_kw: dict, tmp: str, store: str | None, target: dict) -> dict:
    made = store is None
    res: dict = {"case": name, "synthetic": made}
    if made:  # generated in a child so this process stays small
        store = os.path.join(tmp, f"bench_fit_{name}.zarr")
        t0 = time.perf_counter()
        # the generator is a test helper (tests/helpers/synthetic_store.py), loaded by path
        code = ("import importlib.util, json, sys; s = importlib.util.spec_from_file_location('synthetic_store', "
                "sys.argv[3]); m = sys.modules['synthetic_store'] = importlib.util.module_from_spec(s); "
                "s.loader.exec_module(m); "
                "m.write_synthetic_store(sys.argv[1], m.SynthSpec(**json.loads(sys.argv[2])), progress=True)")
        synth = os.path.join(HERE, "..", "tests", "helpers", "synthetic_store.py")
        subprocess.run([sys.executable, "-c", code, store, json.dumps(spec_kw), synth], check=True,
                       env=dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1"))
        res["generate_s"] = round(time.perf_counter() - t0, 2)
        res["store_spec"] = spec_kw
        res["store_bytes"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(store) for f in fs)
    try:
        res["read_baseline"] = child(store, "read")
        res["fit_oscar"] = child(store, "fit", "oscar")
    finally:
        if made:
            shutil.rmtree(store, ignore_errors=True)
    f, b = res["fit_oscar"], res["read_baseline"]
    res["fit_over_read"] = round(f["seconds"] / max(b["seconds"], 1e-9), 2)
    res["target"] = target
    if "seconds" in target:
        res["time_target_met"] = f["seconds"] < target["seconds"]
    if "peak_rss_mb" in target:
        res["memory_target_met"] = f["peak_rss_mb"] <= target["peak_rss_mb"]
    print(json.dumps(res, indent=1), flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="all", choices=("smollm2", "glm", "all"))
    ap.add_argument("--tmp", default="/tmp")
    ap.add_argument("--store", default=None, help="a real SmolLM2 store to use for the smollm2 case")
    args = ap.parse_args()
    out_path = os.path.join(HERE, "results", "fit.json")
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    results = json.load(open(out_path)) if os.path.exists(out_path) else {}
    results["env"] = {"threads": int(os.environ.get("OSCAR_THREADS", "1")), "cpus": os.cpu_count(),
                      "loadavg_at_start": os.getloadavg()}
    if args.case in ("smollm2", "all"):
        results["smollm2"] = run_case(
            "smollm2", dict(num_layers=30, num_kv_heads=3, num_q_heads=9, head_dim=64, num_blocks=8, rows=256,
                            reservoir=256, rank=12, seed=1, model_name="smollm2-135m-shaped"),
            args.tmp, args.store, {"seconds": 10.0})
    if args.case in ("glm", "all"):
        results["glm"] = run_case(
            "glm", dict(num_layers=92, num_kv_heads=8, num_q_heads=96, head_dim=128, num_blocks=16, rows=128,
                        reservoir=128, rank=24, decay=0.9, seed=2, only_fit_arrays=True, model_name="glm-4.7-shaped"),
            args.tmp, None, {"peak_rss_mb": 2048.0})
    results["env"]["loadavg_at_end"] = os.getloadavg()
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)
    print(out_path)


if __name__ == "__main__":
    main()
