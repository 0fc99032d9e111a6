"""What `oscar calibrate --positions` saves: the same tokens as long sequences, or as short windows at RoPE offsets.

Both arms calibrate the same `--tokens` of the calibration split into fresh stores, alternating order per repeat
(this host is noisy: the figure is the ratio within a repeat, median over repeats):

    long:     --seq-len LONG                                (what a LONG-token context needs without the option)
    windows:  --seq-len SHORT --positions LONG              (the same absolute positions, attention over SHORT)

The statistics they give match where it matters (lab/key_error_by_position.py: key error by position, SmolLM2 and
Qwen, docs/decisions/0066-calibrate-at-positions-not-lengths-oscar.md "Calibrate at positions, not lengths"); this measures the cost.

    python bench/calib_positions.py --model smollm2-135m --tokens 32768 --long 8192 --short 2048 \
        --out bench/results/calib_positions_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time


def main(argv=None) -> int:
    from oscar.pipeline.calibrate import CalibConfig, calibrate

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--long", type=int, default=8192)
    ap.add_argument("--short", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    arms = {"long": dict(seq_len=a.long), "windows": dict(seq_len=a.short, positions=a.long)}
    runs = []
    tmp = tempfile.mkdtemp(prefix="oscar-calib-positions-")
    try:
        for r in range(a.repeats):
            order = list(arms) if r % 2 == 0 else list(reversed(arms))
            rep = {}
            for name in order:
                store = os.path.join(tmp, f"{name}{r}.zarr")
                cfg = CalibConfig(model=a.model, store=store, tokens=a.tokens, block_tokens=max(a.long, 8192),
                                  threads=a.threads, **arms[name])
                t0 = time.perf_counter()
                res = calibrate(cfg, progress=False)
                rep[name] = {"wall_s": round(time.perf_counter() - t0, 2), "forward_s": round(res.forward_s, 2),
                             "tokens": res.tokens_run}
                shutil.rmtree(store, ignore_errors=True)
                print(f"repeat {r} {name:8s} forward {res.forward_s:7.1f} s  ({res.tokens_run} tokens)", flush=True)
            rep["forward_ratio_long_over_windows"] = round(rep["long"]["forward_s"] / rep["windows"]["forward_s"], 3)
            runs.append(rep)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ratios = [r["forward_ratio_long_over_windows"] for r in runs]
    out = {"config": vars(a), "arms": arms, "runs": runs,
           "forward_ratio_median": round(statistics.median(ratios), 3), "forward_ratio_range": [min(ratios), max(ratios)],
           "cpu_count": os.cpu_count()}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"long / windows forward time: {out['forward_ratio_median']}x (range {out['forward_ratio_range']}) -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
