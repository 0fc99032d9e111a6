"""`--tasks all` on `oscar validate niah` and `oscar run`: every task the inputs allow, the others named with the
reason (stderr, niah_config.json, the report); QA tasks without their file or with a bad file refused in one line
before any model is loaded."""

import json

import pytest
from lm_eval.utils import make_table

from helpers.ruler_files import hotpot_file, squad_file
from oscar.__main__ import main
from oscar.common import OscarError


def _run(argv, capsys) -> tuple[int, str]:
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 2
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["validate", "niah", "--tasks", "niah_single_1,qa_1"], "task qa_1 needs --squad PATH"),
    (["validate", "niah", "--tasks", "qa_2", "--squad", "{squad}"], "task qa_2 needs --hotpotqa PATH"),
    (["validate", "niah", "--tasks", "all", "--squad", "{bad}"], r"--squad {bad}: record data[0].paragraphs[0].qas[1]"),
    (["validate", "niah", "--tasks", "qa_2", "--hotpotqa", "{squad}"], "--hotpotqa {squad}: not HotpotQA's layout"),
    (["run", "--no-ray", "--tasks", "qa_2"], "task qa_2 needs --hotpotqa PATH"),
    (["run", "--no-ray", "--tasks", "all", "--hotpotqa", "{bad}"], "--hotpotqa {bad}: not HotpotQA's layout"),
])
def test_refused_in_one_line_before_any_work(argv, says, tmp_path, capsys):
    squad = squad_file(tmp_path / "squad.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"data": [{"paragraphs": [{"context": "c", "qas": [
        {"question": "q", "answers": [{"text": "a"}]}, {"question": "q2"}]}]}]}))
    fill = {"{squad}": squad, "{bad}": str(bad)}
    argv = [fill.get(a, a) for a in argv] + ["--out", str(tmp_path / "out")]
    says = says.replace("{bad}", str(bad)).replace("{squad}", squad)
    rc, err = _run(argv, capsys)
    assert rc == 2 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], err
    assert not (tmp_path / "out" / "niah_samples.jsonl").exists()


def test_run_config_checks_tasks_early(tmp_path):
    from oscar.run import RunConfig

    cfg = RunConfig(out=str(tmp_path), tasks=["all"], hotpotqa=hotpot_file(tmp_path / "h.json"))
    assert cfg.skipped_tasks == {"qa_1": "no --squad file (a SQuAD v1.1 / v2.0 JSON file) given"}
    assert RunConfig(out=str(tmp_path), tasks="niah_single_1,vt").tasks == ["niah_single_1", "vt"]
    with pytest.raises(OscarError, match="unknown task 'nope'"):
        RunConfig(out=str(tmp_path), tasks=["nope"])


@pytest.mark.slow
def test_tasks_all_runs_what_the_inputs_allow(tmp_path, capsys):
    """A random-init tiny model (scores are not the point): one sample of every task at 1k, qa_1 from a SQuAD
    file, qa_2 skipped for want of a HotpotQA file; the RULER files and the report say so."""
    import torch

    from oscar.reports.build import build_report
    from oscar.validate.ruler_outputs import read_summary_csv
    from oscar.validate.env import load_model
    from oscar.validate.niah import NiahConfig, run_niah
    from oscar.validate.ruler import TASKS

    torch.set_num_threads(1)
    model = load_model("tiny-llama")
    squad = squad_file(tmp_path / "squad.json")
    out = tmp_path / "out"
    cfg = NiahConfig(out=str(out), methods=["bf16"], tasks=["all"], lengths=[1024], samples=1, squad=squad,
                     dtype="float32")
    df = run_niah(cfg, loaded=model, progress=False, workers=1)
    err = capsys.readouterr().err
    assert "--tasks all: skipping qa_2 (no --hotpotqa file" in err
    ran = [t for t in TASKS if t != "qa_2"]
    assert sorted(df.task) == sorted(ran)
    rec = json.load(open(out / "niah_config.json"))
    assert list(rec["skipped_tasks"]) == ["qa_2"] and rec["qa_files"]["squad"]["path"] == squad
    summ = read_summary_csv(str(out / "ruler" / "bf16" / "1024" / "summary.csv"))
    assert list(summ) == ran  # RULER's task order
    lm = json.load(open(out / "ruler" / "bf16" / "results.json"))
    res = lm["results"]
    assert "ruler_qa_squad" in res and "ruler_qa_hotpot" not in res and "ruler" in res
    # lm-evaluation-harness's own table code prints it: the group, then each task run one level under it
    table = make_table(lm)
    assert table.count("| - ") == len(ran) and "| - ruler_qa_squad" in table and "|ruler " in table
    md = build_report(str(out)).markdown
    assert "Skipped: qa_2 — no --hotpotqa file" in md and "(12 of RULER's 13)" in md
    # the QA file's samples stay tied to that file: another one on the same OUT is refused
    other = squad_file(tmp_path / "other.json", v2=False)
    with pytest.raises(OscarError, match="holds squad samples from"):
        run_niah(NiahConfig(**{**cfg.__dict__, "squad": other}), loaded=model, progress=False, workers=1)
