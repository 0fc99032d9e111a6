"""Default thread count under a competing load: `oscar calibrate` with the default vs `--threads 1`.

One run, same process, same store config: a competing job of `--load` busy processes (each busy
`--duty` of the time, ~1.8 of 2 cores by default) is started, then calibrations alternate between
the default thread count (`oscar.common.default_threads`, decided at the start of each run, recorded
with its inputs), `--threads 1`, and all cores (`--threads os.cpu_count()`, the old default), for
`--reps` rounds. Each calibration writes a fresh store.

    python bench/threads.py [--model smollm2-135m] [--tokens 1024] [--seq-len 512] [--reps 2]

Writes bench/results/threads.json. Target: default tok/s >= threads-1 tok/s (ratio >= 1 within the
noise of a shared machine: median over the reps of each rep's back-to-back ratio). When the default
chooses the same thread count as `--threads 1` the two runs are the same configuration and the
ratio's spread is the machine's noise; `default_threads_chosen` records what it chose.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).with_name("results") / "threads.json"


def _burn(duty: float, stop) -> None:
    """Keep one core busy `duty` of the time (10 ms periods) until `stop` is set."""
    while not stop.is_set():
        t = time.perf_counter()
        while time.perf_counter() - t < 0.01 * duty:
            pass
        time.sleep(0.01 * (1 - duty))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=1024, help="calibration tokens per run")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--all-cores-reps", type=int, default=2, help="reps that also run the old default (all cores)")
    ap.add_argument("--load", type=int, default=2, help="competing busy processes")
    ap.add_argument("--duty", type=float, default=0.9, help="busy fraction of each competing process")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()

    from oscar.common import threads_decision
    from oscar.pipeline.calibrate import CalibConfig, calibrate

    tmp = Path(tempfile.mkdtemp(prefix="oscar-bench-threads-"))
    cpus = os.cpu_count() or 1
    machine = {"cpus": cpus, "loadavg_before_load": os.getloadavg(), "platform": platform.platform()}
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    burners = [ctx.Process(target=_burn, args=(args.duty, stop), daemon=True) for _ in range(args.load)]
    for p in burners:
        p.start()
    runs: list[dict] = []
    try:
        time.sleep(2.0)  # let the competing load settle before the first decision
        modes = [("default", None), ("threads_1", 1), (f"threads_{cpus}", cpus)]
        for rep in range(args.reps):
            todo = modes if rep < args.all_cores_reps else modes[:2]
            for name, threads in (todo if rep % 2 == 0 else todo[::-1]):
                decision = threads_decision() if threads is None else None
                store = tmp / f"{name}-{rep}.zarr"
                cfg = CalibConfig(model=args.model, corpus="pydoc", store=str(store), seq_len=args.seq_len,
                                  seqs_per_block=1, tokens=args.tokens, reservoir=64, threads=threads)
                r = calibrate(cfg, progress=False)
                import torch

                runs.append({"mode": name, "rep": rep, "threads": torch.get_num_threads(), "decision": decision,
                             "tokens": r.tokens_run, "wall_s": r.wall_s, "tokens_per_s": r.tokens_per_s,
                             "loadavg": os.getloadavg()})
                print(f"rep {rep} {name:>10}: {torch.get_num_threads()} threads, {r.tokens_per_s:8.1f} tok/s", flush=True)
                shutil.rmtree(store, ignore_errors=True)
    finally:
        stop.set()
        for p in burners:
            p.join(timeout=5)
        shutil.rmtree(tmp, ignore_errors=True)

    pairs = []  # default / threads-1 of the same rep: back to back, so slow load drift cancels
    for rep in range(args.reps):
        d = [r["tokens_per_s"] for r in runs if r["rep"] == rep and r["mode"] == "default"]
        o = [r["tokens_per_s"] for r in runs if r["rep"] == rep and r["mode"] == "threads_1"]
        if d and o:
            pairs.append(d[0] / o[0])
    med = {m: statistics.median(r["tokens_per_s"] for r in runs if r["mode"] == m) for m in {r["mode"] for r in runs}}
    allc = f"threads_{cpus}"
    res = {
        "model": args.model, "tokens_per_run": args.tokens, "seq_len": args.seq_len, "reps": args.reps,
        "competing_load": {"processes": args.load, "duty": args.duty, "cores_busy": args.load * args.duty},
        "tokens_per_s_median": med,
        "ratio_default_vs_threads_1": med["default"] / med["threads_1"],
        "ratio_default_vs_threads_1_per_rep": pairs,
        "ratio_default_vs_threads_1_median_of_pairs": statistics.median(pairs),
        "default_threads_chosen": sorted({r["threads"] for r in runs if r["mode"] == "default"}),
        "ratio_all_cores_vs_threads_1": med[allc] / med["threads_1"],
        "target": "default >= threads 1 (ratio >= 1 within noise)",
        "runs": runs, "machine": machine,
        "command": "python bench/threads.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                                                        if k != "out"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({k: res[k] for k in ("tokens_per_s_median", "ratio_default_vs_threads_1",
                                          "ratio_default_vs_threads_1_median_of_pairs", "default_threads_chosen",
                                          "ratio_all_cores_vs_threads_1")}, indent=2))


if __name__ == "__main__":
    main()
