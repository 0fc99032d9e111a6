"""The report of a multi-command run (reports/examples/qwen2.5-0.5b): the needle cost per sample from the
batch costs niah_samples.jsonl records, the commands of run.json's steps, and a 0-of-n cell (Wilson's
lower bound is a rounding error above 0) plotted without error."""

from __future__ import annotations

import json

import pandas as pd


def _rows(task, L, method, scores, cpu, wall):
    return [{"task": task, "length": L, "index": i, "method": method, "score": s, "pred": "", "answers": ["1"],
             "metric": "all", "prompt_tokens": L, "protocol": "serving", "batch_samples": 1,
             "batch_cpu_s": cpu[i], "batch_wall_s": wall[i]} for i, s in enumerate(scores)]


def test_report_lists_needle_cost_and_commands(tmp_path):
    from oscar.reports.build import build_report

    rows = []
    for m, sc in (("bf16", [1, 1, 1]), ("kivi2", [0, 0, 0])):  # kivi2 0 of 3: ci_low = 5.6e-17 > score
        rows += _rows("niah_single_1", 8192, m, sc, [50.0, 30.0, 40.0], [100.0, 60.0, 80.0])
        rows += _rows("niah_single_1", 32768, m, sc[:1], [600.0], [1500.0])
    with open(tmp_path / "niah_samples.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    res = pd.DataFrame([{"suite": "ruler", "task": "niah_single_1", "method": m, "length": L, "samples": n,
                         "score": 100.0 if m == "bf16" else 0.0, "protocol": "serving"}
                        for m in ("bf16", "kivi2") for L, n in ((8192, 3), (32768, 1))])
    res.to_parquet(tmp_path / "results.parquet", index=False)
    json.dump({"command": "bash scripts/x.sh", "model": "qwen2.5-0.5b", "host": "h (2 CPUs)", "total_seconds": 120,
               "summary": "12.3 CPU min in all.",
               "steps": [{"stage": "niah-8k", "command": "oscar validate niah --lengths 8k", "cpu_s": 120.0,
                          "wall_s": 240.0, "note": "peak RSS 3.1 GiB"}]}, open(tmp_path / "run.json", "w"))
    md = build_report(str(tmp_path)).markdown
    assert "12.3 CPU min in all." in md
    comp = md[md.index("## Compute"):]
    # per sample: the batch's CPU over its samples (one per batch here); methods share a sample's prefill
    assert "| niah_single_1 | 8k | 3 | 40 | 2.0 | 4.0 |" in comp
    assert "| niah_single_1 | 32k | 1 | 600 | 10.0 | 25.0 |" in comp
    assert "Total 12.0 CPU min" in comp
    cmds = md[md.index("## Commands"):]
    assert "| niah-8k | `oscar validate niah --lengths 8k` | 2.0 | 4.0 | peak RSS 3.1 GiB |" in cmds
    assert (tmp_path / "report" / "accuracy_vs_length.png").exists()


def test_report_without_batch_costs_has_no_compute_section(tmp_path):
    """Sample lines written before the cost fields (the committed SmolLM2 example): no section, no error."""
    from oscar.reports.build import build_report

    rows = [{k: v for k, v in r.items() if not k.startswith("batch_")}
            for r in _rows("niah_single_1", 1024, "bf16", [1, 0], [1.0, 1.0], [1.0, 1.0])]
    with open(tmp_path / "niah_samples.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    pd.DataFrame([{"suite": "ruler", "task": "niah_single_1", "method": "bf16", "length": 1024, "samples": 2,
                   "score": 50.0, "protocol": "serving"}]).to_parquet(tmp_path / "results.parquet", index=False)
    md = build_report(str(tmp_path)).markdown
    assert "## Compute" not in md and "## Commands" not in md
