"""Compare two bench/equivalence.sh outputs: artifact bytes, NIAH predictions, perplexity NLLs.

python bench/equivalence.py OUT_A OUT_B   -> prints each check, exit 1 on a difference.
"""
import hashlib, json, sys
from pathlib import Path


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def summary(d: Path) -> dict:
    s = {f"{n}.safetensors": _sha(d / f"{n}.safetensors") for n in ("oscar", "scaled", "tuned")}
    rows = [json.loads(l) for l in (d / "niah" / "niah_samples.jsonl").read_text().splitlines() if l.strip()]
    keep = lambda r: {k: v for k, v in r.items() if k not in ("time_s", "seconds", "elapsed_s", "host", "wall_s")}
    s["niah"] = sorted(json.dumps(keep(r), sort_keys=True) for r in rows)
    prow = [json.loads(l) for l in (d / "ppl" / "ppl_windows.jsonl").read_text().splitlines() if l.strip()]
    s["ppl"] = sorted(json.dumps(keep(r), sort_keys=True) for r in prow)
    return s


def main(a: str, b: str) -> int:
    sa, sb = summary(Path(a)), summary(Path(b))
    bad = 0
    for k in sa:
        same = sa[k] == sb[k]
        bad += not same
        n = len(sa[k]) if isinstance(sa[k], list) else 1
        print(f"{'same' if same else 'DIFFERENT'}  {k}  ({n} item{'s' if n != 1 else ''})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
