"""The main job's wall time on this host against its 15-minute goal, stage by stage.

`oscar run` on the embedded defaults (or `--full`) in a fresh run directory, in a child process.

--as-avx2 runs the job as an AVX2-only host runs it: torch, oneDNN and MKL held to AVX2, the native kernels built
without AVX-512 (in a cache directory of their own, `as-avx2` under the product's, so their verdicts against torch
are measured under the same restriction) and no bfloat16 units (float32 compute). The job's run.json then names
the host "run as AVX2 only (emulated)".

Each record also keeps a one-thread float32 GEMM's speed under the run's environment, measured just before it: the
same VM runs at different speeds an hour apart, and that figure tells its phases apart.

The JSON keeps one record per host, sizes and restriction (`runs`, keyed "host / defaults|full"): a run replaces
its own record and keeps the others. Each record: the host, run.json's stage seconds and their total, the wall
time the report states (the command's start to the report), the wall time measured here around the command,
the driver process's peak RSS (Ray's workers are not its children), and whether that wall time is within the
goal.

It first waits (--settle, 300 s at most) for a quiet host: the job picks its threads by the load it finds.

    python bench/main_job_time.py [--full] [--as-avx2] [--out bench/results/main_job_time.json] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from oscar.host import avx2_env, gemm_gflops

OUT = Path(__file__).with_name("results") / "main_job_time.json"
GOAL_S = 15 * 60


def run_job(run_dir: Path, full: bool, env: dict) -> tuple[dict, float]:
    """(run.json, wall seconds) of `oscar run --out run_dir [--full]` in a child process."""
    cmd = [sys.executable, "-m", "oscar", "run", "--out", str(run_dir), "--no-progress", *(["--full"] if full else [])]
    t = time.perf_counter()
    subprocess.run(cmd, env=env, check=True)
    return json.loads((run_dir / "run.json").read_text()), time.perf_counter() - t


def settle(limit_s: float, below: float = 0.5) -> float:
    """Wait (up to limit_s) for the 1-minute load average to fall below `below`, and return the load it starts at.

    The job picks its threads by the load it finds (validate/niah.py `decode_threads`): a run started right after
    other work would time fewer threads."""
    t = time.monotonic()
    while os.getloadavg()[0] >= below and time.monotonic() - t < limit_s:
        time.sleep(5)
    return os.getloadavg()[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--full", action="store_true", help="the evidence sizes (`oscar run --full`)")
    ap.add_argument("--as-avx2", action="store_true", help="run as an AVX2-only host (module docstring)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--keep", default=None, help="run directory to keep (default: a temporary one, removed)")
    ap.add_argument("--settle", type=float, default=300, help="seconds to wait at most for a quiet host (default 300)")
    a = ap.parse_args()
    env = dict(os.environ)
    tmp = tempfile.TemporaryDirectory(prefix="oscar-main-job-")
    if a.as_avx2:
        env = avx2_env(env)
    run_dir = Path(a.keep) if a.keep else Path(tmp.name) / "run"
    if run_dir.exists() and any(run_dir.iterdir()):
        sys.exit(f"main_job_time: {run_dir} is not empty; a resumed run would time the stages it skips as 0")
    load0 = settle(a.settle)
    gflops = gemm_gflops(env)
    with tmp:
        info, wall = run_job(run_dir, a.full, env)
    rss_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # the driver's, in KiB on Linux
    rec = {"host": info["host"], "host_info": info.get("host_info"), "command": info["command"],
           "sizes": "full" if a.full else "defaults", "compute_dtype": info.get("compute_dtype"),
           "stage_seconds": {k: round(v, 1) for k, v in info["stage_seconds"].items()},
           "total_seconds": round(info["total_seconds"], 1), "wall_seconds": round(wall, 1),
           "report_wall_seconds": info.get("wall_seconds") and round(info["wall_seconds"], 1),
           "driver_peak_rss_gib": round(rss_gib, 2), "goal_seconds": GOAL_S,
           "goal_met": wall <= GOAL_S,  # the command's wall time, as its user waits for it
           "native_paths": info.get("native_paths"), "load_at_start": round(load0, 2),
           "gemm_gflops_1thread": gflops,
           "date": time.strftime("%Y-%m-%d")}
    out = Path(a.out)
    try:
        runs = json.loads(out.read_text())["runs"]
    except (OSError, ValueError, KeyError):
        runs = {}
    runs[f"{rec['host']} / {rec['sizes']}"] = rec
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    print(f"wrote {out}: {rec['host']}, {rec['sizes']}: {rec['wall_seconds'] / 60:.1f} min wall "
          f"(goal {'met' if rec['goal_met'] else 'not met'}; {len(runs)} records)")


if __name__ == "__main__":
    main()
