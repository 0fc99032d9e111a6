"""lab/goal_cells.py: the goal's verdicts on planted needle and perplexity records, against hand counts."""

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest

_spec = importlib.util.spec_from_file_location(
    "_goal_cells", Path(__file__).resolve().parents[1] / "goal_cells.py")
goal = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(goal)

TASKS = ["niah_single_1", "niah_single_2"]


def _needles(d, model="smollm2-135m", seed=0, cells=None):
    """cells: {(task, length, method): list of 0/1 scores}, sample i of every arm is the same sample."""
    os.makedirs(d, exist_ok=True)
    json.dump({"identity": {"model": model, "seed": seed}, "config": {"seed": seed}}, open(os.path.join(d, "niah_config.json"), "w"))
    with open(os.path.join(d, "niah_samples.jsonl"), "w") as f:
        for (t, L, m), xs in cells.items():
            for i, x in enumerate(xs):
                f.write(json.dumps({"task": t, "length": L, "index": i, "method": m, "score": float(x)}) + "\n")
        f.write('{"task": "niah_single_1", "len')  # a line cut by a kill is skipped
    return str(d)


def _grid(n, oscar_miss=0, lengths=(1024, 2048, 4096), methods=("bf16", "oscar-int2")):
    cells = {}
    for t in TASKS:
        for L in lengths:
            for m in methods:
                xs = np.ones(n)
                if m == "oscar-int2" and L == 4096:
                    xs[:oscar_miss] = 0
                cells[(t, L, m)] = xs
    return cells


def test_identical_arms_pass_and_missing_cell_blocks_pass(tmp_path):
    d = _needles(tmp_path / "a", cells=_grid(300))
    r = goal.needle_goal(goal.read_needles([d], "oscar-int2"), goal.GOALS["smollm2"], "oscar-int2")
    assert r["verdict"] == "PASS" and [x["pairs"] for x in r["rows"]] == [600, 600, 600]
    assert all(x["diff"] == 0 and x["lo"] > -5 for x in r["rows"])
    d = _needles(tmp_path / "b", cells=_grid(300, lengths=(1024, 2048)))
    r = goal.needle_goal(goal.read_needles([d], "oscar-int2"), goal.GOALS["smollm2"], "oscar-int2")
    assert r["verdict"] == "UNRESOLVED" and r["not_measured"] == ["niah_single_1@4096", "niah_single_2@4096"]


def test_a_large_loss_is_missed_and_a_small_sample_unresolved(tmp_path):
    d = _needles(tmp_path / "a", cells=_grid(40, oscar_miss=16))  # -40 points at 4k on 80 pairs
    r = goal.needle_goal(goal.read_needles([d], "oscar-int2"), goal.GOALS["smollm2"], "oscar-int2")
    row = r["rows"][2]
    assert r["verdict"] == "MISSED" and row["diff"] == pytest.approx(-40.0) and row["hi"] < -5
    # per task over the lengths: 16 misses in 120 pairs (all at 4k), the same for both tasks
    assert r["by_task"]["niah_single_1"]["pairs"] == 120 and r["by_task"]["niah_single_1"]["diff"] == pytest.approx(-40 / 3)
    d = _needles(tmp_path / "b", cells=_grid(10))  # 20 pairs per length at the ceiling: too few to show "within 5"
    r = goal.needle_goal(goal.read_needles([d], "oscar-int2"), goal.GOALS["smollm2"], "oscar-int2")
    assert r["verdict"] == "UNRESOLVED" and all(x["resolve_pairs"] > 20 for x in r["rows"])


def test_missed_needs_the_adjusted_interval(tmp_path):
    """-12.5 points on 80 pairs: beyond -5 at 95 % (hi -5.3) but not at 1 - 0.05/3 (hi -3.2): UNRESOLVED."""
    d = _needles(tmp_path / "a", cells=_grid(40, oscar_miss=5))
    r = goal.needle_goal(goal.read_needles([d], "oscar-int2"), goal.GOALS["smollm2"], "oscar-int2")
    row = r["rows"][2]
    assert row["verdict"] == "MISSED" and row["hi"] < -5 and row["verdict_adjusted"] == "UNRESOLVED"
    assert r["verdict"] == "UNRESOLVED"


def test_bf16_pairs_across_runs_of_the_same_seed_only(tmp_path):
    a = _needles(tmp_path / "a", cells=_grid(30, methods=("bf16",)))
    b = _needles(tmp_path / "b", cells=_grid(30, methods=("oscar-int2",)))
    c = _needles(tmp_path / "c", seed=1, cells=_grid(30, methods=("oscar-int2",)))
    r = goal.needle_goal(goal.read_needles([a, b], "oscar-int2"), goal.GOALS["smollm2"], "oscar-int2")
    assert [x["pairs"] for x in r["rows"]] == [60, 60, 60]
    r = goal.needle_goal(goal.read_needles([a, c], "oscar-int2"), goal.GOALS["smollm2"], "oscar-int2")
    assert r["rows"] == [] and r["verdict"] == "not measured"
    # a run of another artifact lends its bf16 arm only: its oscar-int2 (all wrong) never fills a gap in b's
    cells = _grid(30)
    cells.update({k: np.zeros(30) for k in cells if k[2] == "oscar-int2"})
    other = _needles(tmp_path / "other", cells=cells)
    short = _needles(tmp_path / "short", cells=_grid(30, lengths=(1024, 2048), methods=("oscar-int2",)))
    r = goal.needle_goal(goal.read_needles([other, short], "oscar-int2", (other,)), goal.GOALS["smollm2"], "oscar-int2")
    assert [x["diff"] for x in r["rows"]] == [0.0, 0.0] and len(r["not_measured"]) == 2


def test_refuses_needles_of_another_model(tmp_path):
    d = _needles(tmp_path / "a", model="qwen2.5-0.5b", cells=_grid(5))
    with pytest.raises(SystemExit, match="qwen2.5-0.5b, not smollm2-135m"):
        goal.main(["--goal", "smollm2", "--niah", d, "--out", str(tmp_path / "g.json")])


def test_label_names_the_arm_that_ran_as_the_method(tmp_path):
    d = _needles(tmp_path / "a", cells=_grid(5))
    goal.main(["--goal", "smollm2", "--niah", d, "--label", "oscar-layer-copy-int2", "--out", str(tmp_path / "g.json")])
    md = (tmp_path / "g.md").read_text()
    assert md.startswith("**smollm2-135m**, oscar-layer-copy-int2 vs bf16") and "| oscar-layer-copy-int2 % |" in md
    assert json.load(open(tmp_path / "g.json"))["method"] == "oscar-int2"


def _ppl(d, ratio_by_protocol, windows=8, context=1024):
    """Windows whose oscar NLL is the bf16 NLL + log(ratio) per token, each with its 512-token segments."""
    os.makedirs(d, exist_ok=True)
    json.dump({"config": {"tokens": windows * context}}, open(os.path.join(d, "ppl_config.json"), "w"))
    rng = np.random.default_rng(0)
    with open(os.path.join(d, "ppl_windows.jsonl"), "w") as f:
        for w in range(windows):
            base = 2.5 + 0.2 * rng.standard_normal()
            cuts = [512, context - 1 - 512]
            rows = [("bf16", "-", 0.0)] + [("oscar-int2", p, np.log(r)) for p, r in ratio_by_protocol.items()]
            for m, p, add in rows:
                jitter = 0.002 * rng.standard_normal()
                seg = [[(base + add + jitter) * n, n] for n in cuts]
                f.write(json.dumps({"method": m, "protocol": p, "context": context, "window": w,
                                    "nll": sum(s for s, _ in seg), "count": context - 1, "seg": seg}) + "\n")
    return str(d)


def test_perplexity_limits_per_protocol(tmp_path):
    d = _ppl(tmp_path / "p", {"strict": 1.05, "serving": 1.03})
    r = goal.ppl_goal([d], goal.GOALS["qwen"], "oscar-int2")
    by = {x["protocol"]: x for x in r["rows"]}
    assert by["strict"]["ratio"] == pytest.approx(1.05, rel=2e-3) and r["strict"] == "PASS"
    assert by["serving"]["ratio"] == pytest.approx(1.03, rel=2e-3) and r["serving"] == "MISSED"
    assert goal.ppl_goal([], goal.GOALS["qwen"], "oscar-int2")["verdict"] == "not measured"


def test_each_text_alone_past_the_split(tmp_path):
    """A run past the held-out split (ppl_config.json `text`): the ratio on the split's whole windows and on the
    docstrings' whole windows, each against its own construction; the straddling window belongs to neither."""
    d = _ppl(tmp_path / "p", {"strict": 1.08}, windows=12)
    extra = _ppl(tmp_path / "q", {"strict": 1.02}, windows=12)  # the same layout, another ratio for windows >= 4
    rec = [json.loads(x) for x in open(os.path.join(d, "ppl_windows.jsonl"))]
    alt = [json.loads(x) for x in open(os.path.join(extra, "ppl_windows.jsonl"))]
    mixed = [a if a["window"] < 4 else b for a, b in zip(rec, alt)]
    with open(os.path.join(d, "ppl_windows.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in mixed)
    cfg = json.load(open(os.path.join(d, "ppl_config.json")))
    cfg["text"] = {"split_tokens": 3 * 1024 + 500, "docstring_tokens": 12 * 1024 - 3 * 1024 - 500, "python": "3.11.7"}
    json.dump(cfg, open(os.path.join(d, "ppl_config.json"), "w"))
    row = goal.ppl_goal([d], goal.GOALS["qwen"], "oscar-int2")["rows"][0]
    split, docs = row["by_text"]["split"], row["by_text"]["docstrings"]
    assert split["windows"] == 3 and split["block"] == "segment" and split["ratio"] == pytest.approx(1.08, rel=2e-3)
    assert docs["windows"] == 8 and docs["block"] == "window" and docs["ratio"] == pytest.approx(1.02, rel=2e-3)
    assert 1.02 < row["ratio"] < 1.08  # window 3 (the straddling one, at 1.08) counts in the whole only
    res = {"goal": goal.GOALS["qwen"], "method": "oscar-int2", "label": "oscar-int2",
           "inputs": {"niah": [], "bf16": [], "ppl": [d]}, "needles": goal.needle_goal({}, goal.GOALS["qwen"], "oscar-int2"),
           "ppl": goal.ppl_goal([d], goal.GOALS["qwen"], "oscar-int2")}
    md = goal.markdown(res)
    assert "perplexity only" in md and "| strict | 1024 | 1.080" in md and "(8 windows) |" in md
    _ppl(tmp_path / "r", {"strict": 1.08})  # no `text`: no per-text rows
    assert "by_text" not in goal.ppl_goal([str(tmp_path / "r")], goal.GOALS["qwen"], "oscar-int2")["rows"][0]


def test_a_second_look_reads_a_wider_interval(tmp_path):
    """--looks 2 (a larger run decided after a straddling look): intervals at 97.5 %, strictly wider than at 95 %,
    around the same ratio; a ratio whose 95 % interval just clears the limit no longer passes at 97.5 %."""
    d = _ppl(tmp_path / "p", {"serving": 1.0}, windows=40)
    one = goal.ppl_goal([d], goal.GOALS["qwen"], "oscar-int2")["rows"][0]
    two = goal.ppl_goal([d], goal.GOALS["qwen"], "oscar-int2", looks=2)["rows"][0]
    assert two["ratio"] == one["ratio"] and two["level"] == pytest.approx(0.975) and one["level"] == pytest.approx(0.95)
    assert two["lo"] < one["lo"] < one["ratio"] < one["hi"] < two["hi"]
    lim = (one["hi"] + two["hi"]) / 2  # between the two upper bounds
    g = dict(goal.GOALS["qwen"], serving=lim)
    assert goal.ppl_goal([d], g, "oscar-int2")["serving"] == "PASS"
    assert goal.ppl_goal([d], g, "oscar-int2", looks=2)["serving"] == "UNRESOLVED"


def test_needles_on_a_second_look(tmp_path):
    """--looks 2 for needles: the pooled difference's interval at 97.5 %, wider than at 95 % around the same
    difference, the rule says so, and the table's header names the level."""
    d = _needles(tmp_path / "n", cells=_grid(40, oscar_miss=3))
    done = goal.read_needles([d], "oscar-int2")
    one, two = goal.needle_goal(done, goal.GOALS["smollm2"], "oscar-int2"), goal.needle_goal(done, goal.GOALS["smollm2"], "oscar-int2", 2)
    for a, b in zip(one["rows"], two["rows"]):
        assert a["diff"] == b["diff"] and b["lo"] < a["lo"] <= a["hi"] < b["hi"] and b["level"] == pytest.approx(0.975)
    assert "look 2" in two["rule"] and "look" not in one["rule"]
    goal.main(["--goal", "smollm2", "--niah", d, "--looks", "2", "--out", str(tmp_path / "g.json")])
    assert "difference [97.5 %]" in (tmp_path / "g.md").read_text()
