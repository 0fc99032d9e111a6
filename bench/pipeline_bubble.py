"""Pipeline efficiency on a local Ray cluster: measured sum(busy) / (P x wall) against M / (M + P - 1).

tiny-llama (4 layers) is calibrated by one replica of P = 1, 2, 4 stage actors (one layer range each)
with M one-sequence micro-batches, on a Ray head bound to 127.0.0.1. Each stage sleeps `--step` seconds
after each micro-batch (`ClusterConfig.throttle_s`): the sleep stands in for a GPU's compute, so every
stage step lasts about the same time whatever the host does. This host has 2 cores shared with other
jobs; with 4 stages computing for real, the measurement would be of the cores, not of the schedule.
What is measured is therefore the schedule (the driver's chaining of micro-batches, the lookahead,
Ray's per-call and object-store costs), not the model's compute.

Per stage, each micro-batch's span (start, end of compute, end of the sleep) is read back from the
stage actor (`StageStats.spans`); busy = compute + sleep + the block commits; wall = first micro-batch
start to last stage call end (after every stage has loaded: loading and Ray start are not in it).

Writes bench/results/pipeline_bubble.json (or --out). Run: python bench/pipeline_bubble.py
[--stages 1 2 4] [--micro-batches 8 24] [--step 0.1]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "results", "pipeline_bubble.json")
LAYERS = 4          # tiny-llama
SEQ_LEN = 32
SEQS_PER_BLOCK = 4  # micro-batches per block (one sequence each)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def ranges(p: int) -> str:
    """P equal layer ranges of tiny-llama's 4 layers."""
    w = LAYERS // p
    return ",".join(f"{i * w}:{(i + 1) * w}" for i in range(p))


def measure(head, work: str, p: int, m: int, step: float) -> dict:
    from oscar.cluster.pipeline import ClusterConfig, calibrate_on_ray
    from oscar.cluster.placement import pipeline_efficiency
    from oscar.pipeline.calibrate import CalibConfig

    blocks = m // SEQS_PER_BLOCK
    opts = dict(model="tiny-llama", store=f"{work}/p{p}-m{m}.zarr", seq_len=SEQ_LEN, sink=4,
                seqs_per_block=SEQS_PER_BLOCK, tokens=SEQ_LEN * SEQS_PER_BLOCK * blocks, reservoir=8, batch_size=1)
    cc = ClusterConfig(stages=p, replicas=1, layers=ranges(p), cpus_per_stage=1, threads_per_stage=1, throttle_s=step)
    rep = calibrate_on_ray(CalibConfig(**opts), cc, address=head.address, progress=False)
    st = sorted(rep.stage_stats, key=lambda s: s["stage"])
    t0 = min(s["spans"][0][0] for s in st)
    t1 = max(max(s["spans"][-1][2], s["last_call"]) for s in st)
    wall = t1 - t0
    # busy: compute and block commits (busy_seconds) + the sleeps standing in for compute
    busy = [s["busy_seconds"] + sum(c - b for _, b, c in s["spans"]) for s in st]
    mbs = [s["micro_batches"] for s in st]
    if mbs != [m] * p:
        raise RuntimeError(f"stages saw {mbs} micro-batches, expected {m} each")
    predicted = pipeline_efficiency(m, p)
    measured = sum(busy) / (p * wall)
    return {"stages": p, "micro_batches": m, "blocks": blocks, "layer_ranges": ranges(p),
            "predicted_efficiency": predicted, "measured_efficiency": measured,
            "measured_over_predicted": measured / predicted,
            "wall_s": wall, "ideal_wall_s": (m + p - 1) * step, "stage_busy_s": busy,
            "mean_step_s": sum(c - a for s in st for a, _, c in s["spans"]) / (p * m),
            "mean_compute_s": sum(b - a for s in st for a, b, _ in s["spans"]) / (p * m),
            "stage_first_start_s": [s["spans"][0][0] - t0 for s in st],
            "report_bubble": rep.bubble, "report_bubble_ideal": rep.bubble_ideal}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 4], help="stage counts (divide 4)")
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[8, 24],
                    help=f"micro-batches per run (multiples of {SEQS_PER_BLOCK})")
    ap.add_argument("--step", type=float, default=0.1, help="seconds each stage sleeps per micro-batch")
    ap.add_argument("--out", default=OUT, help="result JSON (default bench/results/pipeline_bubble.json)")
    args = ap.parse_args()
    for p in args.stages:
        if p < 1 or LAYERS % p:
            ap.error(f"--stages {p}: must divide {LAYERS}")
    for m in args.micro_batches:
        if m < SEQS_PER_BLOCK or m % SEQS_PER_BLOCK:
            ap.error(f"--micro-batches {m}: a multiple of {SEQS_PER_BLOCK}")

    from oscar.cluster.localray import LocalHead
    from oscar.cluster.pipeline import disconnect
    from oscar.pipeline.models import resolve_model

    resolve_model("tiny-llama")  # built once, before any timing
    head = LocalHead(num_cpus=max(args.stages) + 1, object_store_mb=256)
    head.use()
    head.start()
    work = tempfile.mkdtemp(prefix="oscar-bench-bubble-")
    started = time.time()
    runs = []
    try:
        for m in args.micro_batches:
            for p in args.stages:
                r = measure(head, work, p, m, args.step)
                print(json.dumps({k: r[k] for k in ("stages", "micro_batches", "predicted_efficiency",
                                                     "measured_efficiency", "wall_s")}), flush=True)
                runs.append(r)
    finally:
        disconnect()
        head.stop()
        shutil.rmtree(work, ignore_errors=True)
    out = {
        "what": "pipeline efficiency of one replica: measured sum(stage busy) / (P x wall) vs predicted M/(M+P-1)",
        "model": "tiny-llama (4 layers, random init)", "seq_len": SEQ_LEN, "micro_batch_sequences": 1,
        "seqs_per_block": SEQS_PER_BLOCK, "step_s": args.step,
        "isolation": (f"each stage sleeps {args.step} s per micro-batch (ClusterConfig.throttle_s) in place of GPU "
                      "compute: the host's 2 shared cores would otherwise be what is measured, not the schedule; "
                      "busy = compute + sleep + block commits; wall = first micro-batch start to last stage call end"),
        "host": {"cpu": cpu_model(), "cpus": os.cpu_count(), "load_avg_end": os.getloadavg(),
                 "python": platform.python_version()},
        "runs": runs, "total_s": time.time() - started,
        "command": "python bench/pipeline_bubble.py " + " ".join(sys.argv[1:]),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
