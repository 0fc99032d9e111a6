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
        --out lab/results/attribution_qwen_multikey.json

Writes bench/results/niah_attribution.json (per task, length and method: mean score in %; with --run-dir, which
keeps the samples and resumes, also each half against bf16 and oscar-int2, paired, pooled over the lengths).
Runs in this process: the two diagnostic methods exist only here, not in `run_niah`'s spawned workers.

With --key-classes (an artifact with per-layer key widths), the keys are made exact in one class of layers at a time
instead: `oscar-int2-k<b>` (keys exact in the layers whose keys are b bits), and the 2-bit layers also split at the
middle layer (`oscar-int2-k2lo` / `-k2hi`). --reuse DIR pairs them with the bf16 and oscar-int2 arms of an earlier
run of the same samples (same model, artifact, tasks, lengths, seed) instead of running those again:

    python bench/niah_attribution.py --key-classes --tasks niah_single_2 --lengths 4096 --samples 40 \
        --reuse runs/i16e/attr_smollm2_grad --run-dir runs/i16e/attr_smollm2_layers \
        --out lab/results/attribution_smollm2_layers.json
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from oscar.validate import evidence as ev
from oscar.common import set_threads
from oscar.stats.artifact import load_artifact
from oscar.kernels import simulate as S
from oscar.validate import methods as M
from oscar.validate.niah import NiahConfig, run_niah

OUT = Path(__file__).with_name("results") / "niah_attribution.json"


def key_classes(art) -> dict[str, list[int]]:
    """Method suffix -> layers: k<b> for each key width b present, and the 2-bit layers' lower / upper halves."""
    widths = [q.bits + q.key_top if q.key_split else q.bits for q in (art.quant_for(l) for l in range(art.num_layers))]
    out = {f"k{b}": [l for l, w in enumerate(widths) if w == b] for b in sorted(set(widths))}
    mid = art.num_layers // 2
    out["k2lo"] = [l for l in out.get("k2", []) if l < mid]
    out["k2hi"] = [l for l in out.get("k2", []) if l >= mid]
    return {k: v for k, v in out.items() if v}


def _register_halves(classes: dict[str, list[int]] | None = None) -> None:
    init, keys, values = S.LayerQuant.__init__, S.LayerQuant.keys, S.LayerQuant.values

    def init_(self, art, layer, *args, **kwargs):
        init(self, art, layer, *args, **kwargs)
        self.exact_half = art.meta.get("diag_exact")     # "keys" | "values" | None
        if layer in art.meta.get("diag_exact_key_layers", ()):
            self.exact_half = "keys"

    S.LayerQuant.__init__ = init_
    S.LayerQuant.keys = lambda self, k: k if self.exact_half == "keys" else keys(self, k)
    S.LayerQuant.values = lambda self, v: v if self.exact_half == "values" else values(self, v)

    def variant(exact: str | None, layers: list[int] = ()):
        def factory(config, art):
            a = copy.copy(M.METHODS["oscar-int2"](config, art))
            a.meta = {**a.meta, "diag_exact": exact, "diag_exact_key_layers": list(layers)}
            return a
        return factory

    M.register_method("oscar-int2-kq", variant("values"), needs_artifact=True)  # keys INT2, values exact
    M.register_method("oscar-int2-vq", variant("keys"), needs_artifact=True)    # values INT2, keys exact
    for name, layers in (classes or {}).items():  # keys exact in one class of layers, everything else as oscar-int2
        M.register_method(f"oscar-int2-{name}", variant(None, layers), needs_artifact=True)


def _diag_bits(art, exact: str | None, key_layers: list[int] = ()) -> float:
    """Bits per element a diagnostic arm stores: its exact half (or exact key layers) at 16 bits, the rest as the
    artifact's per-layer formats, K and V averaged over the layers (the run's memory.json would say the artifact's)."""
    D, out = art.head_dim, []
    for l in range(art.num_layers):
        q = art.quant_for(l)
        kb = 16.0 if exact == "keys" or l in key_layers else q.key_bits(D)
        out.append(0.5 * (kb + (16.0 if exact == "values" else q.value_bits(D))))
    return float(np.mean(out))


def _fix_memory(run_dir: str, bits: dict[str, float]) -> None:
    """The diagnostic rows of run_dir/memory.json at the bits they store, their byte columns dropped (not a format)."""
    p = Path(run_dir) / "memory.json"
    if not p.exists():
        return
    rows = json.loads(p.read_text())
    for r in rows:
        if r["method"] in bits:
            r.update({k: None for k in r if k.startswith("bytes_") or k == "ratio_vs_bf16"})
            r["bits_per_element"] = bits[r["method"]]
            r["note"] = "diagnostic (bench/niah_attribution.py): one half or some layers' keys exact, not a cache format"
    p.write_text(json.dumps(rows, indent=1) + "\n")


def _paired(cells: dict, methods: list[str]) -> dict:
    """Each INT2 variant minus bf16 and each diagnostic variant minus oscar-int2, paired by sample, per task pooled over
    lengths (methods: bf16, oscar-int2, then the variants)."""
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
    ap.add_argument("--seed", type=int, default=0, help="needle seed (`oscar validate niah --seed`)")
    ap.add_argument("--run-dir", help="keep the needle run here (resumable); default: a temporary directory")
    ap.add_argument("--key-classes", action="store_true",
                    help="keys exact in one class of layers at a time (by key width; the 2-bit layers also by half)")
    ap.add_argument("--reuse", help="an earlier run dir of the same samples: its bf16 and oscar-int2 arms are read, not rerun")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    threads = set_threads()
    art = load_artifact(args.artifact)
    classes = key_classes(art) if args.key_classes else {}
    _register_halves(classes)
    diag = [f"oscar-int2-{c}" for c in classes] if classes else ["oscar-int2-kq", "oscar-int2-vq"]
    methods = ["bf16", "oscar-int2"] + diag
    tasks, lengths = args.tasks.split(","), [int(x) for x in args.lengths.split(",")]
    reused = {}
    if args.reuse:  # the same samples: the identity a stored sample depends on, and tasks / lengths covered
        prev = json.load(open(Path(args.reuse) / "niah_config.json"))
        mine = NiahConfig(out=args.reuse, model=args.model, artifact=args.artifact, methods=methods[:2], tasks=tasks,
                          lengths=lengths, samples=args.samples, protocol="serving", dtype=args.dtype,
                          seed=args.seed).identity()
        if prev["identity"] != mine or not set(tasks) <= set(prev["config"]["tasks"]) \
                or not set(lengths) <= set(prev["config"]["lengths"]):
            raise SystemExit(f"--reuse {args.reuse}: another run's samples ({prev['identity']} vs {mine})")
        reused = {k: r for k, r in ev.read_samples(str(Path(args.reuse) / "niah_samples.jsonl")).items()
                  if k[3] in methods[:2] and k[0] in tasks and k[1] in lengths and k[2] < args.samples}
    with tempfile.TemporaryDirectory(prefix="oscar-niah-attr-") as tmp:
        d = args.run_dir or tmp
        cfg = NiahConfig(out=d, model=args.model, artifact=args.artifact, methods=diag if reused else methods,
                         tasks=tasks, lengths=lengths, samples=args.samples, protocol="serving", dtype=args.dtype,
                         seed=args.seed)
        t0 = time.perf_counter()
        run_niah(cfg, workers=1)
        wall = time.perf_counter() - t0
        bits = ({f"oscar-int2-{c}": _diag_bits(art, None, v) for c, v in classes.items()} if classes else
                {"oscar-int2-kq": _diag_bits(art, "values"), "oscar-int2-vq": _diag_bits(art, "keys")})
        _fix_memory(d, bits)
        done = {**reused, **ev.read_samples(str(Path(d) / "niah_samples.jsonl"))}
        paired = _paired(ev.cell_scores(done), methods)
    cells = ev.cell_scores(done)
    scores = {t: {str(L): {m: 100 * float(np.mean(list(cells[(t, L, m)].values()))) for m in methods if (t, L, m) in cells}
                  for L in sorted({L for t_, L, _ in cells if t_ == t})} for t in sorted({t for t, _, _ in cells})}
    about = ({f"oscar-int2-{c}": f"keys exact in layers {v}, everything else as oscar-int2" for c, v in classes.items()}
             if classes else {"oscar-int2-kq": "keys INT2 as oscar-int2, values exact",
                              "oscar-int2-vq": "values INT2 as oscar-int2, keys exact"})
    res = {"model": args.model, "artifact": args.artifact, "protocol": "serving", "dtype": args.dtype, "samples": args.samples,
           "reused": args.reuse, "methods": about, "bits_per_element": {k: round(v, 4) for k, v in bits.items()},
           "score_percent": scores, "paired_pooled_over_lengths": paired, "wall_s": wall, "threads": threads,
           "command": "python bench/niah_attribution.py " + " ".join(
               f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in vars(args).items()
               if k != "out" and v not in (None, False))}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(scores, indent=1))
    for k, v in paired.items():
        print(f"{k}: {v['diff']:+.1f} [{v['lo']:+.1f}, {v['hi']:+.1f}] points, {v['pairs']} pairs")


if __name__ == "__main__":
    main()
