"""RULER-layout outputs of a needle run: summary.csv (RULER's evaluate.py layout), results.json
(lm-evaluation-harness's layout) and the report's main table, all from the same per-sample rows."""

import json
import math
import os

import glob

import pandas as pd
import pytest
from lm_eval.utils import make_table  # lm-evaluation-harness's own table code (installed --no-deps for the tests)

from oscar.validate import ruler_outputs as ro
from oscar.validate.evidence import read_samples

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _row(t, L, i, m, score, pred="x"):
    return {"task": t, "length": L, "index": i, "method": m, "score": score, "pred": pred, "answers": ["a"],
            "metric": "part" if t.startswith("qa") else "all", "protocol": "serving"}


def _done() -> dict:
    rows = []
    # bf16 at 1024: niah_single_1 1,1,0 -> 66.67; vt 0.6,0.2,1.0 -> 60.0; qa_1 1,0,0 -> 33.33 (one empty answer)
    for i, s in enumerate([1, 1, 0]):
        rows.append(_row("niah_single_1", 1024, i, "bf16", s))
    for i, s in enumerate([0.6, 0.2, 1.0]):
        rows.append(_row("vt", 1024, i, "bf16", s))
    for i, (s, p) in enumerate([(1, "Paris"), (0, " \n\x00 "), (0, "Lyon")]):
        rows.append(_row("qa_1", 1024, i, "bf16", s, p))
    # bf16 at 2048: niah_single_1 only (vt and qa_1 have no samples there)
    for i, s in enumerate([1, 0, 0, 0]):
        rows.append(_row("niah_single_1", 2048, i, "bf16", s))
    # kivi2 at 1024: niah_single_1 0,0,1; vt 0,0,0
    for i, s in enumerate([0, 0, 1]):
        rows.append(_row("niah_single_1", 1024, i, "kivi2", s))
    for i in range(3):
        rows.append(_row("vt", 1024, i, "kivi2", 0.0, ""))
    return {(r["task"], r["length"], r["index"], r["method"]): r for r in rows}


def test_summary_csv_is_rulers_layout(tmp_path):
    paths = ro.write_ruler_outputs(str(tmp_path), _done())
    p = tmp_path / "ruler" / "bf16" / "1024" / "summary.csv"
    assert str(p) in paths
    # hand-computed, RULER's task order (vt before qa_1), scores x100 rounded to 2 decimals, nulls after cleanup
    assert p.read_text() == ("0,1,2,3\n"
                             "Tasks,niah_single_1,vt,qa_1\n"
                             "Score,66.67,60.0,33.33\n"
                             "Nulls,0/3,0/3,1/3\n")
    # byte for byte what RULER's write_evaluation writes (pd.DataFrame(rows).to_csv(index=False))
    rows = [["Tasks", "niah_single_1", "vt", "qa_1"], ["Score", 66.67, 60.0, 33.33], ["Nulls", "0/3", "0/3", "1/3"]]
    assert p.read_text() == pd.DataFrame(rows).to_csv(index=False)
    assert (tmp_path / "ruler" / "kivi2" / "1024" / "summary.csv").read_text().splitlines()[3] == "Nulls,0/3,3/3"
    assert (tmp_path / "ruler" / "bf16" / "2048" / "summary.csv").read_text().splitlines()[1] == "Tasks,niah_single_1"
    assert not (tmp_path / "ruler" / "kivi2" / "2048").exists()


def test_results_json_is_lm_eval_layout(tmp_path):
    ro.write_ruler_outputs(str(tmp_path), _done(), {"model": "smollm2-135m"})
    j = json.load(open(tmp_path / "ruler" / "bf16" / "results.json"))
    res = j["results"]
    # lm-evaluation-harness's names and "<length>,none" keys, 0-1 scale, -1 for a length without samples
    assert set(res) == {"ruler", "niah_single_1", "ruler_vt", "ruler_qa_squad"}
    assert res["niah_single_1"]["1024,none"] == pytest.approx(2 / 3, abs=1e-6)
    assert res["niah_single_1"]["2048,none"] == pytest.approx(0.25)
    assert res["ruler_vt"]["1024,none"] == pytest.approx(0.6) and res["ruler_vt"]["2048,none"] == -1
    assert res["ruler_qa_squad"]["2048,none"] == -1 and res["ruler_qa_squad"]["2048_stderr,none"] == "N/A"
    # the stderr of each cell's mean from its sample lines (sample sd over sqrt(n), as lm-eval's mean_stderr)
    assert res["niah_single_1"]["1024_stderr,none"] == pytest.approx(math.sqrt(1 / 3) / math.sqrt(3), abs=1e-6)
    assert res["ruler_vt"]["1024_stderr,none"] == pytest.approx(0.4 / math.sqrt(3), abs=1e-6)  # 0.6, 0.2, 1.0: sd 0.4
    se = [res[t]["1024_stderr,none"] for t in ("niah_single_1", "ruler_vt", "ruler_qa_squad")]
    assert res["ruler"]["1024_stderr,none"] == pytest.approx(math.sqrt(sum(x * x for x in se)) / 3, abs=1e-6)
    # plain aliases (the harness indents subtasks itself), the group also under `groups`, zero-shot, versions
    assert res["niah_single_1"]["alias"] == "niah_single_1" and res["ruler"]["alias"] == "ruler"
    assert j["groups"] == {"ruler": res["ruler"]} and j["n-shot"]["ruler"] == 0 and j["versions"]["ruler_vt"] == 1.0
    assert set(j["configs"]) == set(j["n-samples"]) == set(res) - {"ruler"}
    assert res["ruler"]["1024,none"] == pytest.approx((2 / 3 + 0.6 + 1 / 3) / 3, abs=1e-6)
    assert res["ruler"]["2048,none"] == pytest.approx(0.25)  # the tasks run at that length
    assert j["group_subtasks"]["ruler"] == ["niah_single_1", "ruler_vt", "ruler_qa_squad"]
    assert j["n-samples"]["niah_single_1"] == {"original": 7, "effective": 7}
    assert j["config"]["model"] == "smollm2-135m" and j["config"]["lengths"] == [1024, 2048]
    kivi = json.load(open(tmp_path / "ruler" / "kivi2" / "results.json"))["results"]
    assert kivi["ruler"]["2048,none"] == -1 and kivi["ruler"]["1024,none"] == pytest.approx((1 / 3 + 0) / 2, abs=1e-6)
    lo, hi = j["oscar_intervals"]["ruler"]["1024"]
    assert lo <= res["ruler"]["1024,none"] <= hi


def _results_jsons(tmp_path) -> list[str]:
    """Every results.json the product writes: the synthetic run's here and the committed examples'."""
    ro.write_ruler_outputs(str(tmp_path), _done(), {"model": "smollm2-135m"})
    mine = sorted(glob.glob(str(tmp_path / "ruler" / "*" / "results.json")))
    examples = sorted(glob.glob(os.path.join(ROOT, "reports", "examples", "**", "ruler", "*", "results.json"),
                                recursive=True))
    assert len(mine) == 2 and len(examples) >= 10
    return mine + examples


def _rows(table: str) -> list[list[str]]:
    return [[c.strip() for c in l.strip().strip("|").split("|")] for l in table.splitlines()[2:] if l.strip()]


def test_lm_eval_make_table_reads_every_results_json(tmp_path):
    """lm-evaluation-harness prints our results.json as it prints its own: its make_table reads both the `results`
    and the `groups` sections; subtasks indented once under the group; a stderr on every cell with 2+ samples."""
    for p in _results_jsons(tmp_path):
        j = json.load(open(p))
        table, groups = make_table(j), make_table(j, "groups")
        rows, grows = _rows(table), _rows(groups)
        names = [r[0] for r in rows if r[0]]
        assert names[0] == "ruler", (p, names)
        # one " - " level per subtask: an alias carrying its own " - " would print " -  - niah_single_1"
        assert set(names) == {"ruler"} | {f"- {t}" for t in j["group_subtasks"]["ruler"]}, (p, names)
        assert [r[0] for r in grows if r[0]] == ["ruler"], p
        lengths = j["config"]["lengths"]
        assert len(rows) == len(lengths) * len(j["results"]) and len(grows) == len(lengths), p
        for r in rows + grows:
            # Tasks | Version | Filter | n-shot | Metric | | Value | | Stderr
            assert r[2] == "none" and r[3] == "0" and r[4] in {str(L) for L in lengths} and r[5] == "↑", (p, r)
            if float(r[6]) != -1:  # -1: no samples at that length (stderr N/A, as the harness writes it)
                assert 0 <= float(r[6]) <= 1 and r[7] == "±" and r[8] != "N/A" and float(r[8]) >= 0, (p, r)


def test_committed_results_json_follow_from_their_sample_lines():
    """The committed examples' results.json are what the writer gives from their niah_samples.jsonl today."""
    for p in glob.glob(os.path.join(ROOT, "reports", "examples", "**", "ruler", "*", "results.json"), recursive=True):
        j = json.load(open(p))
        out = os.path.dirname(os.path.dirname(os.path.dirname(p)))
        cs = ro.cells(read_samples(os.path.join(out, "niah_samples.jsonl")))
        cfg = {k: v for k, v in j["config"].items() if k not in ("method", "lengths")}
        assert j == json.loads(json.dumps(ro.results_json(cs, j["config"]["method"], cfg, j["config"]["lengths"]))), p


def test_one_recomputed_from_the_other(tmp_path):
    """results.json's values follow from summary.csv's (to its 2-decimal rounding), and back."""
    ro.write_ruler_outputs(str(tmp_path), _done())
    for m in ("bf16", "kivi2"):
        j = json.load(open(tmp_path / "ruler" / m / "results.json"))["results"]
        for d in sorted(os.listdir(tmp_path / "ruler" / m)):
            if not d.isdigit():
                continue
            summ = ro.read_summary_csv(str(tmp_path / "ruler" / m / d / "summary.csv"))
            for t, (score, _) in summ.items():
                assert j[ro.lm_eval_name(t)][f"{d},none"] == pytest.approx(score / 100, abs=5e-5)
                assert round(100 * j[ro.lm_eval_name(t)][f"{d},none"], 2) == score
            mean = sum(s for s, _ in summ.values()) / len(summ) / 100
            assert j["ruler"][f"{d},none"] == pytest.approx(mean, abs=5e-5)


def test_average_intervals():
    cs = ro.cells(_done())
    est, lo, hi, k = ro.average(cs, "bf16", 1024)
    assert k == 3 and est == pytest.approx((2 / 3 + 0.6 + 1 / 3) / 3) and 0 <= lo < est < hi <= 1
    # equal 0/1 samples: the pooled Wilson interval of one cell
    from oscar.validate.intervals import wilson

    est, lo, hi, k = ro.average(cs, "bf16", 2048)
    assert (lo, hi) == pytest.approx(wilson(1, 4)) and est == 0.25
    # unequal counts: a per-task bootstrap, still around the mean over tasks
    est, lo, hi = ro.overall(cs, "bf16")
    assert est == pytest.approx((2 / 3 + 0.6 + 1 / 3 + 0.25) / 4) and lo < est < hi
    assert math.isnan(ro.average(cs, "kivi2", 2048)[0])


def _report_dir(tmp_path, skipped=None):
    from oscar.validate.evidence import niah_stats

    done = _done()
    with open(tmp_path / "niah_samples.jsonl", "w") as f:
        for r in done.values():
            f.write(json.dumps(r) + "\n")
    rows = [{"suite": "ruler", "protocol": "serving", "model": "m", **st} for st in niah_stats(done)]
    pd.DataFrame(rows).to_parquet(tmp_path / "results.parquet", index=False)
    cfg = {"identity": {}, "config": {"protocol": "serving", "corpus": "pydoc", "samples": 3}}
    if skipped:
        cfg["skipped_tasks"] = skipped
    json.dump(cfg, open(tmp_path / "niah_config.json", "w"))
    ro.write_ruler_outputs(str(tmp_path), done)
    return str(tmp_path)


def _main_table(md: str) -> dict[str, list[str]]:
    """The first table of the RULER section."""
    sec = md[md.index("## RULER-style tasks"):].splitlines()
    start = next(i for i, l in enumerate(sec) if l.startswith("|"))
    lines = [l for l in sec[start:][: next(i for i, l in enumerate(sec[start:]) if not l.startswith("|"))]]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in l.strip("|").split("|")] for l in lines[2:])}
    return {"head": head[1:], **rows}


def test_report_main_table_matches_results_json(tmp_path):
    from oscar.reports.build import build_report

    d = _report_dir(tmp_path, {"qa_2": "no --hotpotqa file (a HotpotQA JSON file) given"})
    md = build_report(d).markdown
    t = _main_table(md)
    assert t["head"] == ["1k", "2k", "Avg."]
    for m in ("bf16", "kivi2"):
        j = json.load(open(os.path.join(d, "ruler", m, "results.json")))
        for L, cell in zip((1024, 2048), t[m]):
            v = j["results"]["ruler"][f"{L},none"]
            if v == -1:
                assert cell == "—"
            else:
                assert cell.startswith(f"{100 * v:.1f} [")  # every cell carries its interval
                lo, hi = j["oscar_intervals"]["ruler"][str(L)]
                assert cell.endswith(f"[{100 * lo:.0f}–{100 * hi:.0f}]")
    assert "Skipped: qa_2 — no --hotpotqa file" in md
    assert "Tasks run: niah_single_1, vt, qa_1 (3 of RULER's 13)" in md
    # where the protocol differs from RULER's is stated beside the table
    for s in ("written here", "Samples per task and length: 3–4 here (RULER's default is 500)", "chat template",
              "ruler/<method>/<length>/summary.csv", "results.json"):
        assert s in md, s
    # the per-task breakdown follows the main table
    assert md.index("### Per task") > md.index("Tasks run:") and "#### qa_1" in md
