"""lab/candidates_ab.py pools needle pairs over tasks and lengths: planted records against hand-built pairs."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from oscar.validate import intervals as iv


@pytest.fixture(scope="module")
def ab():
    spec = importlib.util.spec_from_file_location("_candidates_ab", Path(__file__).parents[1] / "candidates_ab.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write(d: Path, records: list[tuple]) -> None:
    d.mkdir()
    (d / "niah_config.json").write_text(json.dumps({"config": {"seed": 0}}))
    with open(d / "niah_samples.jsonl", "w") as f:
        for t, L, i, m, s in records:
            f.write(json.dumps({"task": t, "length": L, "index": i, "method": m, "score": float(s)}) + "\n")


def test_all_lengths_row_pairs_every_cell(ab, tmp_path):
    rng = np.random.default_rng(0)
    tasks, lengths, n = ("a", "b"), (1024, 2048), 7
    hits = {(t, L, m): rng.integers(0, 2, n) for t in tasks for L in lengths for m in ("base", "cand")}
    # base in one run, the candidate in another run of the same samples (seed 0) under the same method name
    cells = [(t, L, i) for t in tasks for L in lengths for i in range(n)]
    keep = [c for c in cells if c != ("b", 2048, 0)]  # one candidate record missing: its pair must drop out
    _write(tmp_path / "r1", [(t, L, i, "oscar-int2", hits[t, L, "base"][i]) for t, L, i in cells])
    _write(tmp_path / "r2", [(t, L, i, "oscar-int2", hits[t, L, "cand"][i]) for t, L, i in keep])
    out = tmp_path / "ab.json"
    assert ab.main(["--niah", str(tmp_path / "r1"), str(tmp_path / "r2"), "--base", "oscar-scaled-int2",
                    "--rename", f"{tmp_path / 'r1'}:oscar-int2=oscar-scaled-int2",
                    f"{tmp_path / 'r2'}:oscar-int2=oscar-unclip-int2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = {(r["task"], r["length"], r["method"]): r for r in res["niah"]}
    row = rows["pooled", "all", "oscar-unclip-int2"]
    xa = np.array([hits[t, L, "cand"][i] for t, L, i in keep], float)
    xb = np.array([hits[t, L, "base"][i] for t, L, i in keep], float)
    v = row["vs_oscar-scaled-int2"]
    assert v["paired"] == len(keep) == 4 * n - 1 and row["samples"] == 4 * n - 1
    assert v["diff"] == pytest.approx(100 * (xa.mean() - xb.mean()))
    lo, hi = iv.newcombe_paired(xa, xb, 0.95)
    assert (v["lo"], v["hi"]) == pytest.approx((100 * lo, 100 * hi))
    assert rows["a", "all", "oscar-unclip-int2"]["vs_oscar-scaled-int2"]["paired"] == 2 * n
    assert rows["b", 1024, "oscar-unclip-int2"]["vs_oscar-scaled-int2"]["paired"] == n
    assert res["lengths"] == [1024, 2048] and res["methods"] == ["oscar-scaled-int2", "oscar-unclip-int2"]
    assert "all lengths" in out.with_suffix(".md").read_text()
