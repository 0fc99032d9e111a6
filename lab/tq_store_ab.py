"""Why tq-int2 lost at 1k-2k in the second model's example: the store's positions, or the calibrated key mean?

tq-int2 (validate/codebooks.py) reads the D/4 outlier channels and the key mean it subtracts from the calibration
store. The example's store covers positions up to 32k (what the recipe serves); the example before it was
calibrated at 2,048-token positions, and there tq-int2 scored 96.2 / 97.5 % at 1k / 2k against 81.2 / 61.3 % now.
Two A/Bs on the same needle samples, paired by (task, length, index):

    # A: tq-int2 from a store calibrated at 2,048 positions (the old example's calibration command), plain fit
    oscar calibrate --model qwen2.5-0.5b --store runs/tq-ab/calib2k.zarr --seq-len 2048 --tokens 8192 \
        --block-tokens 4096 --threads 1
    oscar fit runs/tq-ab/calib2k.zarr --variant scaled --no-tune --widths none --out runs/tq-ab/artifact2k.fit.safetensors
    oscar validate niah --model qwen2.5-0.5b --artifact runs/tq-ab/artifact2k.fit.safetensors --methods tq-int2 \
        --tasks niah_single_1,niah_single_2,niah_single_3,niah_multikey_1 --lengths 1k,2k --samples 20 \
        --protocol serving --dtype bfloat16 --out runs/tq-ab/niah2k
    # B: the example's own store, keys not centred (the paper's TurboQuant has no calibrated mean)
    python lab/tq_store_ab.py uncentred --artifact reports/examples/qwen2.5-0.5b/artifact.safetensors \
        --lengths 1k,2k --out runs/tq-ab/uncentred
    # the table (base: the example's tq-int2 and bf16 rows)
    python lab/tq_store_ab.py compare reports/examples/qwen2.5-0.5b runs/tq-ab/niah2k:tq-int2 \
        runs/tq-ab/uncentred:tq-int2-uncentred

Writes lab/results/tq_positions/ab.json.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace

import numpy as np
import torch

from oscar.__main__ import main as oscar_main
from oscar.validate import methods as M
from oscar.validate.evidence import cell_scores, paired_arrays, paired_diff, read_samples

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "lab", "results", "tq_positions", "ab.json")
TASKS = "niah_single_1,niah_single_2,niah_single_3,niah_multikey_1"


def _uncentred(config, art):
    a = M.method_artifact("tq-int2", config, art)
    return replace(a, k_mean=[torch.zeros_like(m) for m in a.k_mean], meta={**a.meta, "variant": "tq-int2-uncentred"})


def uncentred(a: argparse.Namespace) -> int:
    M.register_method("tq-int2-uncentred", _uncentred, needs_artifact=True)
    return oscar_main(["validate", "niah", "--model", a.model, "--artifact", a.artifact, "--methods",
                       "tq-int2-uncentred", "--tasks", TASKS, "--lengths", a.lengths, "--samples", str(a.samples),
                       "--protocol", "serving", "--dtype", "bfloat16", "--out", a.out])


def _pooled(cells: dict, m: str, base: str, L: int) -> tuple[np.ndarray, np.ndarray]:
    """Method m's scores against `base`'s on the samples both have, the tasks pooled at length L."""
    pairs = [paired_arrays(cells, t, L, m, base) for t in sorted({t for (t, l, mm) in cells if l == L and mm == m})]
    return np.concatenate([x for x, _ in pairs]), np.concatenate([y for _, y in pairs])


def compare(a: argparse.Namespace) -> int:
    base = cell_scores(read_samples(os.path.join(a.base, "niah_samples.jsonl")))
    res = {"base": a.base, "rows": []}
    print("| run | method | length | score % | vs the example's tq-int2 (points, paired) | vs bf16 |")
    print("|---|---|---|---|---|---|")
    for spec in a.runs:
        d, m = spec.rsplit(":", 1)
        run = cell_scores(read_samples(os.path.join(d, "niah_samples.jsonl")))
        # the run's rows beside the base's, under a name of their own (the run's method may be the base's tq-int2)
        cells = {**base, **{(t, l, "run"): v for (t, l, mm), v in run.items() if mm == m}}
        for L in sorted({l for (_, l, mm) in run if mm == m}):
            x, y = _pooled(cells, "run", "tq-int2", L)
            _, b = _pooled(cells, "run", "bf16", L)
            d1, lo1, hi1 = paired_diff(x, y)
            d2, lo2, hi2 = paired_diff(x, b)
            row = {"run": d, "method": m, "length": L, "pairs": len(x), "score": 100 * float(x.mean()),
                   "example_tq": 100 * float(y.mean()), "vs_example_tq": [d1, lo1, hi1], "vs_bf16": [d2, lo2, hi2]}
            res["rows"].append(row)
            print(f"| {d} | {m} | {L} | {row['score']:.1f} (n={len(x)}) | {d1:+.1f} [{lo1:+.1f}, {hi1:+.1f}] "
                  f"(example {row['example_tq']:.1f}) | {d2:+.1f} [{lo2:+.1f}, {hi2:+.1f}] |")
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(res, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("uncentred", help="tq-int2 from the artifact's store with the key mean left out")
    u.add_argument("--artifact", required=True)
    u.add_argument("--model", default="qwen2.5-0.5b")
    u.add_argument("--lengths", default="1k,2k")
    u.add_argument("--samples", type=int, default=20)
    u.add_argument("--out", required=True)
    c = sub.add_parser("compare", help="pooled paired table against the base run's tq-int2 and bf16 rows")
    c.add_argument("base", help="the run whose tq-int2 and bf16 rows are the baseline")
    c.add_argument("runs", nargs="+", help="DIR:METHOD, the rows to compare")
    a = ap.parse_args(argv)
    return uncentred(a) if a.cmd == "uncentred" else compare(a)


if __name__ == "__main__":
    raise SystemExit(main())
