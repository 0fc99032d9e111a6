"""RULER tables people can put beside published ones, from the per-sample needle rows (no torch).

One source, three renderings: the rows of niah_samples.jsonl (`oscar.validate.evidence.read_samples`) give

- OUT/ruler/<method>/<length>/summary.csv — RULER's `pred/summary.csv` (NVIDIA/RULER
  `scripts/eval/evaluate.py`): pandas' default header line of column numbers, then the rows `Tasks`,
  `Score` (the task's metric in %, rounded to 2 decimals as RULER's metric functions do) and `Nulls`
  ("empty/total" predictions after RULER's cleanup), one column per task in RULER's task order;
- OUT/ruler/<method>/results.json — lm-evaluation-harness's results.json for its `ruler` group task
  (`lm_eval/tasks/ruler`), readable by `lm_eval.utils.make_table`: {"results": {"ruler": {"4096,none": mean
  over tasks, "4096_stderr,none": ...}, "niah_single_1": {...}, "ruler_vt": ...}, "groups", "group_subtasks",
  "versions", "n-shot", "higher_is_better", "n-samples", "configs"}, 0-1 scale, a stderr from the sample
  lines, a length without samples -1, task names as the harness spells them (vt, cwe, fwe, qa_1, qa_2 ->
  ruler_vt, ruler_cwe, ruler_fwe, ruler_qa_squad, ruler_qa_hotpot);
- the report's main RULER table (reports/build.py): methods x lengths, the mean over the tasks run
  (RULER's paper layout) with a 95 % interval.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re

import numpy as np

from oscar.validate.evidence import score_interval

# RULER's task order (scripts/synthetic.yaml): the columns of summary.csv and the rows of the report.
RULER_ORDER = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
               "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2"]
# lm-evaluation-harness's names for the tasks whose RULER name it prefixes.
LM_EVAL_NAMES = {"vt": "ruler_vt", "cwe": "ruler_cwe", "fwe": "ruler_fwe", "qa_1": "ruler_qa_squad",
                 "qa_2": "ruler_qa_hotpot"}

_CTRL = re.compile(r"[\x00-\x1f]")


def postprocess(pred: str) -> str:
    """RULER's prediction cleanup: control characters become newlines, then strip."""
    return _CTRL.sub("\n", pred.strip()).strip()


def lm_eval_name(task: str) -> str:
    return LM_EVAL_NAMES.get(task, task)


def task_order(tasks) -> list[str]:
    """Tasks in RULER's order (unknown names after, in the order given)."""
    tasks = list(dict.fromkeys(tasks))
    return [t for t in RULER_ORDER if t in tasks] + [t for t in tasks if t not in RULER_ORDER]


def cells(done: dict) -> dict[tuple, dict]:
    """(method, length, task) -> {"scores": [0-1 per sample, by index], "nulls": empty predictions, "n": samples}."""
    out: dict[tuple, dict] = {}
    for (t, L, i, m), r in sorted(done.items(), key=lambda kv: (kv[0][3], kv[0][1], kv[0][0], kv[0][2])):
        c = out.setdefault((m, int(L), t), {"scores": [], "nulls": 0, "n": 0})
        c["scores"].append(float(r["score"]))
        c["nulls"] += int(len(postprocess(str(r.get("pred", "")))) == 0)
        c["n"] += 1
    return out


def methods_of(cs: dict) -> list[str]:
    return list(dict.fromkeys(m for m, _, _ in cs))


def lengths_of(cs: dict, method: str | None = None) -> list[int]:
    return sorted({L for m, L, _ in cs if method is None or m == method})


def tasks_of(cs: dict, method: str | None = None, length: int | None = None) -> list[str]:
    return task_order(t for m, L, t in cs if (method is None or m == method) and (length is None or L == length))


def task_score(c: dict) -> float:
    """A cell's score on the 0-1 scale (the mean of its samples' scores)."""
    return float(np.mean(c["scores"])) if c["n"] else float("nan")


def ruler_percent(c: dict) -> float:
    """A cell's score as RULER's summary.csv writes it: the metric in %, rounded to 2 decimals."""
    return round(sum(c["scores"]) / c["n"] * 100, 2)  # as RULER: sum / len * 100, then round


def mean_over(strata: list[dict], level: float = 0.95, boot: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """(mean of the cells' scores, lo, hi) on the 0-1 scale: RULER's average over tasks (or over task x length).

    The interval: with the same number of samples in every cell the mean over cells is the mean of the pooled
    samples, and its interval is that of one cell (oscar.validate.evidence.score_interval: Wilson for 0/1 scores,
    bootstrap otherwise); with unequal counts, a percentile bootstrap resampling each cell's samples on its own."""
    if not strata:
        return float("nan"), float("nan"), float("nan")
    est = float(np.mean([task_score(c) for c in strata]))
    if len({c["n"] for c in strata}) == 1:
        lo, hi, _ = score_interval([x for c in strata for x in c["scores"]], level)
        return est, lo / 100, hi / 100
    rng = np.random.default_rng(seed)
    draws = np.zeros(boot)
    for c in strata:
        x = np.asarray(c["scores"], float)
        draws += x[rng.integers(0, len(x), size=(boot, len(x)))].mean(1)
    draws /= len(strata)
    a = (1 - level) / 2
    return est, float(np.quantile(draws, a)), float(np.quantile(draws, 1 - a))


def average(cs: dict, method: str, length: int, level: float = 0.95) -> tuple[float, float, float, int]:
    """(mean over the tasks run at `length` of their scores, lo, hi, tasks): RULER's per-length average."""
    per = [cs[(method, length, t)] for t in tasks_of(cs, method, length)]
    return (*mean_over(per, level), len(per))


def overall(cs: dict, method: str, level: float = 0.95) -> tuple[float, float, float]:
    """The mean over every (task, length) cell of `method`, with its interval (the table's Avg. column)."""
    return mean_over([c for (m, _, _), c in cs.items() if m == method], level)


# ----------------------------------------------------------------- RULER's summary.csv


def summary_rows(cs: dict, method: str, length: int) -> list[list]:
    """RULER's three rows for one (method, length): Tasks, Score, Nulls."""
    tasks = tasks_of(cs, method, length)
    sc = [ruler_percent(cs[(method, length, t)]) for t in tasks]
    nulls = [f"{cs[(method, length, t)]['nulls']}/{cs[(method, length, t)]['n']}" for t in tasks]
    return [["Tasks"] + tasks, ["Score"] + sc, ["Nulls"] + nulls]


def summary_csv(cs: dict, method: str, length: int) -> str:
    """summary.csv's text as RULER's `pd.DataFrame(rows).to_csv(index=False)` writes it."""
    rows = summary_rows(cs, method, length)
    f = io.StringIO()
    w = csv.writer(f, lineterminator="\n")
    w.writerow(range(len(rows[0])))
    w.writerows(rows)
    return f.getvalue()


def read_summary_csv(path: str) -> dict[str, tuple[float, str]]:
    """task -> (score in %, nulls) from a RULER summary.csv (ours or RULER's own)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    byname = {r[0]: r[1:] for r in rows[1:]}
    return {t: (float(s), n) for t, s, n in zip(byname["Tasks"], byname["Score"], byname["Nulls"])}


# ----------------------------------------------------------------- lm-evaluation-harness results.json


# lm-evaluation-harness's task versions for its ruler tasks (lm_eval/tasks/ruler/*.yaml `metadata.version`) and group.
LM_EVAL_TASK_VERSION = 1.0
LM_EVAL_GROUP_VERSION = 1


def mean_stderr(scores: list[float]) -> float | str:
    """The standard error of a mean of per-sample scores, as lm-evaluation-harness's `mean_stderr` computes it
    (sample standard deviation, n - 1, over sqrt(n); for 0/1 scores the binomial one); "N/A" below 2 samples,
    as the harness writes it."""
    n = len(scores)
    return float(np.std(scores, ddof=1) / np.sqrt(n)) if n > 1 else "N/A"


def group_stderr(stderrs: list) -> float | str:
    """The standard error of an unweighted mean over tasks (the `ruler` group: weight_by_size false), from the
    tasks' own: sqrt(sum se_i^2) / k. With equal samples per task it equals the harness's pooled_sample_stderr;
    "N/A" where a task has none, as the harness writes it."""
    if not stderrs or any(isinstance(s, str) for s in stderrs):
        return "N/A"
    return float(np.sqrt(np.sum(np.square(stderrs))) / len(stderrs))


def _cell(value: float, stderr) -> tuple:
    """(value, stderr) as the harness writes a ruler metric: -1 and "N/A" for a length without samples."""
    if value != value:
        return -1, "N/A"
    return round(value, 6), stderr if isinstance(stderr, str) else round(stderr, 6)


def results_json(cs: dict, method: str, config: dict | None = None, lengths: list[int] | None = None) -> dict:
    """lm-evaluation-harness's results.json for its `ruler` group task (the layout lm_eval 0.4.12+ writes and
    `lm_eval.utils.make_table` reads): per task and for the group one "<length>,none" metric per length on the
    0-1 scale with its "<length>_stderr,none" from the sample lines (-1 and "N/A": no samples at that length);
    plain aliases (the harness indents subtasks from `group_subtasks`); `groups`, `versions`, `n-shot` (0:
    zero-shot), `higher_is_better`, `n-samples` and `configs` as the harness writes them."""
    lengths = lengths or lengths_of(cs, method)
    tasks = [lm_eval_name(t) for t in tasks_of(cs, method)]
    raw = {lm_eval_name(t): t for t in tasks_of(cs, method)}
    res: dict = {}
    for name in tasks:
        d: dict = {"name": name, "alias": name, "sample_len": sum(c["n"] for (m, _, t), c in cs.items()
                                                                   if m == method and t == raw[name])}
        for L in lengths:
            c = cs.get((method, L, raw[name]))
            d[f"{L},none"], d[f"{L}_stderr,none"] = _cell(task_score(c), mean_stderr(c["scores"])) if c else (-1, "N/A")
        res[name] = d
    group: dict = {"alias": "ruler", "name": "ruler", "sample_len": sum(res[t]["sample_len"] for t in tasks)}
    counts = {}
    for L in lengths:
        per = [cs[(method, L, t)] for t in tasks_of(cs, method, L)]
        se = group_stderr([mean_stderr(c["scores"]) for c in per])
        group[f"{L},none"], group[f"{L}_stderr,none"] = _cell(average(cs, method, L)[0], se)
        counts[f"{L},none"] = sum(c["n"] for c in per)
    group["sample_count"] = counts
    res = {"ruler": group, **res}
    intervals = {}
    for L in lengths:
        est, lo, hi, k = average(cs, method, L)
        if k:
            intervals.setdefault("ruler", {})[str(L)] = [round(lo, 6), round(hi, 6)]
    metric_list = [{"metric": str(L), "aggregation": "mean", "higher_is_better": True} for L in lengths]
    return {
        "results": res,
        "groups": {"ruler": group},
        "group_subtasks": {"ruler": tasks},
        "configs": {t: {"task": t, "output_type": "generate_until", "num_fewshot": 0, "metric_list": metric_list,
                        "metadata": {"version": LM_EVAL_TASK_VERSION}} for t in sorted(tasks)},
        "versions": dict(sorted({**{t: LM_EVAL_TASK_VERSION for t in tasks}, "ruler": LM_EVAL_GROUP_VERSION}.items())),
        "n-shot": {k: 0 for k in sorted(res)},
        "higher_is_better": {k: {str(L): True for L in lengths} for k in sorted(res)},
        "n-samples": {t: {"original": res[t]["sample_len"], "effective": res[t]["sample_len"]} for t in tasks},
        "config": {"method": method, "lengths": lengths, **(config or {})},
        # not in the harness's layout: the 95 % interval of the `ruler` mean (reports/build.py's main table)
        "oscar_intervals": intervals,
    }


# ----------------------------------------------------------------- files


def ruler_dir(out: str) -> str:
    return os.path.join(out, "ruler")


def write_ruler_outputs(out: str, done: dict, config: dict | None = None, lengths: list[int] | None = None) -> list[str]:
    """Write OUT/ruler/<method>/<length>/summary.csv and OUT/ruler/<method>/results.json for every method
    and length in `done`; returns the paths written. results.json lists `lengths` (default: every length any
    method has), -1 where the method has no sample."""
    cs = cells(done)
    lengths = sorted(set(lengths or []) | set(lengths_of(cs)))
    paths = []
    for m in methods_of(cs):
        mdir = os.path.join(ruler_dir(out), m)
        for L in lengths_of(cs, m):
            os.makedirs(os.path.join(mdir, str(L)), exist_ok=True)
            p = os.path.join(mdir, str(L), "summary.csv")
            _write(p, summary_csv(cs, m, L))
            paths.append(p)
        p = os.path.join(mdir, "results.json")
        _write(p, json.dumps(results_json(cs, m, config, lengths), indent=2) + "\n")
        paths.append(p)
    return paths


def _write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        f.write(text)
    os.replace(tmp, path)
