"""The committed second-model example (reports/examples/qwen2.5-0.5b, `bash scripts/qwen_example.sh`): RULER's
summary.csv and lm-evaluation-harness's results.json recompute from its sample lines at 1k-8k. Its cell sizes,
intervals and commands are checked by tests/test_example_from_main_job.py."""

from __future__ import annotations

import csv
import json
import os
from collections import defaultdict

import pytest

from oscar.validate.evidence import read_samples

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
