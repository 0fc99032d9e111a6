"""The committed second-model example (reports/examples/qwen2.5-0.5b, `bash scripts/qwen_long_context.sh`) holds the
evidence it claims: RULER's four needle tasks at 1k-8k with at least 20 samples per cell for every method, every
cell's interval the Wilson interval of its own sample lines, RULER's summary.csv and lm-evaluation-harness's
results.json recomputed from the same lines, and perplexity over at least 8 windows at 1k and at 4k."""

from __future__ import annotations

import csv
import json
import os
from collections import defaultdict

import pandas as pd
import pytest

from oscar.validate.evidence import read_samples
from oscar.validate.intervals import wilson

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EX = os.path.join(ROOT, "reports", "examples", "qwen2.5-0.5b")
TASKS = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1"]
LENGTHS = [1024, 2048, 4096, 8192]
METHODS = ["bf16", "oscar-int2", "tq-int2", "kivi2"]


@pytest.fixture(scope="module")
def lines():
    done = read_samples(os.path.join(EX, "niah_samples.jsonl"))
    cells = defaultdict(list)  # (task, length, method) -> scores
    for (task, length, _, method), r in sorted(done.items()):
        cells[(task, length, method)].append(float(r["score"]))
    return dict(cells)


def test_every_ruler_cell_has_20_samples(lines):
    res = pd.read_parquet(os.path.join(EX, "results.parquet"))
    for t in TASKS:
        for L in LENGTHS:
            for m in METHODS:
                n = len(lines.get((t, L, m), []))
                row = res[(res.task == t) & (res.length == L) & (res.method == m)]
                assert n >= 20 and len(row) == 1 and int(row.samples.iloc[0]) == n, (t, L, m, n)


def test_intervals_are_wilson_of_the_sample_lines(lines):
    res = pd.read_parquet(os.path.join(EX, "results.parquet"))
    assert len(res) == len(lines)
    for r in res.itertuples():
        s = lines[(r.task, r.length, r.method)]
        assert set(s) <= {0.0, 1.0} and r.ci_method == "wilson"
        lo, hi = wilson(sum(s), len(s))
        assert r.score == pytest.approx(100 * sum(s) / len(s), abs=1e-9)
        assert (r.ci_low, r.ci_high) == pytest.approx((100 * lo, 100 * hi), abs=1e-9), (r.task, r.length, r.method)


def test_ruler_files_agree_with_the_sample_lines(lines):
    for m in METHODS:
        lm = json.load(open(os.path.join(EX, "ruler", m, "results.json")))["results"]
        for L in LENGTHS:
            with open(os.path.join(EX, "ruler", m, str(L), "summary.csv")) as f:
                _, tasks, scores, nulls = list(csv.reader(f))
            for t, sc, nu in zip(tasks[1:], scores[1:], nulls[1:]):
                s = lines[(t, L, m)]
                assert float(sc) == pytest.approx(round(100 * sum(s) / len(s), 2)) and nu.endswith(f"/{len(s)}")
                assert lm[t][f"{L},none"] == pytest.approx(sum(s) / len(s))
            assert set(TASKS) <= set(tasks[1:])


def test_perplexity_has_8_windows_at_1k_and_4k():
    wins = defaultdict(set)
    with open(os.path.join(EX, "ppl_windows.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            wins[(r["method"], r["protocol"], r["context"])].add(r["window"])
    for m in METHODS:
        for p in (["-"] if m == "bf16" else ["strict", "serving"]):
            for L in (1024, 4096):
                assert len(wins[(m, p, L)]) >= 8, (m, p, L, len(wins[(m, p, L)]))
    ppl = pd.read_parquet(os.path.join(EX, "ppl.parquet"))
    assert set(METHODS) <= set(ppl.method) and {1024, 4096} <= set(ppl.context)
