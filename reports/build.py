"""`oscar report DIR`: Markdown + self-contained HTML from the result files of a run.

Reads only files (never kernels or cluster code):
  results.parquet   suite, task, method, length, samples, score        (validate niah)
  ppl.parquet       method, protocol, context, ppl, bits_per_element   (validate ppl)
  goal.json         the product goal check                             (validate ppl)
  memory.json       bytes per token per method                         (validate niah)
  attention.parquet attention-level retrieval on captured q/k/v        (validate attention)
  calibration/      Markdown + PNG written by the fit stage's calibration_section
  ablation/         the controlled ablation, summarised by oscar.reports.ablation when present
Writes DIR/report.md, DIR/report.html (plots embedded as base64 PNG) and DIR/report/*.png.
"""

from __future__ import annotations

import base64
import glob
import html
import json
import os
import re
from dataclasses import dataclass

import pandas as pd

from oscar.validate import evidence as ev, ruler_outputs as ro
from oscar.common import OscarError
from oscar.validate.evidence import (ACCURACY_GOALS, MIN_BLOCKS, SEGMENT, margin_label, needle_goal, niah_check,
                                     ppl_pair_check, score_interval)
from oscar.validate.intervals import wilson
from oscar.reports import ablation
from oscar.reports.plots import panels, save
from oscar.validate.ruler_outputs import task_order

METHOD_ORDER = ["bf16", "naive-int2", "kivi2", "hadamard-int2", "oscar-ref-int2", "oscar-int2"]


def host_line(info: dict) -> str:
    """The compute dtype and the native CPU kernels a run took on its host (run.json)."""
    paths = info.get("native_paths") or {}
    kern = "; ".join(f"{k}: {'native' if v.get('native') else 'torch'} ({v.get('why', '')})" for k, v in paths.items())
    return (f"Model compute dtype {info.get('compute_dtype')} (the host's choice unless `--dtype` was given)"
            + (f"; CPU kernels — {kern}" if kern else "") + ".")


def placement_line(placement: dict) -> str:
    """Where each step of the run ran (run.json's `placement`): stages, replicas and device, or why it did not."""
    def where(p: dict) -> str:
        if "why" in p:
            return f"{p['on']} ({p['why']})"
        n = p.get("stages", 1)
        rep = f" x {p['replicas']} replicas" if p.get("replicas", 1) > 1 else ""
        return f"{n} stage{'s' if n > 1 else ''}{rep} on {p['device']} ({p['on']})"
    return "Steps ran on: " + "; ".join(f"{k} {where(p)}" for k, p in placement.items()) + "."


def _order(methods) -> list[str]:
    ms = list(dict.fromkeys(methods))
    return sorted(ms, key=lambda m: (METHOD_ORDER.index(m) if m in METHOD_ORDER else len(METHOD_ORDER), m))


def _len_label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def num(x: float, spec: str = ".1f") -> str:
    """`format(x, spec)` without a negative zero: -0.0, and what rounds to it (-0.04 at .1f), print as 0.0."""
    s = format(x, spec)
    if s[:1] == "-" and x == x:
        try:
            if float(s.rstrip("%×x")) == 0:
                return ("+" if "+" in spec else "") + s[1:]
        except ValueError:
            pass
    return s


def scope_label(tasks, lengths, all_lengths=None) -> str:
    """"niah_single_1/2 at 1k-4k": the tasks and lengths a check covers, as measured. Tasks sharing a prefix
    are shortened (niah_single_1/2); lengths that are a run of `all_lengths` (the default grid) read as a range."""
    tasks, lengths = sorted(dict.fromkeys(tasks)), sorted(dict.fromkeys(int(L) for L in lengths))
    head = tasks[0].rsplit("_", 1)[0] if tasks else ""
    if len(tasks) > 1 and all(t.rsplit("_", 1)[0] == head and "_" in t for t in tasks):
        t = head + "_" + "/".join(t.rsplit("_", 1)[1] for t in tasks)
    else:
        t = ", ".join(tasks)
    grid = sorted(all_lengths or lengths)
    run = len(lengths) > 2 or (len(lengths) == 2 and all(L in grid for L in lengths)
                               and grid.index(lengths[1]) - grid.index(lengths[0]) == 1)
    if run and all(L in grid for L in lengths) and grid.index(lengths[-1]) - grid.index(lengths[0]) == len(lengths) - 1:
        ls = f"{_len_label(lengths[0])}-{_len_label(lengths[-1])}"
    else:
        ls = ", ".join(_len_label(L) for L in lengths)
    return f"{t} at {ls}"


def md_table(header: list[str], rows: list[list]) -> str:
    def cell(x):
        if isinstance(x, float):
            return "—" if x != x else num(x, ".1f") if abs(x) >= 10 else num(x, ".3g")
        return str(x)

    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(cell(x) for x in r) + " |" for r in rows]
    return "\n".join(out)


# ----------------------------------------------------------------- checks (the issue's "must hold")

CHECK_TASKS, CHECK_LENGTHS = ["niah_single_1", "niah_single_2"], [1024, 2048, 4096]


def _n(k: int, unit: str) -> str:
    return f"{k} {unit}" + ("" if k == 1 else "s")


def _iv(lo: float, hi: float, fmt: str = ".1f") -> str:
    return "" if lo != lo or hi != hi else f" [{num(lo, fmt)}–{num(hi, fmt)}]"


def _resolve(c: dict, unit: str) -> str:
    if c["verdict"] != "UNRESOLVED":
        return ""
    out = f"; ~{c['resolve']} {unit} would resolve it" if c.get("resolve") else ""
    if c.get("stuck"):
        out += (f"; {c['stuck']} cell(s) with no interval (fewer than 2 {unit}) or an estimate on the threshold: "
                "more data, not a projection, decides those")
    return out


def acceptance(res, ppl, done: dict | None = None, windows: list | None = None, tokens: int | None = None,
               model: str | None = None) -> list[tuple[str, str, str]]:
    """(check, status, detail) for the validation targets; status is PASS, MISSED or UNRESOLVED by the
    interval rule (oscar.validate.intervals.verdict / combine): per-cell 95 % intervals for PASS, intervals
    at 1 - 0.05/m over the m cells for MISSED. With `model` one with an accuracy goal (oscar.validate.evidence.ACCURACY_GOALS),
    also that goal: its needle rule (tasks pooled per length, the run's samples) and its perplexity limits
    (oscar-int2 vs bf16, strict and serving)."""
    out = []
    goal = ACCURACY_GOALS.get(model or "")
    if res is not None and len(res):
        r = res[(res.suite == "ruler") & res.task.isin(CHECK_TASKS) & res.length.isin(CHECK_LENGTHS)]
        n = r.groupby(["task", "length", "method"]).samples.min()
        few = int(n.min()) if len(n) else 0
        note = f"; {few} samples per cell (target >= 20)" if few < 20 else f"; >= {few} samples per cell"
        methods = set(r.method)

        def keys(m):
            return sorted({(t, L) for t, L, mm in zip(r.task, r.length, r.method) if mm == m})

        def where(c):
            return f" ({c['worst'][0]} {_len_label(c['worst'][1])})" if c.get("worst") else ""

        def scope(ks):  # what the check covers: the cells this run measured, never the default grid it did not
            return scope_label([t for t, _ in ks], [L for _, L in ks], CHECK_LENGTHS)

        if "bf16" in methods:
            c = niah_check(done, r, keys("bf16"), "bf16", 90.0, "above", paired=False)
            w = c["worst"]
            out.append((f"bf16 >= 90% on {scope(keys('bf16'))}", c["verdict"],
                        f"min {num(w[2])}%{_iv(w[3], w[4])}{where(c)}{note}{_resolve(c, 'samples per cell')}"))
        for m, thr, better, name, label in (("naive-int2", -20.0, "below", "naive-int2 clearly below bf16", "smallest gap"),
                                            ("oscar-int2", -5.0, "above", "oscar-int2 within 5 points of bf16", "largest gap")):
            both = sorted(set(keys(m)) & set(keys("bf16")))  # paired: only cells both methods measured
            if both:
                # the bf16 check's name states the cells; a paired check on fewer of them says which
                on = "" if both == keys("bf16") else f"on {scope(both)}: "
                c = niah_check(done, r, both, m, thr, better, paired=True)
                if not done:
                    out.append((name, c["verdict"], on + "no per-sample file (niah_samples.jsonl): no paired interval"))
                    continue
                w = max(c["rows"], key=lambda x: x[4]) if better == "below" else min(c["rows"], key=lambda x: x[3])
                out.append((name + " (paired)", c["verdict"],
                            f"{on}{label} {num(-w[2])} points{_iv(-w[4], -w[3])} ({w[0]} {_len_label(w[1])}){note}"
                            f"{_resolve(c, 'samples per cell')}"))

    if goal and done and {"bf16", "oscar-int2"} <= {k[3] for k in done}:  # the goal's rule: tasks pooled per length
        g = needle_goal(done, goal, "oscar-int2")
        if g["rows"]:
            det = ", ".join(f"{_len_label(x['length'])}: {num(x['diff'], '+.1f')} [{num(x['lo'], '+.1f')}, "
                            f"{num(x['hi'], '+.1f')}] "
                            f"({x['pairs']} pairs)" for x in g["rows"])
            need = max([x.get("resolve_pairs") or 0 for x in g["rows"]], default=0)
            det += f"; ~{need} pairs per length would resolve it" if g["verdict"] == "UNRESOLVED" and need else ""
            if g["not_measured"]:
                det += f"; {len(g['not_measured'])} of {len(goal['tasks']) * len(goal['lengths'])} (task, length) cells not measured"
            out.append((f"oscar-int2 within {margin_label(goal)} of bf16, tasks pooled per length "
                        f"(the accuracy goal for {model})", g["verdict"], det))
    if ppl is not None and len(ppl):
        for proto in ("strict", "serving"):
            p = ppl[ppl.protocol == proto].pivot_table(index="context", columns="method", values="ppl")
            if "oscar-int2" not in p:
                continue

            def measured(*ms):  # the contexts where every one of `ms` was scored under this protocol
                return [int(c) for c in p.index if all(m in p and p.loc[c, m] == p.loc[c, m] for m in ms)]

            for other in ("naive-int2", "kivi2", "hadamard-int2", "oscar-ref-int2"):
                ctxs = measured("oscar-int2", other)
                if not ctxs:
                    continue
                name = f"ppl oscar-int2 < {other} ({proto})"
                if not windows:
                    out.append((name, "UNRESOLVED", "no per-window file (ppl_windows.jsonl): no paired interval; "
                                + ", ".join(f"{_len_label(c)}: {p.loc[c, 'oscar-int2']:.3f} vs {p.loc[c, other]:.3f}" for c in ctxs)))
                    continue
                c = ppl_pair_check(windows, tokens or 0, ctxs, "oscar-int2", other, proto)
                det = ", ".join(f"{_len_label(x[0])}: ratio {x[1]:.3f}{_iv(x[2], x[3], '.3f')} ({_n(x[4], x[5])})" for x in c["rows"])
                out.append((name, c["verdict"], det + _resolve(c, "blocks")))
            ctxs = measured("oscar-int2", "bf16")
            if goal and ctxs and windows:  # the model's perplexity limit, on the same paired blocks
                c = ppl_pair_check(windows, tokens or 0, ctxs, "oscar-int2", "bf16", proto, threshold=goal[proto])
                det = ", ".join(f"{_len_label(x[0])}: {x[1]:.3f}x{_iv(x[2], x[3], '.3f')} ({_n(x[4], x[5])})" for x in c["rows"])
                more = ("; `oscar validate ppl --tokens N` scores more held-out text (past the split: docstrings)"
                        if c["verdict"] == "UNRESOLVED" else "")
                out.append((f"ppl oscar-int2 <= {goal[proto]:.2f}x bf16 ({proto}; the accuracy goal for {model})",
                            c["verdict"], det + _resolve(c, "blocks") + more))
    return out


# ----------------------------------------------------------------- plots


def _plot_accuracy(res, path: str) -> str | None:
    r = res[res.suite == "ruler"]
    tasks = list(dict.fromkeys(r.task))
    if not tasks:
        return None
    fig, axes = panels(len(tasks), 4.2, 3.2)
    for ax, t in zip(axes, tasks):
        d = r[r.task == t]
        ms = _order(d.method)
        for i, m in enumerate(ms):
            dm = d[d.method == m].sort_values("length")
            x = dm.length * 2 ** (0.06 * (i - (len(ms) - 1) / 2))  # spread the methods' bars apart (log axis)
            # 95 % interval; clipped at 0: a score equal to its bound can sit a rounding error outside it
            err = [(dm.score - dm.ci_low).clip(lower=0), (dm.ci_high - dm.score).clip(lower=0)] if "ci_low" in dm else None
            ax.errorbar(x, dm.score, yerr=err, marker="o", ms=4, capsize=2, lw=1.2, elinewidth=0.8, label=m)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(d.length.unique()), [_len_label(x) for x in sorted(d.length.unique())])
        ax.set_ylim(-3, 103)
        ax.set_title(t)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("score (%, bars: 95% interval)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    return save(fig, path)


def _plot_ppl(ppl, path: str) -> str | None:
    """Ratio to bf16 with its paired 95 % interval (what the verdicts use), per protocol; the
    perplexity itself when the table has no ratio intervals (results from before them)."""
    if ppl is None or not len(ppl):
        return None
    ratio = "ratio_ci_low" in ppl
    protos = list(dict.fromkeys(ppl.protocol))
    fig, axes = panels(len(protos), 5, 3.4, cols=len(protos))
    for ax, p in zip(axes, protos):
        d = ppl[(ppl.protocol == p) & ((ppl.method != "bf16") | (not ratio))]
        ctxs = sorted(d.context.unique())
        ms = _order(d.method)
        w = 0.8 / max(1, len(ms))
        for i, m in enumerate(ms):
            dm = d[d.method == m].set_index("context")
            col = "ratio" if ratio else "ppl"
            y = [float(dm[col].get(c, float("nan"))) for c in ctxs]
            err = None
            if ratio:
                lo = [float(dm.ratio_ci_low.get(c, float("nan"))) for c in ctxs]
                hi = [float(dm.ratio_ci_high.get(c, float("nan"))) for c in ctxs]
                err = [[a - b if b == b else 0.0 for a, b in zip(y, lo)], [b - a if b == b else 0.0 for a, b in zip(y, hi)]]
            ax.bar([k + i * w for k in range(len(ctxs))], y, w, yerr=err, capsize=2, label=m)
        ax.set_xticks([k + 0.4 - w / 2 for k in range(len(ctxs))], [_len_label(c) for c in ctxs])
        ax.set_yscale("log")
        if ratio:
            ax.axhline(1.0, color="k", lw=0.8)
            if p == "strict":
                ax.axhline(1.25, color="k", ls="--", lw=0.8, label="goal 1.25×")
        ax.set_title(f"{'perplexity / bf16 (95% interval)' if ratio else 'perplexity'}, {p} protocol")
        ax.set_xlabel("context")
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    return save(fig, path)


def _margin_bins(att) -> list[str]:
    """The margin bins present, in increasing order (labels "lo-hi" and ">=lo")."""
    return sorted(att.margin_bin.unique(), key=lambda b: float(b.lstrip(">=").split("-")[0]))


def _plot_attention(att, path: str) -> str | None:
    if att is None or not len(att):
        return None
    curve = "margin_bin" in att.columns
    fig, axes = panels(3 if curve else 2, 5, 3.4)
    for m in _order(att.method):
        d = att[att.method == m].groupby("length").mean(numeric_only=True).reset_index()
        axes[0].plot(d.length, 100 * d.top1, marker="o", label=m)
        axes[1].plot(d.length, d.out_rel_err, marker="o", label=m)
        if curve:
            bins = _margin_bins(att)
            c = att[att.method == m].groupby("margin_bin").top1.mean()
            axes[2].plot(range(len(bins)), [100 * c.get(b, float("nan")) for b in bins], marker="o", label=m)
    for ax, t in zip(axes, ["needle kept top-1 (%)", "attention-output relative error"]):
        ax.set_xscale("log", base=2)
        ax.set_title(t)
        ax.set_xlabel("keys (context length)")
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    if curve:
        bins = _margin_bins(att)
        axes[2].set_xticks(range(len(bins)), bins, rotation=30, fontsize=8)
        axes[2].set_title("needle kept top-1 (%) vs its exact margin")
        axes[2].set_xlabel("margin over the runner-up key (nats)")
        axes[2].grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    return save(fig, path)


# ----------------------------------------------------------------- sections


def _read(d: str, name: str):
    p = os.path.join(d, name)
    return pd.read_parquet(p) if os.path.exists(p) else None


def _skipped(d: str) -> dict[str, str]:
    """{method: reason} of the methods validation left out of a default list because their cache format cannot
    serve the model (skipped_methods.json, in DIR or one level down)."""
    skipped: dict[str, str] = {}
    for p in sorted(glob.glob(os.path.join(d, "skipped_methods.json")) + glob.glob(os.path.join(d, "*", "skipped_methods.json"))):
        try:
            skipped.update(json.load(open(p)))
        except (OSError, ValueError):
            continue
    return skipped


def skipped_line(d: str) -> list[str]:
    """The header's line naming the methods of the default list this run did not measure (empty when none)."""
    skipped = _skipped(d)
    if not skipped:
        return []
    return [f"Not measured: {', '.join(f'`{m}`' for m in sorted(skipped))}, left out of the default method list "
            "because the cache format cannot serve this model (Methods skipped, below).", ""]


def _skipped_section(d: str) -> list[str]:
    """Methods validation skipped because their cache format cannot serve the model (skipped_methods.json)."""
    skipped = _skipped(d)
    if not skipped:
        return []
    return ["## Methods skipped", "", md_table(["method", "reason"], [[m, r] for m, r in sorted(skipped.items())]), ""]


def _cell(est: float, lo: float, hi: float) -> str:
    return "—" if est != est else f"{num(est)}{_iv(lo, hi, '.0f')}"


def _avg_over_tasks(r, done: dict | None, method: str, length: int) -> tuple[float, float, float]:
    """Score of `method` at `length` pooled over the tasks' samples, with its 95 % interval."""
    d = r[(r.method == method) & (r.length == length)]
    if not len(d):
        return float("nan"), float("nan"), float("nan")
    if done:
        x = [v["score"] for (t, L, i, m), v in done.items() if m == method and L == length and t in set(d.task)]
        if x:
            lo, hi, _ = score_interval(x)
            return 100 * sum(x) / len(x), lo, hi
    k, n = float((d.score * d.samples / 100).sum()), int(d.samples.sum())
    lo, hi = wilson(round(k), n)
    return 100 * k / n, 100 * lo, 100 * hi


def needle_avg_table(r, done: dict | None, methods=None) -> tuple[list[str], list[list]]:
    """(header, rows) of the score averaged over tasks (samples pooled), one column per length."""
    lengths = sorted(r.length.unique())
    rows = []
    for m in methods or _order(r.method):
        rows.append([m] + [_cell(*_avg_over_tasks(r, done, m, L)) for L in lengths])
    return ["method"] + [_len_label(L) for L in lengths], rows


def _ruler_niah_config(d: str) -> dict:
    p = os.path.join(d, "niah_config.json")
    try:
        return json.load(open(p)) if os.path.exists(p) else {}
    except (OSError, ValueError):
        return {}


def ruler_main_table(r, done: dict | None, methods=None) -> tuple[list[str], list[list]]:
    """(header, rows) of RULER's paper layout: methods x lengths, each cell the mean over the tasks run of their
    scores (%) with its 95 % interval, then the mean over every (task, length) cell. From the per-sample rows
    (validate/ruler_outputs.py: the rows summary.csv and results.json are written from); without them, from
    results.parquet (pooled Wilson interval)."""
    lengths = sorted(int(L) for L in r.length.unique())
    cs = ro.cells({k: v for k, v in done.items() if k[0] in set(r.task)}) if done else None
    rows = []
    for m in methods or _order(r.method):
        cells = []
        for L in lengths:
            if cs is not None:
                est, lo, hi, k = ro.average(cs, m, L)
                cells.append(_cell(100 * est, 100 * lo, 100 * hi) if k else "—")
            else:
                cells.append(_cell(*_avg_over_tasks(r, None, m, L)))
        if cs is not None:
            est, lo, hi = ro.overall(cs, m)
            cells.append(_cell(100 * est, 100 * lo, 100 * hi))
        else:
            d = r[r.method == m]
            cells.append(f"{d.score.mean():.1f}" if len(d) else "—")
        rows.append([m] + cells)
    return ["method"] + [_len_label(L) for L in lengths] + ["Avg."], rows


def _span(samples) -> str:
    n = sorted({int(x) for x in samples})
    return f"{n[0]}" if len(n) == 1 else f"{n[0]}–{n[-1]}"


def _ruler_protocol_notes(r, cfg: dict) -> list[str]:
    """Where this protocol differs from RULER's, and what was skipped: said beside the table people compare."""
    c = cfg.get("config") or {}
    per = _span(r.samples)
    tasks = list(task_order(r.task))
    out = [f"Tasks run: {', '.join(tasks)} ({len(tasks)} of RULER's 13).", ""]
    for t, why in (cfg.get("skipped_tasks") or {}).items():
        out += [f"Skipped: {t} — {why}.", ""]
    for ds, f in (cfg.get("qa_files") or {}).items():
        out += [f"QA file ({ds}): `{f.get('path')}` (sha256 {f.get('fingerprint')}).", ""]
    out += ["Where this differs from RULER's own protocol (NVIDIA/RULER):", "",
            "- Templates and generators are written here (validate/ruler.py) from RULER's task definitions: the same "
            "task families, needle layouts and scoring (string_match_all; string_match_part for qa_1 / qa_2), with our "
            "own wording and word lists; haystacks are held-out corpus text "
            f"({c.get('corpus', 'pydoc')}) and noise sentences, not RULER's essays.",
            f"- Samples per task and length: {per} here (RULER's default is 500); every cell carries its 95 % interval.",
            "- The prompt goes through the model's own chat template (one user turn, then the assistant header and the "
            "answer prefix); RULER applies its per-model template and lm-evaluation-harness a raw prompt unless asked.",
            "- No in-context example for vt / cwe; cwe scales the common words' frequency down below 8k so the list fits.",
            "- The answer budget is the references' own length + 16 tokens (QA: at least 32, RULER's); RULER reserves "
            "a fixed budget per task. The target length counts prompt + budget, as RULER's does.",
            "- The prompt is prefilled into each method's KV cache in two chunks (haystack, then question) under the "
            f"{c.get('protocol', 'strict')} protocol; greedy decoding.",
            "- qa_1 / qa_2 read the SQuAD / HotpotQA files given (`--squad`, `--hotpotqa`): gold document(s) plus "
            "other documents of the same file, shuffled, as RULER; QA prompts grow in whole documents, so they end "
            "up to one document below the target length.",
            "- Comparable files: `ruler/<method>/<length>/summary.csv` (RULER's summary layout; written even for one "
            "task, where RULER names it summary-<task>.csv) and `ruler/<method>/results.json` "
            "(lm-evaluation-harness's results layout, 0–1 scale, -1 where a length has no samples).", ""]
    return out


def _ruler_section(res, figdir: str, done: dict | None = None) -> list[str]:
    d = os.path.dirname(figdir)
    cfg = _ruler_niah_config(d)
    if res is None or not len(res[res.suite == "ruler"]):
        skipped = [f"Skipped: {t} — {why}." for t, why in (cfg.get("skipped_tasks") or {}).items()]
        return ["## RULER-style tasks", "", "No NIAH results in this directory (`oscar validate niah`).", "",
                *(skipped + [""] if skipped else [])]

    r = res[res.suite == "ruler"]
    proto = ", ".join(sorted(set(r.protocol))) if "protocol" in r else "strict"
    out = [f"## RULER-style tasks ({proto} protocol)", ""]
    lengths = sorted(r.length.unique())
    head, rows = ruler_main_table(r, done)
    out += ["Score = RULER string match (%), averaged over the tasks run at each length (RULER's paper table); "
            "Avg. = over every (task, length) cell. [brackets]: 95 % interval over samples (Wilson for 0/1 scores, "
            "bootstrap otherwise; per-task bootstrap when tasks have unequal samples).", "",
            md_table(head, rows), ""]
    out += _ruler_protocol_notes(r, cfg)
    out += ["### Per task", "",
            f"Samples per cell: {_span(r.samples)}; the needle prompt is prefilled into "
            "each method's cache, then the question attends to it.", ""]
    has_ci = "ci_low" in r
    for t in task_order(r.task):
        dt = r[r.task == t]
        rows = []
        for m in _order(dt.method):
            dm = dt[dt.method == m].set_index("length")
            vals = [float(dm.score.get(L, float("nan"))) for L in lengths]
            cells = [_cell(v, float(dm.ci_low.get(L)), float(dm.ci_high.get(L))) if has_ci and v == v else _cell(v, *(float("nan"),) * 2)
                     for v, L in zip(vals, lengths)]
            have = [v for v in vals if v == v]
            rows.append([m] + cells + [sum(have) / len(have) if have else float("nan")])
        out += [f"#### {t}", "", md_table(["method"] + [_len_label(L) for L in lengths] + ["Avg."], rows), ""]
    if "diff_vs_bf16" in r and r.diff_vs_bf16.notna().any():
        out += ["### Paired difference to bf16 (points, same samples)", "",
                "Each cell: method − bf16 [95 % interval: Newcombe for 0/1 scores, paired bootstrap otherwise]; "
                "* marks a difference significant after Holm's correction over every cell compared "
                "(exact McNemar / sign-flip test, adjusted p < 0.05).", ""]
        rows = []
        for t in task_order(r.task):
            for m in _order(r.method):
                if m == "bf16":
                    continue
                dm = r[(r.task == t) & (r.method == m)].set_index("length")
                if not len(dm):
                    continue
                cells = []
                for L in lengths:
                    if L not in dm.index or dm.diff_vs_bf16.get(L) != dm.diff_vs_bf16.get(L):
                        cells.append("—")
                        continue
                    star = "*" if dm.p_holm.get(L) < 0.05 else ""
                    cells.append(f"{num(dm.diff_vs_bf16.get(L), '+.1f')}{_iv(dm.diff_ci_low.get(L), dm.diff_ci_high.get(L), '+.0f')}{star}")
                rows.append([t, m] + cells)
        out += [md_table(["task", "method"] + [_len_label(L) for L in lengths], rows), ""]
    p = _plot_accuracy(r, os.path.join(figdir, "accuracy_vs_length.png"))
    if p:
        out += [f"![accuracy vs length]({os.path.relpath(p, os.path.dirname(figdir))})", ""]
    return out


def _cost_section(done: dict | None) -> list[str]:
    """CPU seconds per needle sample by (task, length), from the batch costs niah_samples.jsonl rows record
    (a batch: the samples of one cell decoded together, every method of each; one sample per batch from 4k up)."""
    if not done:
        return []
    per_sample: dict[tuple, set] = {}  # (task, length, index) -> the batches its rows came from
    for (t, L, i, m), r in done.items():
        if "batch_cpu_s" in r:
            per_sample.setdefault((t, L, i), set()).add((r["batch_cpu_s"], r["batch_wall_s"], r["batch_samples"]))
    if not per_sample:
        return []
    cells: dict[tuple, list] = {}
    for (t, L, i), bs in per_sample.items():  # a batch's cost split evenly over its samples
        c = cells.setdefault((t, L), [0, 0.0, 0.0])
        c[0] += 1
        c[1] += sum(cpu / n for cpu, _, n in bs)
        c[2] += sum(wall / n for _, wall, n in bs)
    rows = [[t, _len_label(L), n, f"{cpu / n:.0f}", f"{cpu / 60:.1f}", f"{wall / 60:.1f}"]
            for (t, L), (n, cpu, wall) in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1]))]
    tot = sum(c[1] for c in cells.values())
    return ["## Compute", "",
            "CPU seconds of the needle runs (the process that decoded each batch: prefill of each sample, shared by "
            "its methods, and the decode of every method's row), as recorded per batch in niah_samples.jsonl. "
            "Batch wall minutes are summed over batches, so with several worker processes they add up to more than "
            "the stage's wall time (run.json has that); they also depend on what else ran on the host. "
            f"Total {tot / 60:.1f} CPU min.", "",
            md_table(["task", "length", "samples", "CPU s / sample", "CPU min", "batch wall min (summed)"], rows), ""]


def _steps_section(info: dict) -> list[str]:
    """run.json's `steps`, for a run made of several commands: each one as run, with its time."""
    steps = info.get("steps") or []
    if not steps:
        return []
    rows = [[s.get("stage", ""), f"`{s['command']}`", "" if s.get("cpu_s") is None else f"{s['cpu_s'] / 60:.1f}",
             "" if s.get("wall_s") is None else f"{s['wall_s'] / 60:.1f}", s.get("note", "")] for s in steps]
    return ["## Commands", "", "Each step is one command; re-running it resumes or reproduces it "
            "(the needle commands resume from niah_samples.jsonl).", "",
            md_table(["stage", "command", "CPU min", "wall min", "note"], rows), ""]


def _ratio_cell(x) -> str:
    """'1.16× [1.13–1.19]' with † when the interval rests on fewer than 8 blocks."""
    if "ratio" not in x or x.ratio != x.ratio:
        return f"{x.ratio_vs_bf16:.2f}×" if "ratio_vs_bf16" in x and x.ratio_vs_bf16 == x.ratio_vs_bf16 else "—"
    few = "†" if x.method != "bf16" and int(x.blocks) < MIN_BLOCKS else ""
    return f"{x.ratio:.3g}×{_iv(x.ratio_ci_low, x.ratio_ci_high, '.3g')}{few}"


def ppl_ratio_table(ppl, methods=None) -> tuple[list[str], list[list]]:
    """(header, rows): bits/elem and the ratio to bf16 with its interval, per protocol and context."""
    ctxs = sorted(ppl.context.unique())
    protos = list(dict.fromkeys(ppl.protocol))
    rows = []
    for m in methods or [m for m in _order(ppl.method) if m != "bf16"]:
        d = ppl[ppl.method == m]
        if not len(d):
            continue
        row = [m, float(d.bits_per_element.iloc[0])]
        for p in protos:
            for c in ctxs:
                x = d[(d.protocol == p) & (d.context == c)]
                row.append(_ratio_cell(x.iloc[0]) if len(x) else "—")
        rows.append(row)
    return ["method", "bits/elem"] + [f"{p} {_len_label(c)}" for p in protos for c in ctxs], rows


def _few_blocks_note(ppl) -> str:
    if "blocks" not in ppl:
        return "No intervals: these results predate per-window intervals."
    few = ppl[(ppl.method != "bf16") & (ppl.blocks < MIN_BLOCKS)]
    note = (f"Ratio intervals: paired by block with bf16, expanded-percentile bootstrap; a block is a window, or a "
            f"{SEGMENT}-token segment of one when a context has fewer than {MIN_BLOCKS} windows.")
    if len(few):
        desc = ", ".join(f"{_len_label(c)}: {_n(int(g.blocks.min()), g.block.iloc[0])}" for c, g in few.groupby("context"))
        note += f" † fewer than {MIN_BLOCKS} blocks ({desc}): read these intervals as rough, or absent."
    return note


def _ppl_section(ppl, goal, figdir: str) -> list[str]:
    out = ["## Perplexity (held-out text)", ""]
    if ppl is None or not len(ppl):
        return out + ["No perplexity results (`oscar validate ppl`).", ""]
    out += ["strict: only the 64 sink tokens exact, every other token read from INT2 by every later query once "
            "its page (the artifact's page_size: 16 by default, 8 for oscar-ref; per-channel keys: their token "
            "group) is complete, as the paged cache stores it; serving: sink 64 + recent 256 exact (docs/validation.md).", ""]
    ctxs = sorted(ppl.context.unique())
    header = ["method", "bits/elem"] + [f"{p} {_len_label(c)}" for p in dict.fromkeys(ppl.protocol) for c in ctxs]
    rows = []
    for m in _order(ppl.method):
        d = ppl[ppl.method == m]
        row = [m, float(d.bits_per_element.iloc[0])]
        for p in dict.fromkeys(ppl.protocol):
            for c in ctxs:
                x = d[(d.protocol == p) & (d.context == c)]
                if len(x):
                    r = x.iloc[0]
                    ratio = f" ({_ratio_cell(r)})" if m != "bf16" else (f" (1×, {_n(int(r.windows), 'window')})" if "windows" in x else "")
                    row.append(f"{r.ppl:.3f}{ratio}")
                else:
                    row.append("—")
        rows.append(row)
    out += [md_table(header, rows), "", _few_blocks_note(ppl), ""]
    p = _plot_ppl(ppl, os.path.join(figdir, "perplexity.png"))
    if p:
        out += [f"![perplexity]({os.path.relpath(p, os.path.dirname(figdir))})", ""]
    return out


def _memory_section(mem) -> list[str]:
    latent = any(m.get("cache") == "latent" for m in mem or [])
    out = ["## Memory (" + ("latent cache bytes per token: c_kv + RoPE key" if latent else "K+V bytes per token")
           + ", all layers)", ""]
    if not mem:
        return out + ["No memory table (written by `oscar validate niah`).", ""]
    ctxs = sorted({m["context"] for m in mem})
    protos = list(dict.fromkeys(m["protocol"] for m in mem))
    rows = []
    for meth in _order(m["method"] for m in mem):
        r = [x for x in mem if x["method"] == meth]
        row = [meth, r[0]["bits_per_element"], r[0]["bytes_per_token_history"]]
        for p in protos:
            for c in ctxs:
                x = [y for y in r if y["protocol"] == p and y["context"] == c]
                row.append(f"{x[0]['bytes_per_token_avg']:.0f} ({x[0]['ratio_vs_bf16']:.3f}×)" if x else "—")
        rows.append(row)
    sr = {p: next(f"{x['sink']}+{x['recent']}" for x in mem if x["protocol"] == p) for p in protos}
    return out + [md_table(["method", "bits/elem", "history B/token"] + [f"{p} ({sr[p]} exact) @{_len_label(c)}" for p in protos for c in ctxs], rows),
                  "", ("History = one token stored quantized over all layers: c_kv's codes + a scale and zero per "
                       "group (bits/elem counts these per latent value), and the 16-bit RoPE key. " if latent else
                       "History = one token stored quantized, K+V over all layers (codes + fp16 scale/zero). ") +
                  "Other columns: average bytes per token at that context, the exact sink/recent tokens included, and the ratio to bf16.", ""] \
        + _method_notes(mem)


def _method_notes(mem) -> list[str]:
    """The methods compared, and what each lacks (memory.json's `note`, written by validate)."""
    notes = {m["method"]: m.get("note") for m in mem if m.get("note")}
    if not notes:
        return []
    return ["Methods:", ""] + [f"- `{m}`: {notes[m]}" for m in _order(notes)] + [""]


def _attention_section(att, figdir: str) -> list[str]:
    out = ["## Attention-level retrieval on held-out captured q/k/v (not a model run)", ""]
    if att is None or not len(att):
        return out + ["Not run (`oscar validate attention --store STORE`).", ""]
    lengths = sorted(att.length.unique())
    if "margin_bin" not in att.columns:  # an attention.parquet of the older synthetic-needle test
        out += ["**Attention-level test, not an end-to-end model result** (older format: keys resampled from the "
                "calibration reservoirs, a synthetic needle planted 1 std ahead).", ""]
    else:
        meta = {}
        mp = os.path.join(os.path.dirname(figdir), "attention.json")
        if os.path.exists(mp):
            with open(mp) as f:
                meta = json.load(f)
        h = meta.get("heldout", {})
        src = (f" ({h.get('tokens', 0):,} held-out tokens: {h.get('corpus_heldout_tokens', 0):,} of the corpus's held-out "
               f"split, {h.get('docstring_tokens', 0):,} of Python {h.get('python', '?')} standard-library docstrings; "
               f"none shares a {meta.get('overlap_check', {}).get('ngram', 32)}-token run with the calibration store)"
               if h else "")
        out += ["**This is an attention-level test, not an end-to-end model run.** Queries, keys and values are the "
                f"post-RoPE rows the model's attention received on held-out text the fit never saw{src}, captured as "
                f"whole sequences of {int(att.seq_len.iloc[0])} tokens at their own positions and laid end to end: "
                "every key of a context is a distinct real row (no resampling). The query is the context's last "
                "token; the needle is the real key it prefers among the non-sink keys, and its margin is its exact "
                "lead over the runner-up (nats: exp(margin) is their weight ratio). Every non-sink key is read from "
                "INT2. The model itself never ran a context longer than one captured sequence.", ""]
    rows = []
    for m in _order(att.method):
        d = att[att.method == m].groupby("length").mean(numeric_only=True)
        rows.append([m] + [f"{100 * d.top1.get(L, float('nan')):.0f}% / {d.out_rel_err.get(L, float('nan')):.3f}" for L in lengths])
    out += [md_table(["method"] + [_len_label(L) for L in lengths], rows), "",
            "Cells: needle kept top-1 / relative attention-output error (mean over layers, query heads, contexts).", ""]
    if "margin_bin" in att.columns:
        bins = _margin_bins(att)
        n = att[att.method == att.method.iloc[0]].groupby("margin_bin").size()
        rows = []
        for m in _order(att.method):
            c = att[att.method == m].groupby("margin_bin").top1.mean()
            rows.append([m] + [f"{100 * c.get(b, float('nan')):.0f}%" for b in bins])
        out += [md_table(["top-1 kept, by margin (nats)"] + [f"{b} (n={int(n.get(b, 0))})" for b in bins], rows), "",
                "Trials pooled over lengths and layers; n = trials per bin (the same needles for every method).", ""]
    p = _plot_attention(att, os.path.join(figdir, "attention_retrieval.png"))
    if p:
        out += [f"![attention retrieval]({os.path.relpath(p, os.path.dirname(figdir))})", ""]
    return out


def _included_section(d: str, sub: str, title: str) -> list[str]:
    """Markdown files another stage wrote under DIR/<sub>/, image paths rebased onto DIR."""
    files = sorted(glob.glob(os.path.join(d, sub, "*.md")))
    if not files:
        return []
    out = [f"## {title}", ""]
    for f in files:
        text = open(f).read()
        text = re.sub(r"^#\s", "### ", text, flags=re.M)
        text = re.sub(r"^##\s", "### ", text, flags=re.M)
        text = re.sub(r"!\[([^\]]*)\]\((?!https?:|/)([^)]+)\)", lambda m: f"![{m.group(1)}]({sub}/{m.group(2)})", text)
        out += [text.strip(), ""]
    return out


def _ablation_section(d: str) -> list[str]:
    """DIR/ablation/: rebuilt by oscar.reports.ablation.build_report(dir) when present, else its *.md as is."""
    adir = os.path.join(d, "ablation")
    if not os.path.isdir(adir):
        return []

    if os.path.exists(os.path.join(adir, "ablation.parquet")):
        try:
            r = ablation.build_report(adir)
            text = open(r).read() if isinstance(r, str) and os.path.exists(r) else str(r)
        except Exception as e:  # their summary failing must not lose the rest of the report
            text = f"(ablation report failed: {type(e).__name__}: {e})"
        text = re.sub(r"^#{1,2}\s", "### ", text, flags=re.M)
        text = re.sub(r"!\[([^\]]*)\]\((?!https?:|/)([^)]+)\)", lambda m: f"![{m.group(1)}](ablation/{m.group(2)})", text)
        return ["## Controlled ablation (synthetic regimes)", "", text.strip(), ""]
    return _included_section(d, "ablation", "Controlled ablation (synthetic regimes)")


# ----------------------------------------------------------------- markdown -> html (the subset we write)


def _inline(s: str, base: str) -> str:
    s = html.escape(s, quote=False)

    def img(m):
        p = os.path.join(base, html.unescape(m.group(2)))
        if os.path.exists(p):
            data = base64.b64encode(open(p, "rb").read()).decode()
            return f'<img alt="{m.group(1)}" src="data:image/png;base64,{data}">'
        return f"[missing image {m.group(2)}]"

    s = re.sub(r"!\[([^\]]*)\]\(([^)]+)\)", img, s)
    s = re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", s)
    s = re.sub(r"`([^`]+)`", r"<code>\1</code>", s)
    return s


def md_to_html(md: str, base: str, title: str) -> str:
    lines, out, i = md.split("\n"), [], 0
    while i < len(lines):
        ln = lines[i]
        if ln.startswith("```"):
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            out.append("<pre>" + html.escape("\n".join(lines[i + 1:j])) + "</pre>")
            i = j + 1
            continue
        m = re.match(r"^(#{1,6})\s+(.*)", ln)
        if m:
            k = len(m.group(1))
            out.append(f"<h{k}>{_inline(m.group(2), base)}</h{k}>")
        elif ln.startswith("|") and i + 1 < len(lines) and re.match(r"^\|[-:| ]+\|$", lines[i + 1].strip()):
            head = [c.strip() for c in ln.strip().strip("|").split("|")]
            rows = []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append([c.strip() for c in lines[i].strip().strip("|").split("|")])
                i += 1
            t = "<table><tr>" + "".join(f"<th>{_inline(h, base)}</th>" for h in head) + "</tr>"
            t += "".join("<tr>" + "".join(f"<td>{_inline(c, base)}</td>" for c in r) + "</tr>" for r in rows)
            out.append(t + "</table>")
            continue
        elif re.match(r"^\s*[-*] ", ln):
            items = []
            while i < len(lines) and re.match(r"^\s*[-*] ", lines[i]):
                items.append(f"<li>{_inline(lines[i].strip()[2:], base)}</li>")
                i += 1
            out.append("<ul>" + "".join(items) + "</ul>")
            continue
        elif ln.strip():
            out.append(f"<p>{_inline(ln, base)}</p>")
        i += 1
    css = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
           "table{border-collapse:collapse;margin:.6em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
           "th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}img{max-width:100%}"
           "pre{background:#f6f6f6;padding:.6em;overflow-x:auto}code{background:#f3f3f3}")
    return f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>{css}</style></head><body>\n" + "\n".join(out) + "\n</body></html>\n"


# ----------------------------------------------------------------- entry point


@dataclass
class Report:
    markdown: str
    md_path: str
    html_path: str
    wall_seconds: float | None = None  # the run's wall time the report states (build_report's wall_clock)


@dataclass
class Results:
    """A run's result files, with the intervals recomputed from the per-sample / per-window lines
    when the tables predate them (validate/evidence.py)."""

    res: object = None  # results.parquet (+ ci_low, ci_high, paired columns)
    done: dict | None = None  # niah_samples.jsonl
    ppl: object = None  # ppl.parquet (+ windows, blocks, ratio, ratio_ci_low, ratio_ci_high)
    windows: list | None = None  # ppl_windows.jsonl
    tokens: int | None = None  # held-out tokens per context (ppl_config.json)
    model: str | None = None  # the model the run used (ppl_config.json, else niah_config.json)
    goal: dict | None = None  # goal.json, three-valued
    mem: list | None = None
    att: object = None


def load_results(d: str) -> Results:
    def js(name):
        p = os.path.join(d, name)
        return json.load(open(p)) if os.path.exists(p) else None

    r = Results(res=_read(d, "results.parquet"), ppl=_read(d, "ppl.parquet"), att=_read(d, "attention.parquet"),
                mem=js("memory.json"), goal=js("goal.json"))
    r.done = ev.read_samples(os.path.join(d, "niah_samples.jsonl")) or None
    if r.res is not None and len(r.res):
        r.res = ev.interval_columns(r.res, r.done)
    r.windows = ev.read_windows(os.path.join(d, "ppl_windows.jsonl")) or None
    pcfg = (js("ppl_config.json") or {}).get("config") or {}
    r.tokens = pcfg.get("tokens")
    r.model = pcfg.get("model") or ((js("niah_config.json") or {}).get("config") or {}).get("model")
    if r.ppl is not None and len(r.ppl) and r.windows and r.tokens and "ratio_ci_low" not in r.ppl:
        st = pd.DataFrame(ev.ppl_stats(r.windows, list(dict.fromkeys(r.ppl.method)), list(dict.fromkeys(r.ppl.protocol)),
                                       sorted(r.ppl.context.unique()), int(r.tokens)))
        keep = [c for c in r.ppl.columns if c not in st.columns or c in ("method", "protocol", "context")]
        r.ppl = r.ppl[keep].merge(st, on=["method", "protocol", "context"], how="left")
    if r.ppl is not None and len(r.ppl) and (r.goal is None or "verdict" not in r.goal):
        r.goal = ev.product_goal(r.ppl, r.windows, r.tokens)  # goal.json written before verdicts
    return r


def _goal_row(r: dict) -> str:
    lo, hi = r.get("ratio_ci_low"), r.get("ratio_ci_high")
    iv = _iv(lo, hi, ".3f") if lo is not None and lo == lo else " (no interval)"
    unit = _n(r.get("blocks") or r.get("windows") or 0, r.get("block") or "window")
    need = f", ~{r['resolve_blocks']} blocks would resolve it" if r.get("resolve_blocks") else ""
    return (f"{_len_label(r['context'])}: {r['ratio']:.3f}×{iv} bf16 at {r['bits_per_element']:.2f} bits/elem, "
            f"{r.get('verdict', '?')} ({unit}{need})")


def goal_lines(goal: dict) -> list[str]:
    """The product goal's headline: the verdict, each context's interval, the other OSCAR recipes."""
    st = goal.get("status", "not measured")
    det = "; ".join(_goal_row(r) for r in goal.get("rows", []))
    md = [f"**Product goal — {goal['goal']}: {st.upper()}**" + (f" ({det})" if det else ""), ""]
    if goal.get("rule"):
        md += [f"Rule: {goal['rule']}.", ""]
    if goal.get("thin_margin_contexts"):
        ctx = ", ".join(_len_label(c) for c in goal["thin_margin_contexts"])
        md += [f"Thin margin at {ctx}: within 2 % of the limit, where INT2 strict perplexity moves by "
               "~0.5–1 % with float summation order alone; this verdict could flip between runs.", ""]
    for m, o in (goal.get("others") or {}).items():
        det = "; ".join(_goal_row(r) for r in o.get("rows", []))
        md += [f"- the same check for `{m}`: {o.get('status', 'not measured')}" + (f" ({det})" if det else ""), ""]
    return md


def run_time(info: dict) -> str:
    """run.json's times in words: the command's wall time (its start to the report) beside the per-stage times
    (each as its stage ran: a resumed run's skipped stages keep the time of the command that ran them)."""
    st = info.get("stage_seconds") or {}
    stages = ", ".join(f"{k} {v:.0f} s" for k, v in st.items())
    if info.get("wall_seconds") is None:  # older records: the stages' sum only
        return f"{info.get('total_seconds', 0) / 60:.1f} min over its stages" + (f" ({stages})" if stages else "")
    total = info.get("total_seconds", 0)
    # One invocation runs its stages one after another, so stages that sum past its wall time were (partly) run
    # by earlier invocations: the wall time is then the last invocation's, not the run's.
    if total > info["wall_seconds"] + 1:
        return (f"{info['wall_seconds'] / 60:.1f} min wall for its last invocation, which resumed the run "
                f"(stages, summed over every invocation, {total / 60:.1f} min: {stages})")
    return (f"{info['wall_seconds'] / 60:.1f} min wall from the command's start to the report"
            + (f" (stages {total / 60:.1f} min: {stages})" if stages else ""))


def build_report(d: str, title: str = "oscar-kv validation report", wall_clock=None) -> Report:
    """The report of run directory `d` (report.md, report.html, figures under d/report/). `wall_clock()`: the
    run's wall time so far (oscar run's), read after everything else is built, so that the time the report states
    is the command's from its start to the report; without it, run.json's `wall_seconds`."""
    if not os.path.isdir(d):
        raise OscarError(f"{d} is not a directory")
    R = load_results(d)
    res, ppl, att, mem, goal = R.res, R.ppl, R.att, R.mem, R.goal
    has_cal = bool(glob.glob(os.path.join(d, "calibration", "*.md")))
    if res is None and ppl is None and att is None and not has_cal and not os.path.isdir(os.path.join(d, "ablation")):
        raise OscarError(f"{d} has no result files (results.parquet, ppl.parquet, attention.parquet, calibration/, ablation/)")
    figdir = os.path.join(d, "report")
    os.makedirs(figdir, exist_ok=True)
    md = [f"# {title}", ""]
    run = os.path.join(d, "run.json")
    info = json.load(open(run)) if os.path.exists(run) else None
    at_run = len(md)  # the Run line goes here, written last (its wall time runs to the report)
    if info is not None:
        md += [host_line(info), ""] if info.get("compute_dtype") else []
        md += [placement_line(info["placement"]), ""] if info.get("placement") else []
        md += [info["summary"], ""] if info.get("summary") else []
    md += skipped_line(d)
    md += ["## Headline", ""]
    if goal:
        md += goal_lines(goal)
    checks = acceptance(res, ppl, R.done, R.windows, R.tokens, R.model)
    if checks:
        md += ["Every check: PASS when its 95 % interval clears the threshold in every cell, MISSED when one cell's "
               "interval (at 1 − 0.05/m over the m cells) lies beyond it, UNRESOLVED otherwise.", "",
               md_table(["check", "status", "detail"], [list(c) for c in checks]), ""]
    if not goal:  # a needle-only run (no perplexity): say so, not an empty heading or a silent one
        md += ["No product-goal verdict: the goal is judged on perplexity, and this run has none "
               "(`oscar validate ppl`); the needle tables below carry their own intervals.", ""]
    md += _skipped_section(d)
    md += _ruler_section(res, figdir, R.done)
    md += _cost_section(R.done)
    md += _ppl_section(ppl, goal, figdir)
    md += _memory_section(mem)
    md += _attention_section(att, figdir)
    md += _included_section(d, "calibration", "Calibration")
    md += _ablation_section(d)
    md += _steps_section(info) if info is not None else []
    wall = None
    if info is not None:
        if wall_clock is not None:
            info["wall_seconds"] = wall = round(float(wall_clock()), 1)
        md[at_run:at_run] = [f"Run: `{info.get('command', '')}` — model {info.get('model', '?')}, {run_time(info)}, "
                             f"on {info.get('host', '?')}.", ""]
    text = "\n".join(md)
    mp, hp = os.path.join(d, "report.md"), os.path.join(d, "report.html")
    with open(mp, "w") as f:
        f.write(text)
    with open(hp, "w") as f:
        f.write(md_to_html(text, d, title))
    return Report(text, mp, hp, wall)
