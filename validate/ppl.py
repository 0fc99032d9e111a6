"""`oscar validate ppl`: held-out perplexity of each cache method under two protocols.

A window of C tokens is scored teacher-forced in one forward pass: the INT2 cache's behaviour is reproduced by
a position mask instead of C sequential decode steps (kernels/window_attention.py; tests check it against
token-by-token decoding through the simulated cache and against the paged cache).

- strict:  sink 64, recent 0 — every non-sink token is read from INT2 once its page is complete.
- serving: sink 64, recent 256.
- strict-token: as strict, per-token K/V released one token at a time (a diagnostic).

Perplexity = exp(mean NLL) over every predicted token of the first `tokens`
held-out tokens, cut in non-overlapping windows of the context length, each
window starting from an empty cache. Held-out tokens are the corpus's held-out
split, then (only past it) the standard library's docstrings (`heldout_text_ids`).

Files in OUT: ppl_windows.jsonl (one line per method, protocol, context,
window, with the NLL of its 512-token segments; resumable), ppl.parquet
(method, protocol, context, ppl, ppl_ci_low, ppl_ci_high, bits_per_element,
tokens, windows, blocks, block, ratio, ratio_ci_low, ratio_ci_high,
ratio_vs_bf16: validate/evidence.py), goal.json (the product goal, three-valued).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field

import pandas as pd
import torch
from tqdm import tqdm

from oscar.common import OscarError, file_fingerprint, fit_dim, is_latent
from oscar.defaults import DEFAULT_METHODS
from oscar.defaults import EMBEDDED_MODEL
from oscar.validate.evidence import product_goal, segment_cuts
from oscar.validate.evidence import ppl_stats
from oscar.kernels import cpu_attention
from oscar.kernels.window_attention import simulated
from oscar.scoring import engine
from oscar.scoring.latent import latent_window_nll
from oscar.scoring.nll import window_nll
from oscar.validate import env
from oscar.validate.heldout import more_heldout_words
from oscar.validate.methods import (
    bits_per_element, choose_methods, parse_methods, record_skipped, uncalibrated_warning,
)
from oscar.scoring.protocols import PROTOCOL_VERSION, PROTOCOLS
from oscar.validate.niah import _Inline, checked_artifact, locked_out, model_or_stages
from oscar.scoring.prefill import load_aware_threads
from oscar.validate.workers import Workers, default_workers


@dataclass
class PplConfig:
    out: str
    model: str = EMBEDDED_MODEL
    artifact: str | None = None
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    contexts: list[int] = field(default_factory=lambda: [1024, 4096])
    protocols: list[str] = field(default_factory=lambda: ["strict", "serving"])
    tokens: int = 8192  # held-out tokens scored per context
    corpus: str = "pydoc"
    dtype: str = "float32"  # model compute dtype (oscar.scoring.dtype.with_dtype)
    engine: str = "simulate"  # oscar/scoring/engine.py: simulate (fake-quant simulator) or cache (OscarCache + kernels)
    device: str = "cpu"  # cpu, cuda, cuda:N (execution only: not part of the identity)
    # `methods` is the command's default list: a method this model cannot serve is left out, said and recorded,
    # instead of refused (validate/methods.py choose_methods); not an identity
    default_methods: bool = False

    def identity(self) -> dict:
        art = file_fingerprint(self.artifact) if self.artifact else None

        ident = {"model": self.model, "artifact": art, "tokens": self.tokens, "corpus": self.corpus,
                 "protocol_version": PROTOCOL_VERSION}
        if self.dtype != "float32":  # float32 outputs written before the option keep their identity
            ident["dtype"] = self.dtype
        if self.engine != "simulate":  # the cache reads one token less exactly (oscar/scoring/engine.py): never mixed
            ident["engine"] = self.engine
        return ident


def heldout_ids(tok, corpus: str, n: int) -> list[int]:
    """The first n tokens of held-out text (`heldout_text_ids` without its record of the sources)."""
    return heldout_text_ids(tok, corpus, n)[0]


def heldout_text_ids(tok, corpus: str, n: int) -> tuple[list[int], dict]:
    """The first n tokens of held-out text, and where they come from.

    The corpus's held-out split first (pydoc: 12,427 SmolLM2 tokens); only when n asks for more, the standard
    library's docstrings follow, sentences also in the calibration split dropped: the second held-out source the
    attention-level test and the needle haystacks read (validate/heldout.py). The split is tokenized on its own, so
    the first tokens never change with n. Returns (ids, {"split_tokens", "docstring_tokens", "python"}); "python"
    (the docstrings' source) is None when none were read."""
    ids = tok(env.heldout_text(corpus), add_special_tokens=False)["input_ids"]
    info = {"split_tokens": min(len(ids), n), "docstring_tokens": 0, "python": None}
    if len(ids) >= n:
        return ids[:n], info
    need = n - len(ids)
    words = more_heldout_words(corpus)(need)  # every word is >= 1 token: short only when the library runs out
    extra = tok(" " + " ".join(words), add_special_tokens=False)["input_ids"]
    if len(extra) < need:
        raise OscarError(f"held-out text gives only {len(ids) + len(extra)} tokens (held-out split of {corpus!r}: "
                         f"{len(ids)}, then the standard library's docstrings: {len(extra)}), fewer than --tokens {n}")
    info.update(docstring_tokens=need, python=sys.version.split()[0])
    return ids + extra[:need], info


def _window(model, art, protocol: str, win: torch.Tensor, cuts: tuple):
    """window_nll of one window under method `art` (None: the plain model) and `protocol`; an MLA model's through
    its latent cache (oscar/scoring/latent.py)."""
    if is_latent(model.config):
        return latent_window_nll(model, art, PROTOCOLS[protocol] if art is not None else None, win, prefixes=cuts)
    if art is None:
        with cpu_attention.native_prefill(model):
            return window_nll(model, win, prefixes=cuts)
    with simulated(model, art, PROTOCOLS[protocol]):
        return window_nll(model, win, prefixes=cuts)


def _ppl_init(model, arg) -> dict:
    arts, ids = arg
    return {"model": model, "arts": arts, "ids": ids}


def _ppl_unit(st: dict, arg):
    """One window in a worker (validate/workers.py): what `_window` returns in this process."""
    (m, p, c, w), cuts = arg
    return _window(st["model"], st["arts"][m], p, st["ids"][:, w * c:(w + 1) * c], cuts)


def run_ppl(cfg: PplConfig, loaded=None, progress: bool = True, workers: int | None = None, scorer=None):
    """Score every (method, protocol, context, window) not yet in OUT; returns the perplexity table.

    workers: processes scoring windows in parallel (validate/workers.py; default: one per CPU this process
    may use, up to 4, or $OSCAR_WORKERS; 1: in this process, threads by load). A worker runs one intra-op
    thread; windows are independent, so a window's NLL does not depend on which worker scored it.
    scorer: where the windows are scored instead of a model in this process: an object with `config`,
    `tokenizer`, `load(arts)` and `score(jobs, engine=)` -> the results of `_window` (or under the cache engine
    `engine.window_nll` for a method with an artifact) for each (method, protocol, window, cuts) in order (the pipeline stages of cluster/scoring.py); this process then holds no weights."""
    engine.check_engine(cfg.engine)
    env.refuse_chat_corpus(cfg.corpus)  # before any weights load
    # before loading weights: no silent CPU run (the pipeline stages check their own devices)
    dev = engine.resolve_device(cfg.device) if scorer is None else torch.device("cpu")
    methods = parse_methods(cfg.methods)
    bad = [p for p in cfg.protocols if p not in PROTOCOLS]
    if bad:
        raise OscarError(f"unknown protocol(s) {bad}; known: {', '.join(PROTOCOLS)}")
    for c in cfg.contexts:
        if cfg.tokens < c:
            raise OscarError(f"--tokens {cfg.tokens} is shorter than context {c}")
    lock = locked_out(cfg)
    lock.check_free()  # another writer of OUT: refused before anything loads
    config, fitted = checked_artifact(cfg, methods, loaded, scorer, "perplexity")
    arts, dropped = choose_methods(methods, config, fitted, default=cfg.default_methods, model=cfg.model)
    if cfg.engine == "cache":  # refuse what the cache format cannot hold before anything runs
        engine.check_methods({m: arts[m] for m in methods if m not in dropped}, [PROTOCOLS[p] for p in cfg.protocols])
    with lock:
        return _run_ppl(cfg, loaded, progress, workers, scorer, dev, methods, fitted, arts, dropped)


def _run_ppl(cfg, loaded, progress, workers, scorer, dev, methods, fitted, arts, dropped):
    """run_ppl once OUT is locked and every refusal is behind: load, score, write."""
    model, tok, config = model_or_stages(cfg, methods, cfg.contexts, loaded, dev, scorer, "perplexity")
    text, src = heldout_text_ids(tok, cfg.corpus, cfg.tokens)
    ident = cfg.identity()
    if src["docstring_tokens"]:  # past the split: the docstrings depend on the Python that read them
        ident["text"] = src
        print(f"oscar: the held-out split gives {src['split_tokens']} of the {cfg.tokens} tokens; the rest are the "
              f"standard library's docstrings (Python {src['python']}; validate/heldout.py)", file=sys.stderr)
    os.makedirs(cfg.out, exist_ok=True)
    cpath = os.path.join(cfg.out, "ppl_config.json")
    if os.path.exists(cpath) and json.load(open(cpath)).get("identity") != ident:
        raise OscarError(f"{cfg.out} holds perplexities for another model/artifact/token budget/text; use another --out")
    json.dump({"identity": ident, "config": asdict(cfg), "text": src}, open(cpath, "w"), indent=1)

    if (warn := uncalibrated_warning(fitted, max(cfg.contexts))):
        print(f"oscar: WARNING: {warn}", file=sys.stderr)
    if dropped:
        record_skipped(cfg.out, dropped)
    methods = [m for m in methods if m not in dropped]
    ids = torch.tensor([text], device=dev)
    path = os.path.join(cfg.out, "ppl_windows.jsonl")
    done: dict[tuple, dict] = {}
    if os.path.exists(path):
        for line in open(path):
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            done[(r["method"], r["protocol"], r["context"], r["window"])] = r
    # bf16 does not depend on the protocol: scored once, under protocol "-"
    jobs = [(m, "-" if arts[m] is None else p, c, w) for m in methods for p in cfg.protocols
            for c in cfg.contexts for w in range(cfg.tokens // c)]
    jobs = list(dict.fromkeys(jobs))
    todo = sorted((j for j in jobs if j not in done), key=lambda j: -j[2])  # longest windows first: see below
    jobset = set(jobs)
    bar = tqdm(total=sum(j[2] for j in todo), desc="ppl", unit="tok", unit_scale=True, disable=not progress, dynamic_ncols=True)

    def record(r: dict) -> None:
        f.write(json.dumps(r) + "\n")
        f.flush()
        os.fsync(f.fileno())
        done[(r["method"], r["protocol"], r["context"], r["window"])] = r
        bar.update(r["context"])

    plan, covered = [], set(done)  # (job, its prefix windows, cut points); covered: scored or planned
    for m, p, c, w in todo:
        if (m, p, c, w) in covered:  # scored as the prefix of a longer window
            continue
        # A shorter context's window that starts where this one starts is this window's prefix.
        short = [(c2, w * c // c2) for c2 in cfg.contexts if c2 < c and (w * c) % c2 == 0
                 and (m, p, c2, w * c // c2) in jobset and (m, p, c2, w * c // c2) not in covered]
        cuts = tuple(dict.fromkeys([c2 for c2, _ in short] + segment_cuts(c)))  # + segment ends (intervals)
        plan.append(((m, p, c, w), short, cuts))
        covered.update((m, p, c2, w2) for c2, w2 in short)

    n = workers or default_workers(len(plan))
    if scorer is not None or next(model.parameters()).device.type != "cpu" or cfg.engine == "cache":
        n = 1  # worker processes share a CPU host's cores; an accelerator runs one stream; the cache engine inline
    with open(path, "a") as f, (Workers(n, model, _ppl_init, (arts, ids)) if n > 1 else _Inline()) as W:
        if scorer is not None:  # every window's chain submitted at once: the stages pipeline the windows
            scorer.load({m: arts[m] for m in methods})
            jobs = [(m, p, ids[:, w * c:(w + 1) * c], cuts) for (m, p, c, w), _, cuts in plan]
            results = enumerate(scorer.score(jobs, engine=cfg.engine))
        elif n > 1:
            results = W.map(_ppl_unit, [(job, cuts) for job, _, cuts in plan])
        else:
            def inline():
                for k, ((m, p, c, w), _, cuts) in enumerate(plan):
                    bar.set_postfix_str(f"{m} {p} {c}")
                    with load_aware_threads():  # all cores when idle, one when shared (see niah.decode_threads)
                        win = ids[:, w * c:(w + 1) * c]
                        if cfg.engine == "cache" and arts[m] is not None:  # the product path (oscar/scoring/engine.py)
                            yield k, engine.window_nll(model, m, arts[m], PROTOCOLS[p], win, prefixes=cuts)
                        else:
                            yield k, _window(model, arts[m], p, win, cuts)
            results = inline()
        for k, res in results:
            (m, p, c, w), short, cuts = plan[k]
            cum = dict(zip(cuts, res[2])) if cuts else {}
            record({"method": m, "protocol": p, "context": c, "window": w, "nll": res[0], "count": res[1],
                    "seg": _segments(cum, c, res[0], res[1])})
            for c2, w2 in short:
                nll2, n2 = cum[c2]
                record({"method": m, "protocol": p, "context": c2, "window": w2, "nll": nll2, "count": n2,
                        "seg": _segments(cum, c2, nll2, n2), "prefix_of": c})
    bar.close()
    return write_ppl(cfg, methods, arts, config, done)


def _segments(cum: dict, P: int, nll: float, count: int) -> list[list[float]]:
    """[[nll, count], ...] of the SEGMENT-token segments of a P-token window, from the cumulative
    (nll, count) at its cut points (`cum`: window length -> (nll, count)) and its total."""
    pts = [(0.0, 0)] + [cum[q] for q in segment_cuts(P)] + [(nll, count)]
    return [[b[0] - a[0], b[1] - a[1]] for a, b in zip(pts[:-1], pts[1:])]


def write_ppl(cfg: PplConfig, methods, arts, config, done):
    D = fit_dim(config)  # what a method's bits per element are counted over
    rows = ppl_stats(list(done.values()), methods, cfg.protocols, cfg.contexts, cfg.tokens,
                     bf16_key=lambda m, p: "-" if arts[m] is None else p)
    for r in rows:
        r["bits_per_element"] = bits_per_element(arts[r["method"]], D)
    df = pd.DataFrame(rows)
    if len(df):
        base = df[df.method == "bf16"].set_index("context")["ppl"].groupby(level=0).first()
        df["ratio_vs_bf16"] = [r.ppl / base[r.context] if r.context in base.index else float("nan") for r in df.itertuples()]
    df.to_parquet(os.path.join(cfg.out, "ppl.parquet"), index=False)
    goal = product_goal(df, list(done.values()), cfg.tokens)
    json.dump(goal, open(os.path.join(cfg.out, "goal.json"), "w"), indent=1)
    return df
