"""Model-level tables with intervals, from the per-sample and per-window files (no torch).

NIAH cells (niah_samples.jsonl -> results.parquet columns): score with a 95 % interval (Wilson for
0/1 samples, bootstrap for fractional ones) and, for every method but bf16, the difference to bf16
paired on the same samples: interval (Newcombe for 0/1, paired bootstrap otherwise), exact McNemar
(sign-flip for fractional) p-value, Holm-adjusted over every (task, length, method) cell compared.

Perplexity (ppl_windows.jsonl -> ppl.parquet columns): the ratio to bf16 paired by block with a
bootstrap interval (intervals.ratio_bootstrap). A block is a window when a context has at least
`MIN_BLOCKS` windows; otherwise the windows' 512-token segments (ppl.py records them), since the
held-out split holds only 3 disjoint windows of 4k (docs/decisions/0046-intervals-on-every-model-level-figure-three.md, "Intervals"). Records from
before segments existed give intervals from their windows alone (`blocks` says how many).

The product goal and the report's checks are three-valued (intervals.verdict / combine).
The reports stage reads these functions too: they import nothing but numpy, scipy and pandas.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pandas as pd

from oscar.validate import intervals as iv
from oscar.validate.intervals import holm

GOAL_RATIO = 1.25  # oscar-int2 strict ppl <= 1.25x bf16 ...
GOAL_BITS = 2.5  # ... at <= 2.5 bits per element
# A ratio within 2 % of the limit is reported as a thin margin: INT2 strict perplexity moves by
# ~0.5-1 % with float summation order alone (docs/validation.md), so such a verdict could flip.
GOAL_THIN = 0.02
# The accuracy goal per model (`needle_goal` and the report's checks; lab/goal_cells.py tabulates it):
# needles within `margin` points of bf16 on `tasks` at `lengths` (`margins`: another margin at a length), strict ppl
# <= `strict` x bf16, serving <= `serving` x
ACCURACY_GOALS = {
    "qwen2.5-0.5b": {"model": "qwen2.5-0.5b", "margin": -2.0, "margins": {8192: -5.0}, "strict": 1.10, "serving": 1.01,
                     "tasks": ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1"],
                     "lengths": [1024, 2048, 4096, 8192]},
    "smollm2-135m": {"model": "smollm2-135m", "margin": -5.0, "strict": 1.15, "serving": 1.01,
                     "tasks": ["niah_single_1", "niah_single_2"], "lengths": [1024, 2048, 4096]},
}
MIN_BLOCKS = 8  # resampling units an interval should rest on
SEGMENT = 512  # predicted tokens per segment of a perplexity window
ALPHA = 0.05


# ----------------------------------------------------------------- NIAH


def read_samples(path: str) -> dict[tuple, dict]:
    """(task, length, index, method) -> sample line of niah_samples.jsonl (a line cut by a kill is skipped)."""
    done: dict[tuple, dict] = {}
    if not os.path.exists(path):
        return done
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            done[(r["task"], r["length"], r["index"], r["method"])] = r
    return done


def cell_scores(done: dict) -> dict[tuple, dict[int, float]]:
    """(task, length, method) -> {sample index: score in [0, 1]}."""
    cells: dict[tuple, dict[int, float]] = {}
    for (t, L, i, m), r in done.items():
        cells.setdefault((t, L, m), {})[i] = float(r["score"])
    return cells


def score_interval(x, level: float = 0.95) -> tuple[float, float, str]:
    """(lo, hi, how) in percent for one cell's sample scores."""
    x = np.asarray(x, float)
    if iv.is_binary(x):
        lo, hi = iv.wilson(x.sum(), len(x), level)
        return 100 * lo, 100 * hi, "wilson"
    lo, hi = iv.bootstrap_mean(x, level)
    return 100 * lo, 100 * hi, "bootstrap"


def paired_diff(x, y, level: float = 0.95) -> tuple[float, float, float]:
    """(diff, lo, hi) in points of mean(x) - mean(y), x and y on the same samples."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if not len(x):
        return (float("nan"),) * 3
    lo, hi = iv.newcombe_paired(x, y, level) if iv.is_binary(x) and iv.is_binary(y) else iv.paired_bootstrap_diff(x, y, level)
    return 100 * float(np.mean(x - y)), 100 * lo, 100 * hi


def paired_arrays(cells: dict, t, L, m, base: str = "bf16") -> tuple[np.ndarray, np.ndarray]:
    """Scores of method m and of `base` on the samples both have, in index order."""
    a, b = cells.get((t, L, m), {}), cells.get((t, L, base), {})
    idx = sorted(set(a) & set(b))
    return np.array([a[i] for i in idx]), np.array([b[i] for i in idx])


def niah_stats(done: dict) -> list[dict]:
    """Per (task, length, method): samples, score, ci_low, ci_high, ci_method and the paired
    comparison with bf16 (diff_vs_bf16, diff_ci_low, diff_ci_high, paired, p_vs_bf16, p_holm)."""
    cells = cell_scores(done)
    rows = []
    for (t, L, m), sc in sorted(cells.items()):
        x = np.array(list(sc.values()))
        lo, hi, how = score_interval(x)
        r = {"task": t, "length": L, "method": m, "samples": len(x), "score": 100.0 * float(x.mean()),
             "ci_low": lo, "ci_high": hi, "ci_method": how}
        xa, xb = paired_arrays(cells, t, L, m)
        if m != "bf16" and len(xa):
            d, dlo, dhi = paired_diff(xa, xb)
            r.update(diff_vs_bf16=d, diff_ci_low=dlo, diff_ci_high=dhi, paired=len(xa), p_vs_bf16=iv.paired_test(xa, xb))
        else:
            r.update(diff_vs_bf16=float("nan"), diff_ci_low=float("nan"), diff_ci_high=float("nan"), paired=0,
                     p_vs_bf16=float("nan"))
        rows.append(r)

    tested = [i for i, r in enumerate(rows) if r["p_vs_bf16"] == r["p_vs_bf16"]]
    adj = holm([rows[i]["p_vs_bf16"] for i in tested]) if tested else []
    for r in rows:
        r["p_holm"] = float("nan")
    for i, p in zip(tested, adj):
        rows[i]["p_holm"] = float(p)
    return rows


def interval_columns(res, done: dict | None):
    """results.parquet with the interval columns: from the per-sample lines when there are any,
    else Wilson from (score, samples) of 0/1 cells (results written before the columns existed)."""
    res = res.copy()
    if done:
        st = pd.DataFrame(niah_stats(done)).drop(columns=["samples", "score"])
        res = res.drop(columns=[c for c in st.columns if c in res and c not in ("task", "length", "method")])
        return res.merge(st, on=["task", "length", "method"], how="left")
    if "ci_low" not in res:
        lo_hi = [iv.wilson(round(r.score * r.samples / 100), int(r.samples)) for r in res.itertuples()]
        res["ci_low"] = [100 * a for a, _ in lo_hi]
        res["ci_high"] = [100 * b for _, b in lo_hi]
        res["ci_method"] = "wilson (from score, samples)"
    return res


# ----------------------------------------------------------------- perplexity


def read_windows(path: str) -> list[dict]:
    out = []
    if os.path.exists(path):
        for line in open(path):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def segment_cuts(context: int) -> list[int]:
    """Window lengths P whose cumulative NLL (over P - 1 predicted tokens) ppl.py records: every SEGMENT."""
    return list(range(SEGMENT + 1, context, SEGMENT))


def _index(windows: list[dict]) -> dict[tuple, dict]:
    return {(r["method"], r["protocol"], r["context"], r["window"]): r for r in windows}


def blocks(idx: dict, specs: list[tuple[str, str]], context: int, n_windows: int) -> tuple[list[dict], str, int]:
    """Aligned blocks of several (method, protocol key) rows at one context: ([{block: (nll, count)}
    per spec], unit, windows). Blocks are the windows all specs have; their segments instead when
    there are fewer than MIN_BLOCKS windows and every one of them recorded segments."""
    common = [w for w in range(n_windows) if all((m, p, context, w) in idx for m, p in specs)]
    recs = [[idx[(m, p, context, w)] for w in common] for m, p in specs]
    if len(common) >= MIN_BLOCKS or not common or not all("seg" in r for rs in recs for r in rs):
        return [{w: (r["nll"], r["count"]) for w, r in zip(common, rs)} for rs in recs], "window", len(common)
    return ([{(w, s): tuple(x) for w, r in zip(common, rs) for s, x in enumerate(r["seg"])} for rs in recs],
            "segment", len(common))


def ratio_of(ba: dict, bb: dict, level: float = 0.95) -> tuple[float, float, float, int]:
    """(ratio, lo, hi, blocks) of ppl(a) / ppl(b) paired on aligned blocks (b=None: ppl(a) itself)."""
    keys = sorted(ba)
    if not keys:
        return float("nan"), float("nan"), float("nan"), 0
    na = [ba[k][0] for k in keys]
    nb = [bb[k][0] for k in keys] if bb is not None else [0.0] * len(keys)
    cnt = [ba[k][1] for k in keys]
    r, lo, hi = iv.ratio_bootstrap(na, nb, cnt, level)
    return r, lo, hi, len(keys)


def proto_key(method: str, protocol: str) -> str:
    return "-" if method == "bf16" else protocol  # bf16 does not depend on the protocol (scored once)


def ppl_stats(windows: list[dict], methods, protocols, contexts, tokens: int, bf16_key=proto_key) -> list[dict]:
    """Per (method, protocol, context): ppl with its interval, windows, blocks, block unit, ratio to
    bf16 paired by block with its interval."""
    idx = _index(windows)
    rows = []
    for m in methods:
        for p in protocols:
            for c in contexts:
                nw = tokens // c
                (bm,), unit, w = blocks(idx, [(m, bf16_key(m, p))], c, nw)
                if not bm:
                    continue
                nll = sum(x[0] for x in bm.values()) / sum(x[1] for x in bm.values())
                _, plo, phi, _ = ratio_of(bm, None)  # exp(mean NLL) itself, bootstrapped by block
                ratio = (float("nan"),) * 3 + (len(bm),)
                if "bf16" in methods:  # the ratio (what verdicts use) on the blocks both rows have
                    (pa, pb), unit, w = blocks(idx, [(m, bf16_key(m, p)), ("bf16", "-")], c, nw)
                    ratio = ratio_of(pa, pb)
                rows.append({"method": m, "protocol": p, "context": c, "ppl": math.exp(nll), "ppl_ci_low": plo,
                             "ppl_ci_high": phi, "tokens": int(sum(x[1] for x in bm.values())), "windows": w,
                             "blocks": ratio[3], "block": unit, "ratio": ratio[0], "ratio_ci_low": ratio[1],
                             "ratio_ci_high": ratio[2]})
    return rows


# ----------------------------------------------------------------- the product goal


def _goal_rows(df, method: str, windows: list[dict] | None, tokens: int | None) -> list[dict]:
    d = df[(df.method == method) & (df.protocol == "strict")]
    m = len(d)
    idx = _index(windows) if windows else None
    rows = []
    for r in d.itertuples():
        ratio = float(r.ratio)
        lo, hi = float(getattr(r, "ratio_ci_low", float("nan"))), float(getattr(r, "ratio_ci_high", float("nan")))
        has_ci = lo == lo and hi == hi
        legacy = "ratio_ci_low" not in df  # results written before intervals existed
        if legacy:  # the point estimate stands in for its interval (the report says "no interval")
            lo = hi = ratio
        alo = ahi = float("nan")
        if idx is not None and tokens and has_ci and m > 1:  # Bonferroni-level interval for MISSED (see combine)
            (bm, bb), _, _ = blocks(idx, [(method, "strict"), ("bf16", "-")], int(r.context), tokens // int(r.context))
            _, alo, ahi, _ = ratio_of(bm, bb, 1 - ALPHA / m)
        if alo != alo and (has_ci or legacy):  # no adjusted interval: the 95 % one (or the point) stands in
            alo, ahi = lo, hi
        bits = float(r.bits_per_element)
        v = iv.verdict(lo, hi, GOAL_RATIO, "below")
        va = iv.verdict(alo, ahi, GOAL_RATIO, "below")
        if bits > GOAL_BITS:
            v = va = iv.MISSED
        row = {"context": int(r.context), "ratio": ratio, "ratio_ci_low": lo if has_ci else None,
               "ratio_ci_high": hi if has_ci else None, "bits_per_element": bits,
               "blocks": int(getattr(r, "blocks", 0) or 0), "block": getattr(r, "block", None),
               "windows": int(getattr(r, "windows", 0) or 0), "verdict": v, "verdict_adjusted": va,
               "met": v == iv.PASS}
        if v == iv.UNRESOLVED and has_ci:
            row["resolve_blocks"] = iv.resolve_n(ratio, lo, hi, GOAL_RATIO, row["blocks"])
        rows.append(row)
    return rows


def _status(rows: list[dict]) -> tuple[str, str]:
    if not rows:
        return "not measured", "not measured"
    v = iv.combine([r["verdict"] for r in rows], [r["verdict_adjusted"] for r in rows])
    return v, {iv.PASS: "met", iv.MISSED: "missed", iv.UNRESOLVED: "unresolved"}[v]


def product_goal(df, windows: list[dict] | None = None, tokens: int | None = None) -> dict:
    """oscar-int2 strict-protocol ppl <= 1.25x bf16 at <= 2.5 bits/element, at every context measured.

    Three-valued: PASS when every context's 95 % ratio interval lies at or below 1.25 (and the bits
    fit), MISSED when one context's interval at level 1 - 0.05/m (m contexts) lies above it, else
    UNRESOLVED. `status` keeps the older words (met / missed / unresolved). `windows`/`tokens` (the
    per-window records) give the adjusted intervals; without them the 95 % ones stand in. The other
    OSCAR recipes in the run are checked the same way under "others".
    """
    g = {"goal": f"oscar-int2 strict ppl <= {GOAL_RATIO}x bf16 at <= {GOAL_BITS} bits/element", "rows": [],
         "rule": "PASS: every context's 95% interval of the ratio to bf16 (paired by block, bootstrap) <= "
                 f"{GOAL_RATIO}; MISSED: one context's interval at level 1-0.05/m above it; else UNRESOLVED"}
    if not len(df) or not ({"ratio_vs_bf16", "ratio"} & set(df.columns)):
        g["status"] = g["verdict"] = "not measured"
        return g
    if "ratio" not in df:
        df = df.assign(ratio=df.ratio_vs_bf16)
    g["rows"] = _goal_rows(df, "oscar-int2", windows, tokens)
    g["verdict"], g["status"] = _status(g["rows"])
    thin = [r["context"] for r in g["rows"] if abs(r["ratio"] / GOAL_RATIO - 1) < GOAL_THIN]
    if thin:  # contexts whose point estimate lies within float-order noise of the limit
        g["thin_margin_contexts"] = thin
    g["others"] = {}
    for m in sorted(set(df.method)):
        if m.startswith("oscar") and m != "oscar-int2":
            rows = _goal_rows(df, m, windows, tokens)
            v, s = _status(rows)
            g["others"][m] = {"status": s, "verdict": v, "rows": rows}
    return g


# ----------------------------------------------------------------- the accuracy goal's needle rule


def _concat(pa: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """(method, bf16) score arrays of several cells, pooled into one pair of arrays."""
    if not pa:
        return np.zeros(0), np.zeros(0)
    return np.concatenate([a for a, _ in pa]), np.concatenate([b for _, b in pa])


def _pooled(pa: list[tuple[np.ndarray, np.ndarray]], level: float = 0.95) -> dict | None:
    """(method, bf16) score arrays of several cells pooled: pairs, scores (%), difference [interval] in points."""
    x, y = _concat(pa)
    if not len(x):
        return None
    d, lo, hi = paired_diff(x, y, level)
    return {"pairs": int(len(x)), "score": 100 * float(x.mean()), "bf16": 100 * float(y.mean()),
            "diff": d, "lo": lo, "hi": hi}


def _pooled_cell(cells: dict, tasks: list[str], L: int, method: str, level: float = 0.95) -> dict | None:
    """Method vs bf16 at length L, the tasks' pairs pooled."""
    return _pooled([paired_arrays(cells, t, L, method) for t in tasks], level)


def paired_resolve(x, y, threshold: float, level: float = 0.95) -> int | None:
    """Pairs that would resolve the paired difference of x and y (threshold in points): 0/1 scores
    project their 2x2 table (`iv.resolve_n_paired`), fractional ones the interval's width (`iv.resolve_n`)."""
    if iv.is_binary(x) and iv.is_binary(y):
        return iv.resolve_n_paired(x, y, threshold / 100, level)
    d, lo, hi = paired_diff(x, y, level)
    return iv.resolve_n(d, lo, hi, threshold, len(x))


def score_resolve(x, threshold: float, level: float = 0.95) -> int | None:
    """Samples that would resolve one cell's score (threshold in %): Wilson projected for 0/1 scores."""
    x = np.asarray(x, float)
    if iv.is_binary(x):
        return iv.resolve_n_wilson(float(x.sum()), len(x), threshold / 100, level)
    lo, hi, _ = score_interval(x, level)
    return iv.resolve_n(100 * float(x.mean()), lo, hi, threshold, len(x))


def goal_margin(goal: dict, length: int) -> float:
    """The goal's needle margin at `length` (points, negative: how far below bf16 it may be)."""
    return (goal.get("margins") or {}).get(length, goal["margin"])


def margin_label(goal: dict) -> str:
    """'2 points' or '2 points (5 at 8k)': the goal's margins in words."""
    more = ", ".join(f"{-m:g} at {L // 1024}k" for L, m in sorted((goal.get("margins") or {}).items()))
    return f"{-goal['margin']:g} points" + (f" ({more})" if more else "")


def needle_goal(done: dict, goal: dict, method: str, looks: int = 1) -> dict:
    """The accuracy goal's needle rule (a goal of ACCURACY_GOALS): per length, `method` minus bf16 paired on the same samples
    with the goal's tasks pooled, its 95 % interval above `margin`; PASS / MISSED / UNRESOLVED as every check here
    (MISSED needs the interval at 1 - 0.05/m over the m lengths). A length missing a task cannot pass; the tasks
    alone over every length are listed (`by_task`: where a loss sits when no single cell resolves it).
    looks: the times these cells were checked on growing samples (more seeds run after a straddling look): the
    verdicts' intervals at level 1 - 0.05/looks (Bonferroni over the looks; `level` in each row)."""
    level = 1 - ALPHA / looks
    cells = cell_scores(done)
    rows, missing = [], []
    for L in goal["lengths"]:
        held = [t for t in goal["tasks"] if paired_arrays(cells, t, L, method)[0].size]
        if len(held) < len(goal["tasks"]):
            missing += [(t, L) for t in goal["tasks"] if t not in held]
        if not held:
            continue
        r = {"length": L, "tasks": held, **_pooled_cell(cells, held, L, method, level), "level": level,
             "per_task": {t: _pooled_cell(cells, [t], L, method, level) for t in held}}
        rows.append(r)
    m = max(len(rows), 1)
    for r in rows:  # a cell missing a task cannot pass: the goal names all of them
        margin = goal_margin(goal, r["length"])
        r["margin"] = margin
        r["verdict"] = iv.verdict(r["lo"], r["hi"], margin, "above")
        if r["verdict"] == iv.PASS and len(r["tasks"]) < len(goal["tasks"]):
            r["verdict"] = iv.UNRESOLVED
        adj = _pooled_cell(cells, r["tasks"], r["length"], method, 1 - ALPHA / (m * looks))
        r["verdict_adjusted"] = iv.verdict(adj["lo"], adj["hi"], margin, "above")
        if r["verdict"] == iv.UNRESOLVED:
            x, y = _concat([paired_arrays(cells, t, r["length"], method) for t in r["tasks"]])
            r["resolve_pairs"] = paired_resolve(x, y, margin, level)
    v = iv.combine([r["verdict"] for r in rows], [r["verdict_adjusted"] for r in rows]) if rows else "not measured"
    if v == iv.PASS and missing:
        v = iv.UNRESOLVED
    by_task = {}  # each task over every length measured: where a loss sits when no single cell resolves it
    for t in goal["tasks"]:
        c = _pooled([paired_arrays(cells, t, r["length"], method) for r in rows])
        if c:
            by_task[t] = c
    at = f", {100 * level:g} % intervals: look {looks}" if looks > 1 else ""
    return {"rule": f"paired difference to bf16 (pooled over the tasks) above -{margin_label(goal)}{at}",
            "verdict": v, "rows": rows, "by_task": by_task, "not_measured": [f"{t}@{L}" for t, L in missing]}


# ----------------------------------------------------------------- the report's checks


def _cell_verdicts(est_lo_hi: list[tuple], threshold: float, better: str, adjusted: list[tuple],
                   needs: list[int | None]) -> dict:
    """Combine per-cell (est, lo, hi) 95 % intervals and (lo, hi) at level 1 - 0.05/m into one check;
    needs: per cell, the samples that would resolve it (None: estimate on the threshold, or no interval)."""
    vs = [iv.verdict(lo, hi, threshold, better) for _, lo, hi in est_lo_hi]
    va = [iv.verdict(lo, hi, threshold, better) for lo, hi in adjusted]
    v = iv.combine(vs, va)
    need, stuck = None, 0
    if v == iv.UNRESOLVED:  # the cells that do not pass decide: the most demanding one
        ns = [k for c, k in zip(vs, needs) if c != iv.PASS]
        stuck = sum(x is None for x in ns)  # estimate on the threshold, or no interval
        need = max([x for x in ns if x is not None], default=None)
    return {"verdict": v, "cells": vs, "resolve": need, "stuck": stuck}


def niah_check(done: dict, res, keys: list[tuple], method: str, threshold: float, better: str,
               paired: bool) -> dict:
    """One report check over NIAH cells `keys` = [(task, length)]: the score of `method` (paired=False)
    or its paired difference to bf16 in points (paired=True) against `threshold`.

    Returns verdict, per-cell (task, length, est, lo, hi), the worst cell and the samples that would
    resolve an UNRESOLVED verdict. Without per-sample lines, paired checks are UNRESOLVED and score
    checks use Wilson intervals from (score, samples).
    """
    m = len(keys)
    cells = cell_scores(done) if done else {}
    rows, adj, ns, sizes = [], [], [], []
    for t, L in keys:
        if done:
            if paired:
                x, y = paired_arrays(cells, t, L, method)
                e, lo, hi = paired_diff(x, y)
                _, alo, ahi = paired_diff(x, y, 1 - ALPHA / m)
                k = paired_resolve(x, y, threshold) if len(x) else None
            else:
                x = np.array(list(cells.get((t, L, method), {}).values()))
                if not len(x):
                    continue
                e = 100 * float(x.mean())
                lo, hi, _ = score_interval(x)
                alo, ahi, _ = score_interval(x, 1 - ALPHA / m)
                k = score_resolve(x, threshold)
        else:
            r = res[(res.task == t) & (res.length == L) & (res.method == method)]
            if paired or not len(r):
                e = lo = hi = alo = ahi = float("nan")
                n, k = 0, None
            else:
                n, e = int(r.samples.iloc[0]), float(r.score.iloc[0])
                hits = round(e * n / 100)
                lo, hi = (100 * v for v in iv.wilson(hits, n))
                alo, ahi = (100 * v for v in iv.wilson(hits, n, 1 - ALPHA / m))
                k = iv.resolve_n_wilson(hits, n, threshold / 100)
        rows.append((t, L, e, lo, hi))
        adj.append((alo, ahi))
        ns.append(k)
        sizes.append(len(x) if done else n)
    out = _cell_verdicts([r[2:] for r in rows], threshold, better, adj, ns)
    worst = None
    if rows:  # the cell nearest to failing: lowest lower bound ("above"), highest upper bound ("below")
        worst = min(rows, key=lambda r: r[3] if better == "above" else -r[4]) if all(r[3] == r[3] for r in rows) else rows[0]
    out.update(rows=rows, worst=worst, samples=min(sizes) if sizes else 0)
    return out


def ppl_pair_check(windows: list[dict], tokens: int, contexts, a: str, b: str, protocol: str,
                   threshold: float = 1.0) -> dict:
    """ppl(a) < threshold x ppl(b) under `protocol` at every context: the ratio a/b paired by block, against
    `threshold` (1: a beats b; b = "bf16" with a goal's limit: a stays within it)."""
    idx = _index(windows)
    m = len(contexts)
    rows, adj, ns = [], [], []
    for c in contexts:
        (ba, bb), unit, _ = blocks(idx, [(a, proto_key(a, protocol)), (b, proto_key(b, protocol))], c, tokens // c)
        r, lo, hi, n = ratio_of(ba, bb)
        _, alo, ahi, _ = ratio_of(ba, bb, 1 - ALPHA / m) if m > 1 else (r, lo, hi, n)
        rows.append((c, r, lo, hi, n, unit))
        adj.append((alo, ahi))
        ns.append(iv.resolve_n(r, lo, hi, threshold, n))
    out = _cell_verdicts([(r[1], r[2], r[3]) for r in rows], threshold, "below", adj, ns)
    out.update(rows=rows)
    return out
