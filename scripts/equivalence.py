"""Compare two scripts/equivalence.sh outputs: artifact tensors and metadata, NIAH predictions, perplexity NLLs.

python scripts/equivalence.py OUT_A OUT_B   -> prints each check, exit 1 on a difference.

Artifacts are compared tensor by tensor (bit-exact) and by their metadata with wall-clock fields
("seconds", "time_s", ...) removed: a fit records how long it took, so whole-file hashes differ between
two runs of the same code.
"""
import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open

CLOCK = {"seconds", "time_s", "elapsed_s", "wall_s", "cpu_s", "batch_wall_s", "batch_cpu_s", "host", "created", "created_at",
         "timestamp"}


def _strip(x):
    if isinstance(x, dict):
        return {k: _strip(v) for k, v in x.items() if k not in CLOCK}
    if isinstance(x, list):
        return [_strip(v) for v in x]
    return x


def _diff(x, y, path: str = "") -> list[str]:
    """Paths (a.b[3]) where two JSON values differ."""
    if isinstance(x, dict) and isinstance(y, dict):
        return [d for k in sorted(set(x) | set(y)) for d in _diff(x.get(k), y.get(k), f"{path}.{k}" if path else k)]
    if isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
        return [d for i, (u, v) in enumerate(zip(x, y)) for d in _diff(u, v, f"{path}[{i}]")]
    same = x == y or (isinstance(x, float) and isinstance(y, float) and x != x and y != y)  # NaN == NaN here
    return [] if same else [path]


def _artifact(p: Path) -> tuple[dict, dict]:
    with safe_open(str(p), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = {k: (_strip(json.loads(v)) if v[:1] in "{[" else v) for k, v in (f.metadata() or {}).items()}
    return tensors, meta


def _jsonl(p: Path) -> list[str]:
    rows = [json.loads(l) for l in p.read_text().splitlines() if l.strip()]
    return sorted(json.dumps(_strip(r), sort_keys=True) for r in rows)


def compare(a: Path, b: Path) -> list[tuple[str, bool, str]]:
    out = []
    for n in ("oscar", "scaled", "tuned"):
        (ta, ma), (tb, mb) = _artifact(a / f"{n}.safetensors"), _artifact(b / f"{n}.safetensors")
        same_t = ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
        out.append((f"{n}.safetensors tensors", same_t, f"{len(ta)} tensors"))
        diff = _diff(ma, mb)
        out.append((f"{n}.safetensors metadata", not diff, "differs in " + ", ".join(diff[:8]) if diff else "equal"))
    for name, rel in (("niah predictions", "niah/niah_samples.jsonl"), ("ppl windows", "ppl/ppl_windows.jsonl")):
        ra, rb = _jsonl(a / rel), _jsonl(b / rel)
        out.append((name, ra == rb, f"{len(ra)} rows"))
    return out


def main(a: str, b: str) -> int:
    res = compare(Path(a), Path(b))
    for name, same, detail in res:
        print(f"{'same' if same else 'DIFFERENT':9s}  {name}  ({detail})")
    return 0 if all(s for _, s, _ in res) else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
