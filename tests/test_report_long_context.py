"""The report of a multi-command run (reports/examples/qwen2.5-0.5b): the needle cost per sample from the
batch costs niah_samples.jsonl records, the commands of run.json's steps, and a 0-of-n cell (Wilson's
lower bound is a rounding error above 0) plotted without error."""

from __future__ import annotations

import json

import pandas as pd

from oscar.reports.build import build_report, run_time


def _rows(task, L, method, scores, cpu, wall):
    return [{"task": task, "length": L, "index": i, "method": method, "score": s, "pred": "", "answers": ["1"],
             "metric": "all", "prompt_tokens": L, "protocol": "serving", "batch_samples": 1,
             "batch_cpu_s": cpu[i], "batch_wall_s": wall[i]} for i, s in enumerate(scores)]


def test_report_lists_needle_cost_and_commands(tmp_path):
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

    rows = [{k: v for k, v in r.items() if not k.startswith("batch_")}
            for r in _rows("niah_single_1", 1024, "bf16", [1, 0], [1.0, 1.0], [1.0, 1.0])]
    with open(tmp_path / "niah_samples.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    pd.DataFrame([{"suite": "ruler", "task": "niah_single_1", "method": "bf16", "length": 1024, "samples": 2,
                   "score": 50.0, "protocol": "serving"}]).to_parquet(tmp_path / "results.parquet", index=False)
    md = build_report(str(tmp_path)).markdown
    assert "## Compute" not in md and "## Commands" not in md


def test_report_checks_state_only_what_the_run_measured(tmp_path):
    """A run of niah_single_1 at 1k alone: the checks name that cell (not niah_single_1/2 at 1k-4k, which it never
    ran), and an oscar-int2 equal to bf16 reads "0.0 points", never "-0.0"."""

    rows = []
    for m, sc in (("bf16", [1] * 20), ("oscar-int2", [1] * 20), ("naive-int2", [0] * 20)):
        rows += _rows("niah_single_1", 1024, m, sc, [1.0] * 20, [1.0] * 20)
    with open(tmp_path / "niah_samples.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    pd.DataFrame([{"suite": "ruler", "task": "niah_single_1", "method": m, "length": 1024, "samples": 20,
                   "score": s, "protocol": "serving"} for m, s in (("bf16", 100.0), ("oscar-int2", 100.0),
                                                                   ("naive-int2", 0.0))]
                 ).to_parquet(tmp_path / "results.parquet", index=False)
    md = build_report(str(tmp_path)).markdown
    checks = md[md.index("| check |"):].split("\n\n")[0]
    assert "| bf16 >= 90% on niah_single_1 at 1k |" in checks
    assert "niah_single_2" not in checks and "1k-4k" not in checks and "2k" not in checks and "4k" not in checks
    assert "largest gap 0.0 points" in checks
    assert "-0.0" not in md and "−0.0" not in md


def test_paired_checks_use_only_cells_both_methods_measured(tmp_path):
    """oscar-int2 run at 1k only, bf16 at 1k and 2k: the paired check covers 1k and says so."""
    from oscar.reports.build import acceptance

    rows = []
    for L in (1024, 2048):
        rows += _rows("niah_single_1", L, "bf16", [1] * 20, [1.0] * 20, [1.0] * 20)
    rows += _rows("niah_single_1", 1024, "oscar-int2", [1] * 19 + [0], [1.0] * 20, [1.0] * 20)
    from oscar.validate.evidence import niah_stats

    done = {(r["task"], r["length"], r["index"], r["method"]): r for r in rows}
    res = pd.DataFrame([{"suite": "ruler", **{k: s[k] for k in ("task", "length", "method", "samples", "score")}}
                        for s in niah_stats(done)])
    c = {x[0]: x[1:] for x in acceptance(res, None, done)}
    assert "bf16 >= 90% on niah_single_1 at 1k-2k" in c
    v, det = c["oscar-int2 within 5 points of bf16 (paired)"]
    assert det.startswith("on niah_single_1 at 1k: largest gap 5.0 points") and v in ("UNRESOLVED", "MISSED", "PASS")


def test_numbers_never_print_negative_zero():
    from oscar.reports.build import md_table, num, scope_label

    assert [num(x) for x in (-0.0, -0.04, 0.0, -1.26, 2.0)] == ["0.0", "0.0", "0.0", "-1.3", "2.0"]
    assert num(-0.0, "+.1f") == "+0.0" and num(-0.2, "+.0f") == "+0" and num(float("nan")) == "nan"
    assert md_table(["x"], [[-0.0], [-0.0001]]).splitlines()[2:] == ["| 0 |", "| -0.0001 |"]
    assert scope_label(["niah_single_1", "niah_single_2"], [1024, 2048, 4096], [1024, 2048, 4096]) == \
        "niah_single_1/2 at 1k-4k"
    assert scope_label(["niah_single_1"], [1024, 4096], [1024, 2048, 4096]) == "niah_single_1 at 1k, 4k"
    assert scope_label(["niah_single_2"], [2048], [1024, 2048, 4096]) == "niah_single_2 at 2k"


def test_a_resumed_run_states_its_last_invocation_wall_time():
    one = {"wall_seconds": 120.0, "total_seconds": 110.0, "stage_seconds": {"calibrate": 60.0, "niah": 50.0}}
    assert run_time(one).startswith("2.0 min wall from the command's start to the report (stages 1.8 min")
    # stages summed over invocations past this invocation's wall time: it resumed, and says so
    resumed = {**one, "wall_seconds": 60.0, "total_seconds": 600.0, "stage_seconds": {"calibrate": 550.0, "niah": 50.0}}
    got = run_time(resumed)
    assert got.startswith("1.0 min wall for its last invocation, which resumed the run (stages, summed over every "
                          "invocation, 10.0 min: calibrate 550 s, niah 50 s)"), got
