"""Which half of the INT2 cache loses the needles: oscar-int2 with only its keys or only its values quantized.

Diagnostic, not a product method: two extra methods are registered for this run only —
`oscar-int2-kq` (keys quantized as the artifact says, values exact) and `oscar-int2-vq` (values
quantized, keys exact) — by wrapping `LayerQuant` so that the chosen half passes through. Same
samples, prompts, protocol and cache code as `oscar validate niah` (serving protocol, as the
main job's needle tests).

    python bench/niah_attribution.py [--artifact reports/examples/smollm2/artifact.safetensors]
                                     [--lengths 2048,4096] [--samples 10] [--dtype bfloat16]
    python bench/niah_attribution.py --model qwen2.5-0.5b --artifact runs/i16e/qp8192/nll.safetensors \
        --tasks niah_multikey_1 --lengths 2048,4096 --samples 20 --run-dir runs/i16e/attr_qwen_mk \
        --out bench/results/issue16/attribution_qwen_multikey.json

Writes bench/results/niah_attribution.json (per task, length and method: mean score in %; with --run-dir, which
keeps the samples and resumes, also each half against bf16 and oscar-int2, paired, pooled over the lengths).
Runs in this process: the two diagnostic methods exist only here, not in `run_niah`'s spawned workers.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from oscar import evidence as ev
from oscar.common import set_threads
from oscar.validate import methods as M
from oscar.validate.niah import NiahConfig, run_niah

OUT = Path(__file__).with_name("results") / "niah_attribution.json"


def _register_halves() -> None:
    init, keys, values = M.LayerQuant.__init__, M.LayerQuant.keys, M.LayerQuant.values

    def init_(self, art, layer, *args, **kwargs):
        init(self, art, layer, *args, **kwargs)
        self.exact_half = art.meta.get("diag_exact")     # "keys" | "values" | None

    M.LayerQuant.__init__ = init_
    M.LayerQuant.keys = lambda self, k: k if self.exact_half == "keys" else keys(self, k)
    M.LayerQuant.values = lambda self, v: v if self.exact_half == "values" else values(self, v)

    def variant(exact: str):
        def factory(config, art):
            a = copy.copy(M.METHODS["oscar-int2"](config, art))
            a.meta = {**a.meta, "diag_exact": exact}
            return a
        return factory

    M.register_method("oscar-int2-kq", variant("values"), needs_artifact=True)  # keys INT2, values exact
    M.register_method("oscar-int2-vq", variant("keys"), needs_artifact=True)    # values INT2, keys exact


def _paired(cells: dict, methods: list[str]) -> dict:
    """Each INT2 variant minus bf16 and each half minus oscar-int2, paired by sample, per task pooled over lengths."""
    out = {}
    tasks = sorted({t for t, _, _ in cells})
    lengths = sorted({L for _, L, _ in cells})
    for t in tasks:
        for m, base in [(m, "bf16") for m in methods[1:]] + [(m, "oscar-int2") for m in methods[2:]]:
            pa = [ev.paired_arrays(cells, t, L, m, base) for L in lengths]
            x = np.concatenate([a for a, _ in pa])
            y = np.concatenate([b for _, b in pa])
            if len(x):
                dd, lo, hi = ev.paired_diff(x, y)
                out[f"{t} {m} - {base}"] = {"diff": dd, "lo": lo, "hi": hi, "pairs": len(x)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--artifact", default="reports/examples/smollm2/artifact.safetensors")
    ap.add_argument("--tasks", default="niah_single_1,niah_single_2")
    ap.add_argument("--lengths", default="2048,4096")
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--run-dir", help="keep the needle run here (resumable); default: a temporary directory")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    threads = set_threads()
    _register_halves()
    methods = ["bf16", "oscar-int2", "oscar-int2-kq", "oscar-int2-vq"]
    with tempfile.TemporaryDirectory(prefix="oscar-niah-attr-") as tmp:
        d = args.run_dir or tmp
        cfg = NiahConfig(out=d, model=args.model, artifact=args.artifact, methods=methods, tasks=args.tasks.split(","),
                         lengths=[int(x) for x in args.lengths.split(",")], samples=args.samples,
                         protocol="serving", dtype=args.dtype)
        t0 = time.perf_counter()
        df = run_niah(cfg, workers=1)
        wall = time.perf_counter() - t0
        paired = _paired(ev.cell_scores(ev.read_samples(str(Path(d) / "niah_samples.jsonl"))), methods)
    scores = {t: {str(L): dict(zip(g.method, g.score)) for L, g in gt.groupby("length")} for t, gt in df.groupby("task")}
    res = {"model": args.model, "artifact": args.artifact, "protocol": "serving", "dtype": args.dtype, "samples": args.samples,
           "methods": {"oscar-int2-kq": "keys INT2 as oscar-int2, values exact",
                       "oscar-int2-vq": "values INT2 as oscar-int2, keys exact"},
           "score_percent": scores, "paired_pooled_over_lengths": paired, "wall_s": wall, "threads": threads,
           "command": "python bench/niah_attribution.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                                                              if k != "out" and v is not None)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(scores, indent=1))
    for k, v in paired.items():
        print(f"{k}: {v['diff']:+.1f} [{v['lo']:+.1f}, {v['hi']:+.1f}] points, {v['pairs']} pairs")


if __name__ == "__main__":
    main()
