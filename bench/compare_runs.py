"""Two runs of `oscar run` compared sample by sample: needle predictions and verdicts, perplexities, tune choice.

    python bench/compare_runs.py --old-rev REV reports/examples/smollm2 [--out bench/results/compare_runs.json]

The old run is the example directory as committed at REV (read with `git show`), the new one the
directory on disk. Written: identical predictions and identical verdicts (needle found or not) over the
(task, length, sample, method) rows both hold, found counts per method, perplexity per (method,
protocol, context), and each run's calibration summary (calibration/calibration.json: clips, d_eff, the tune).
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
from collections import defaultdict
from pathlib import Path


def _old(rev: str, path: Path, name: str) -> bytes:
    return subprocess.run(["git", "show", f"{rev}:{(path / name).as_posix()}"], capture_output=True, check=True).stdout


def _rows(data: bytes) -> dict:
    rows = [json.loads(l) for l in data.decode().splitlines() if l.strip()]
    return {(r["task"], r["length"], r["index"], r["method"]): r for r in rows}


def _ppl(data: bytes) -> dict:
    import pyarrow.parquet as pq

    return {(r["method"], r["protocol"], r["context"]): r for r in pq.read_table(io.BytesIO(data)).to_pylist()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="the new run's directory (e.g. reports/examples/smollm2)")
    ap.add_argument("--old-rev", required=True, help="git revision holding the old run at the same path")
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("results") / "compare_runs.json",
                    help="JSON output (default bench/results/compare_runs.json)")
    a = ap.parse_args()
    old, new = _rows(_old(a.old_rev, a.run, "niah_samples.jsonl")), _rows((a.run / "niah_samples.jsonl").read_bytes())
    keys = sorted(set(old) & set(new))
    per = defaultdict(lambda: {"old_found": 0.0, "new_found": 0.0, "verdict_changed": 0, "rows": 0})
    for k in keys:
        m = per[k[3]]
        m["rows"] += 1
        m["old_found"] += old[k]["score"]
        m["new_found"] += new[k]["score"]
        m["verdict_changed"] += old[k]["score"] != new[k]["score"]
    po, pn = _ppl(_old(a.old_rev, a.run, "ppl.parquet")), _ppl((a.run / "ppl.parquet").read_bytes())
    ppl = [{"method": k[0], "protocol": k[1], "context": k[2], "old_ppl": po[k]["ppl"], "new_ppl": pn[k]["ppl"],
            "rel_change": pn[k]["ppl"] / po[k]["ppl"] - 1, "old_ratio": po[k].get("ratio"), "new_ratio": pn[k].get("ratio")}
           for k in sorted(set(po) & set(pn))]
    res = {"command": f"python bench/compare_runs.py --old-rev {a.old_rev} {a.run.as_posix()}",
           "old": f"{a.old_rev}:{a.run.as_posix()}", "new": a.run.as_posix(), "niah_rows": len(keys),
           "identical_predictions": sum(old[k]["pred"] == new[k]["pred"] for k in keys),
           "same_verdict": sum(old[k]["score"] == new[k]["score"] for k in keys),
           "per_method": dict(per), "ppl": ppl}
    for side, run in (("old", json.loads(_old(a.old_rev, a.run, "calibration/calibration.json"))),
                      ("new", json.loads((a.run / "calibration" / "calibration.json").read_text()))):
        summ = run.get("summary", {})
        res[f"{side}_calibration"] = {k: summ.get(k) for k in ("store_fingerprint", "d_eff_k", "d_eff_v", "clip_k", "clip_v",
                                                               "heavy_heads", "pruned_eigenvalues", "clip_tuning")}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "ppl"}, indent=1))
    print("wrote", a.out)


if __name__ == "__main__":
    main()
