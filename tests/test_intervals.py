"""Intervals and paired tests (validate/intervals.py) against scipy, brute force and simulation;
three-valued verdicts on constructed results (validate/evidence.py)."""

import itertools
import math

import numpy as np
import pandas as pd
import pytest
from scipy.stats import binomtest

from oscar.validate import evidence as ev
from oscar.validate import intervals as iv


# ----------------------------------------------------------------- Wilson


@pytest.mark.parametrize("k,n", [(0, 20), (7, 20), (11, 20), (20, 20), (3, 8), (45, 50)])
def test_wilson_matches_scipy_and_brute_force(k, n):
    lo, hi = iv.wilson(k, n)
    ref = binomtest(k, n).proportion_ci(method="wilson")
    assert lo == pytest.approx(ref.low, abs=1e-12) and hi == pytest.approx(ref.high, abs=1e-12)
    # brute force: the Wilson interval is every p with |k/n - p| <= z sqrt(p (1 - p) / n)
    p = np.linspace(0, 1, 200001)
    inside = p[np.abs(k / n - p) <= iv.Z95 * np.sqrt(p * (1 - p) / n)]
    assert lo == pytest.approx(inside.min(), abs=1e-5) and hi == pytest.approx(inside.max(), abs=1e-5)


def test_wilson_coverage_by_simulation():
    rng = np.random.default_rng(1)
    n = 20
    table = np.array([iv.wilson(x, n) for x in range(n + 1)])  # (n + 1, 2)
    cov = []
    for p in np.linspace(0.05, 0.95, 19):
        k = rng.binomial(n, p, size=20000)
        cov.append(np.mean((table[k, 0] <= p) & (p <= table[k, 1])))
    assert 0.945 <= np.mean(cov) <= 0.97, np.mean(cov)  # measured 0.958
    assert min(cov) >= 0.91, min(cov)  # Wilson's known dips near p = 0.05 / 0.95 (measured 0.922)


# ----------------------------------------------------------------- paired tests


def _pairs(b, c, a=5, d=5):
    """0/1 score vectors with a (1,1), b (1,0), c (0,1) and d (0,0) pairs."""
    x = np.array([1] * a + [1] * b + [0] * c + [0] * d)
    y = np.array([1] * a + [0] * b + [1] * c + [0] * d)
    return x, y


@pytest.mark.parametrize("b,c", [(0, 0), (3, 0), (5, 1), (2, 9), (7, 7), (12, 4)])
def test_mcnemar_exact_matches_scipy_and_enumeration(b, c):
    x, y = _pairs(b, c)
    p = iv.mcnemar_exact(x, y)
    n = b + c
    if n:
        assert p == pytest.approx(binomtest(b, n, 0.5).pvalue, rel=1e-12)
        # enumeration of every sign assignment of the discordant pairs
        obs = abs(b - c)
        more = sum(abs(2 * sum(s) - n) >= obs for s in itertools.product([0, 1], repeat=n))
        assert p == pytest.approx(more / 2 ** n, rel=1e-12)
    else:
        assert p == 1.0


def test_mcnemar_size_under_the_null_by_simulation():
    """Same marginals (a method no better than bf16), correlated samples: rejection rate <= 5 %."""
    rng = np.random.default_rng(2)
    for n, p, rho in [(20, 0.8, 0.5), (20, 0.5, 0.0), (40, 0.7, 0.3)]:
        rej, T = 0, 4000
        for _ in range(T):
            u = rng.random(n)
            v = np.where(rng.random(n) < rho, u, rng.random(n))
            rej += iv.mcnemar_exact(u < p, v < p) < 0.05
        assert rej / T <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / T), (n, p, rho, rej / T)


def test_signflip_matches_brute_force_and_keeps_its_size():
    rng = np.random.default_rng(3)
    x, y = rng.random(12), rng.random(12)  # exact enumeration path (n <= 16)
    d = x - y
    obs = abs(d.sum())
    ref = np.mean([abs(np.dot(s, d)) >= obs - 1e-12 for s in itertools.product([-1, 1], repeat=12)])
    assert iv.signflip_test(x, y) == pytest.approx(ref, abs=1e-12)
    x, y = rng.random(18), rng.random(18)  # Monte-Carlo path against enumeration
    d = x - y
    s = 1 - 2 * ((np.arange(2 ** 18)[:, None] >> np.arange(18)) & 1)
    exact = np.mean(np.abs(s @ d) >= abs(d.sum()) - 1e-12)
    assert iv.signflip_test(x, y) == pytest.approx(exact, abs=0.01)
    rej, T = 0, 1500
    for _ in range(T):  # null: fractional scores from the same distribution
        a = rng.integers(0, 5, 12) / 4
        b = rng.integers(0, 5, 12) / 4
        rej += iv.signflip_test(a, b) < 0.05
    assert rej / T <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / T), rej / T


def test_newcombe_paired_interval():
    # no disagreement at 20/20: an honest interval, not [0, 0]
    x = np.ones(20)
    lo, hi = iv.newcombe_paired(x, x)
    w = iv.wilson(20, 20)[0]
    assert lo == pytest.approx(-(1 - w)) and hi == pytest.approx(1 - w)
    # independent samples (phi = 0) give Newcombe's hybrid of the two Wilson intervals (method 10)
    xa, xb = _pairs(4, 2, a=6, d=8)
    lo, hi = iv.newcombe_paired(xa, xb)
    assert lo < (4 - 2) / 20 < hi
    # coverage by simulation, correlated pairs, 20 samples
    rng = np.random.default_rng(4)
    for p1, p2, rho in [(0.8, 0.6, 0.3), (0.5, 0.5, 0.0), (0.95, 0.7, 0.2), (0.6, 0.4, 0.6)]:
        hits, T = 0, 2000
        for _ in range(T):
            u = rng.random(20)
            v = np.where(rng.random(20) < rho, u, rng.random(20))
            lo, hi = iv.newcombe_paired(u < p1, v < p2)
            hits += lo <= p1 - p2 <= hi
        assert hits / T >= 0.91, (p1, p2, rho, hits / T)  # measured 0.93-0.96


# ----------------------------------------------------------------- perplexity ratio


def test_ratio_bootstrap_against_enumeration_and_coverage():
    na, nb, cnt = np.array([120.0, 95.0, 140.0]), np.array([100.0, 90.0, 110.0]), np.array([100.0, 100.0, 100.0])
    r, lo, hi = iv.ratio_bootstrap(na, nb, cnt, b=40000)
    assert r == pytest.approx(math.exp((na.sum() - nb.sum()) / cnt.sum()))
    # every resample of 3 blocks with its multinomial probability: the exact bootstrap distribution
    vals, wts = [], []
    for idx in itertools.product(range(3), repeat=3):
        i = list(idx)
        vals.append((na[i].sum() - nb[i].sum()) / cnt[i].sum())
        wts.append(1 / 27)
    o = np.argsort(vals)
    cdf = np.cumsum(np.array(wts)[o])
    from scipy.stats import norm, t

    a = norm.cdf(math.sqrt(3 / 2) * t.ppf(0.025, 2))
    q_lo = np.array(vals)[o][np.searchsorted(cdf, a)]
    q_hi = np.array(vals)[o][np.searchsorted(cdf, 1 - a)]
    assert math.log(lo) == pytest.approx(q_lo, abs=0.02) and math.log(hi) == pytest.approx(q_hi, abs=0.02)
    assert iv.ratio_bootstrap([1.0], [1.0], [10])[1] != iv.ratio_bootstrap([1.0], [1.0], [10])[1]  # one block: nan
    rng = np.random.default_rng(5)
    for n, floor in ((8, 0.92), (16, 0.93)):
        hits, T = 0, 800
        for _ in range(T):
            d = rng.normal(0.2, 0.05, size=n) * 500
            _, lo, hi = iv.ratio_bootstrap(d, np.zeros(n), np.full(n, 500.0), b=2000, seed=int(rng.integers(1 << 30)))
            hits += lo <= math.exp(0.2) <= hi
        assert hits / T >= floor, (n, hits / T)  # measured 0.94 (8 blocks), 0.95 (16)


# ----------------------------------------------------------------- verdicts


def test_verdict_rule_and_combination():
    assert iv.verdict(1.10, 1.20, 1.25, "below") == iv.PASS
    assert iv.verdict(1.26, 1.40, 1.25, "below") == iv.MISSED
    assert iv.verdict(1.20, 1.30, 1.25, "below") == iv.UNRESOLVED
    assert iv.verdict(91, 99, 90, "above") == iv.PASS
    assert iv.verdict(50, 89, 90, "above") == iv.MISSED
    assert iv.verdict(80, 99, 90, "above") == iv.UNRESOLVED
    assert iv.verdict(float("nan"), float("nan"), 1, "above") == iv.UNRESOLVED
    with pytest.raises(ValueError):
        iv.verdict(0, 1, 0.5, "sideways")
    assert iv.combine([iv.PASS, iv.PASS]) == iv.PASS
    assert iv.combine([iv.PASS, iv.MISSED], [iv.PASS, iv.MISSED]) == iv.MISSED
    # missed at 95 % in one of two cells but not at the corrected level: unresolved
    assert iv.combine([iv.PASS, iv.MISSED], [iv.PASS, iv.UNRESOLVED]) == iv.UNRESOLVED
    assert iv.combine([]) == iv.UNRESOLVED
    # projection: half-width 0.05 towards a threshold 0.03 away -> (0.05/0.03)^2 x the samples
    assert iv.resolve_n(1.22, 1.17, 1.27, 1.25, 8) == math.ceil(8 * (0.05 / 0.03) ** 2)
    assert iv.resolve_n(1.25, 1.2, 1.3, 1.25, 8) is None


def _windows(method, proto, ctx, log_ratios, count=1000, base=2.0):
    """Per-window records whose NLL per token is base + log ratio (bf16: base)."""
    return [{"method": method, "protocol": proto, "context": ctx, "window": w, "nll": (base + lr) * count, "count": count}
            for w, lr in enumerate(log_ratios)]


def _goal(log_ratios_by_ctx):
    wins = []
    for c, lrs in log_ratios_by_ctx.items():
        wins += _windows("bf16", "-", c, [0.0] * len(lrs), count=c - 1)
        wins += _windows("oscar-int2", "strict", c, lrs, count=c - 1)
    tokens = max(c * len(v) for c, v in log_ratios_by_ctx.items())
    rows = ev.ppl_stats(wins, ["bf16", "oscar-int2"], ["strict"], sorted(log_ratios_by_ctx), tokens)
    df = pd.DataFrame(rows).assign(bits_per_element=lambda d: np.where(d.method == "bf16", 16.0, 2.5))
    return ev.product_goal(df, wins, tokens), df


def _first_clear(interval_at, est, threshold, start):
    """Brute force: the first n' > start whose interval lies wholly on est's side of the threshold."""
    m = start + 1
    while True:
        lo, hi = interval_at(m)
        if (lo >= threshold) if est > threshold else (hi < threshold):
            return m
        m += 1


@pytest.mark.parametrize("table,threshold", [((20, 0, 0, 0), -0.02), ((398, 0, 2, 0), -0.02), ((30, 4, 1, 5), 0.0),
                                             ((10, 0, 8, 2), -0.05), ((19, 0, 1, 0), -0.20)])
def test_resolve_n_paired_against_brute_force(table, threshold):
    a, b, c, d = table
    x = np.array([1] * a + [1] * b + [0] * c + [0] * d, bool)
    y = np.array([1] * a + [0] * b + [1] * c + [0] * d, bool)
    n = len(x)
    need = iv.resolve_n_paired(x, y, threshold)
    est = x.mean() - y.mean()
    f = np.array(table, float) / n
    assert need == _first_clear(lambda m: iv.newcombe_counts(*(f * m)), est, threshold, n)
    k = need // n + 1  # the table repeated k times: real arrays, at least `need` pairs, resolve it
    lo, hi = iv.newcombe_paired(np.tile(x, k), np.tile(y, k))
    assert (lo >= threshold) if est > threshold else (hi < threshold)
    assert iv.newcombe_counts(*table) == iv.newcombe_paired(x, y)
    # zero discordance: the width falls like 1/n, so the sqrt rule overstates the pairs several times over
    if table == (20, 0, 0, 0):
        lo, hi = iv.newcombe_paired(x, y)
        assert need == 189 and iv.resolve_n(0.0, lo, hi, threshold, n) > 5 * need
        assert iv.newcombe_paired(np.ones(need), np.ones(need))[0] >= threshold > iv.newcombe_paired(np.ones(need - 1), np.ones(need - 1))[0]
    assert iv.resolve_n_paired(x[:0], y[:0], threshold) is None


def test_resolve_n_wilson_against_brute_force():
    for k, n, thr in [(20, 20, 0.90), (17, 20, 0.80), (10, 20, 0.90), (3, 40, 0.02)]:
        need = iv.resolve_n_wilson(k, n, thr)
        assert need == _first_clear(lambda m: iv.wilson(k / n * m, m), k / n, thr, n), (k, n, thr)
    assert iv.resolve_n_wilson(18, 20, 0.90) is None  # on the threshold: no number of samples resolves it
    assert iv.resolve_n_wilson(20, 20, 0.90, level=0.99) > iv.resolve_n_wilson(20, 20, 0.90)


def test_goal_pass_missed_unresolved_on_constructed_windows():
    rng = np.random.default_rng(6)
    tight = lambda mu: list(mu + rng.normal(0, 0.005, 8))  # noqa: E731
    g, df = _goal({1024: tight(math.log(1.10))})
    assert g["verdict"] == "PASS" and g["status"] == "met"
    row = g["rows"][0]
    assert row["ratio_ci_high"] <= 1.25 and row["blocks"] == 8 and row["block"] == "window"
    assert set(df.columns) >= {"windows", "ratio", "ratio_ci_low", "ratio_ci_high"}
    g, _ = _goal({1024: tight(math.log(1.40))})
    assert g["verdict"] == "MISSED" and g["rows"][0]["ratio_ci_low"] > 1.25
    g, _ = _goal({1024: list(math.log(1.24) + rng.normal(0, 0.08, 8))})
    assert g["verdict"] == "UNRESOLVED" and g["status"] == "unresolved"
    assert g["rows"][0]["ratio_ci_low"] < 1.25 < g["rows"][0]["ratio_ci_high"]
    assert g["rows"][0]["resolve_blocks"] > 8
    # one context passes, the other straddles: unresolved, not met
    g, _ = _goal({1024: tight(math.log(1.10)), 512: list(math.log(1.245) + rng.normal(0, 0.05, 16))})
    assert [r["verdict"] for r in g["rows"]] == ["UNRESOLVED", "PASS"] or [r["verdict"] for r in g["rows"]] == ["PASS", "UNRESOLVED"]
    assert g["verdict"] == "UNRESOLVED"


def test_segments_stand_in_for_too_few_windows():
    """2 windows of 4k, each with 8 segments: the interval rests on 16 paired segments."""
    rng = np.random.default_rng(7)
    wins = []
    for m, p in (("bf16", "-"), ("oscar-int2", "strict")):
        for w in range(2):
            seg = [[(2.0 + (0.1 if m != "bf16" else 0) + rng.normal(0, 0.01)) * 512, 512] for _ in range(8)]
            wins.append({"method": m, "protocol": p, "context": 4096, "window": w, "nll": sum(s[0] for s in seg),
                         "count": 4096, "seg": seg})
    rows = ev.ppl_stats(wins, ["bf16", "oscar-int2"], ["strict"], [4096], 8192)
    r = [x for x in rows if x["method"] == "oscar-int2"][0]
    assert r["windows"] == 2 and r["blocks"] == 16 and r["block"] == "segment"
    assert r["ratio_ci_low"] < math.exp(0.1 * 512 * 16 / (4096 * 2)) * 1.01 and r["ratio_ci_low"] == r["ratio_ci_low"]
    # without segments (records written before they existed): 2 windows, the interval says so
    for x in wins:
        x.pop("seg")
    r = [x for x in ev.ppl_stats(wins, ["bf16", "oscar-int2"], ["strict"], [4096], 8192) if x["method"] == "oscar-int2"][0]
    assert r["blocks"] == 2 and r["block"] == "window"


def _samples(cells):
    """{(task, length, method): [0/1 scores]} -> per-sample records."""
    done = {}
    for (t, L, m), sc in cells.items():
        for i, s in enumerate(sc):
            done[(t, L, i, m)] = {"task": t, "length": L, "index": i, "method": m, "score": float(s)}
    return done


def test_niah_stats_intervals_and_holm():
    done = _samples({("niah_single_1", 1024, "bf16"): [1] * 20, ("niah_single_1", 1024, "naive-int2"): [0] * 18 + [1] * 2,
                     ("niah_single_1", 1024, "oscar-int2"): [1] * 19 + [0]})
    st = {r["method"]: r for r in ev.niah_stats(done)}
    lo, hi = iv.wilson(2, 20)
    assert st["naive-int2"]["ci_low"] == pytest.approx(100 * lo) and st["naive-int2"]["ci_high"] == pytest.approx(100 * hi)
    assert st["naive-int2"]["p_vs_bf16"] == pytest.approx(binomtest(0, 18, 0.5).pvalue)
    assert st["naive-int2"]["p_holm"] == pytest.approx(min(1, 2 * st["naive-int2"]["p_vs_bf16"]))
    assert st["oscar-int2"]["p_holm"] == pytest.approx(1.0)
    assert st["oscar-int2"]["diff_vs_bf16"] == pytest.approx(-5.0) and st["oscar-int2"]["diff_ci_low"] < -5 < st["oscar-int2"]["diff_ci_high"]
    frac = _samples({("niah_multikey_1", 1024, "bf16"): [1, 0.5, 0.75, 1] * 5})
    assert ev.niah_stats(frac)[0]["ci_method"] == "bootstrap"


def _res(done):
    rows = [{"suite": "ruler", "task": r["task"], "length": r["length"], "method": r["method"], "samples": r["samples"],
             "score": r["score"], "protocol": "serving"} for r in ev.niah_stats(done)]
    return pd.DataFrame(rows)


def test_report_checks_come_out_pass_missed_unresolved():
    from oscar.reports.build import acceptance

    keys = [("niah_single_1", L) for L in (1024, 2048, 4096)]
    BF16_CHECK = "bf16 >= 90% on niah_single_1 at 1k-4k"  # the check names the cells the run measured
    rng = np.random.default_rng(8)

    def checks(cells):
        done = _samples(cells)
        return {c[0]: (c[1], c[2]) for c in acceptance(_res(done), None, done)}

    # 60 samples per cell: bf16 60/60 clears 90 %, naive 0/60 is > 20 points below, oscar-int2 equal to bf16
    full = {**{(t, L, "bf16"): [1] * 60 for t, L in keys}, **{(t, L, "naive-int2"): [0] * 60 for t, L in keys},
            **{(t, L, "oscar-int2"): [1] * 60 for t, L in keys}}
    c = checks(full)
    assert c[BF16_CHECK][0] == "PASS"
    assert c["naive-int2 clearly below bf16 (paired)"][0] == "PASS"
    # 60/60 vs 60/60: the paired interval is about +-6 points, which still straddles -5: unresolved
    assert c["oscar-int2 within 5 points of bf16 (paired)"][0] == "UNRESOLVED"
    assert "would resolve it" in c["oscar-int2 within 5 points of bf16 (paired)"][1]
    # 20 samples: bf16 20/20 cannot clear 90 % (Wilson lower bound 83.9 %): unresolved, with a projection
    small = {k: v[:20] for k, v in full.items()}
    c = checks(small)
    v, det = c[BF16_CHECK]
    assert v == "UNRESOLVED" and f"~{iv.resolve_n_wilson(20, 20, 0.90)} samples" in det
    # bf16 collapses in one cell, oscar-int2 loses 40 points in every cell: both missed
    bad = dict(full)
    bad[("niah_single_1", 4096, "bf16")] = [1] * 20 + [0] * 40
    for t, L in keys:
        bad[(t, L, "oscar-int2")] = list(rng.permutation([1] * 36 + [0] * 24))
    c = checks(bad)
    assert c[BF16_CHECK][0] == "MISSED"
    assert c["oscar-int2 within 5 points of bf16 (paired)"][0] == "MISSED"
    # bf16 20/60 vs naive 0/60 at 4k: a 33-point gap whose interval still clears 20 points
    assert c["naive-int2 clearly below bf16 (paired)"][0] == "PASS"
    lo = -ev.paired_diff(np.zeros(60), np.array([1] * 20 + [0] * 40))[2]
    assert lo > 20


def test_report_checks_goal_perplexity_limits_by_model():
    """The report checks the accuracy goal's perplexity limits of its model (strict 1.15x, serving 1.01x for SmolLM2) against
    bf16 on the paired windows; another model gets none of those rows."""
    from oscar.reports.build import acceptance

    rng = np.random.default_rng(9)
    tight = lambda mu: list(mu + rng.normal(0, 0.002, 8))  # noqa: E731
    wins = _windows("bf16", "-", 1024, [0.0] * 8, count=1023)
    wins += _windows("oscar-int2", "strict", 1024, tight(math.log(1.10)), count=1023)   # within 1.15: PASS
    wins += _windows("oscar-int2", "serving", 1024, tight(math.log(1.05)), count=1023)  # 1.05 > 1.01: MISSED
    ppl = pd.DataFrame(ev.ppl_stats(wins, ["bf16", "oscar-int2"], ["strict", "serving"], [1024], 8192))
    c = {x[0]: (x[1], x[2]) for x in acceptance(None, ppl, None, wins, 8192, "smollm2-135m")}
    strict, serving = ("ppl oscar-int2 <= 1.15x bf16 (strict; the accuracy goal for smollm2-135m)",
                       "ppl oscar-int2 <= 1.01x bf16 (serving; the accuracy goal for smollm2-135m)")
    assert c[strict][0] == "PASS" and c[serving][0] == "MISSED"
    r = ev.ppl_pair_check(wins, 8192, [1024], "oscar-int2", "bf16", "serving", threshold=1.01)["rows"][0]
    assert r[1] == pytest.approx(1.05, rel=5e-3) and r[2] > 1.01  # the ratio to bf16, its interval above the limit
    assert "1k: 1.05" in c[serving][1]
    # the Qwen limit (strict 1.10) on the same windows straddles 1.10: unresolved, not passed
    q = {x[0]: x[1:] for x in acceptance(None, ppl, None, wins, 8192, "qwen2.5-0.5b")}
    qs = q["ppl oscar-int2 <= 1.10x bf16 (strict; the accuracy goal for qwen2.5-0.5b)"]
    assert qs[0] in ("UNRESOLVED", "MISSED")
    # only an unresolved limit says how to score more text; a decided one does not
    assert ("oscar validate ppl --tokens N" in qs[1]) == (qs[0] == "UNRESOLVED")
    assert "--tokens N" not in c[strict][1] and "--tokens N" not in c[serving][1]
    assert not [k for k in acceptance(None, ppl, None, wins, 8192, "other-model") if "accuracy goal" in k[0]]
    assert not [k for k in acceptance(None, ppl, None, wins, 8192) if "accuracy goal" in k[0]]


def test_report_checks_goal_needle_rule_pools_the_tasks_per_length():
    """The accuracy goal's needle rule in the report: the goal's tasks pooled per length, paired with bf16 (lab/goal_cells.py's
    rule, tested there cell by cell); a cell the run lacks is counted, and another model gets no row."""
    from oscar.reports.build import acceptance

    name = "oscar-int2 within 5 points of bf16, tasks pooled per length (the accuracy goal for smollm2-135m)"

    def check(n, miss=0, lengths=(1024, 2048, 4096), model="smollm2-135m"):
        cells = {}
        for t in ("niah_single_1", "niah_single_2"):
            for L in lengths:
                cells[(t, L, "bf16")] = [1] * n
                cells[(t, L, "oscar-int2")] = [0] * miss + [1] * (n - miss) if L == 4096 else [1] * n
        done = _samples(cells)
        return {c[0]: (c[1], c[2]) for c in acceptance(_res(done), None, done, model=model)}

    v, det = check(300)[name]  # 600 identical pairs per length: within 5 points
    assert v == "PASS" and det.startswith("1k: +0.0 [") and "(600 pairs)" in det
    v, det = check(40, miss=16)[name]  # -40 points at 4k on 80 pairs
    assert v == "MISSED" and "4k: -40.0 [" in det
    v, det = check(300, lengths=(1024, 2048))[name]  # 4k not run: cannot pass
    assert v == "UNRESOLVED" and "2 of 6 (task, length) cells not measured" in det
    assert name not in check(300, model="other-model") and not [k for k in check(300, model=None) if "accuracy goal" in k]


def test_goal_margin_per_length():
    """Qwen's goal: within 2 points at 1k-4k, within 5 at 8k. A loss of 3.5 points on 1,600 pairs (interval about
    [-4.4, -2.6]) passes at 8k and is missed at 4k, by the same rule."""
    goal = ev.ACCURACY_GOALS["qwen2.5-0.5b"]
    assert [ev.goal_margin(goal, L) for L in (1024, 4096, 8192)] == [-2.0, -2.0, -5.0]
    assert ev.margin_label(goal) == "2 points (5 at 8k)"
    cells = {}
    for t in goal["tasks"]:
        for L in goal["lengths"]:
            cells[(t, L, "bf16")] = [1] * 400
            cells[(t, L, "oscar-int2")] = [0] * 14 + [1] * 386  # -3.5 points
    g = ev.needle_goal(_samples(cells), goal, "oscar-int2")
    by = {r["length"]: r["verdict"] for r in g["rows"]}
    assert by == {1024: "MISSED", 2048: "MISSED", 4096: "MISSED", 8192: "PASS"} and g["verdict"] == "MISSED"
