"""The recipe's key-clip tune (`oscar fit`, after the rotations): end-to-end tuning of the key clip on calibration text.

The fit searches each layer's key clip on reservoir rows, minimising the q-weighted logit
MSE. That proxy pairs random queries with random keys of other sequences, so it sees
almost none of the large logits that real attention concentrates on — and MSE-optimal
clipping shrinks exactly those. Measured on SmolLM2, the fit's clips (≈ 0.70) were
too aggressive end to end (docs/decisions/0034-key-clip-tuned-end-to-end-oscar-validate-tune.md, "Key clip tuned end to end").

This stage keeps the fit's per-layer *shape* and scales every key clip by one factor,
clip = min(1, f · clip_fit), choosing f by the model's next-token NLL on a window of the
**calibration** split read through the INT2 cache under the strict protocol (every token
after the sinks from INT2 once its page is complete). Only calibration text is used; validation never sees it.

That NLL is dominated by local prediction, where the recent tokens carry the answer; needles are retrieval
from far back in the INT2 history. `objective` adds a retrieval proxy from the same calibration text: the NLL
of a **copied span** (a window whose last S tokens repeat S of its INT2 tokens, read under the serving
protocol), which the model can only predict by attending back to the span (docs/decisions/0063-diagnostic-the-clip-tune-s-objective-trades.md, "the clip
tune's objective trades retrieval for next-token NLL"). `guarded` takes the best copy NLL among the factors
whose strict NLL is within `nll_slack` of the best, so retrieval is bought only with a bounded NLL cost.

An MLA model's latent artifact is tuned alike: one factor on every group's clip, by the strict NLL through the latent
cache (oscar/scoring/latent.py); the copy objectives and the cache engine are per-head.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from oscar.common import OscarError, smallest_change
from oscar.defaults import TUNE_OBJECTIVES
from oscar.pipeline.corpus import load_corpus
from oscar.scoring import engine as eng
from oscar.scoring.dtype import with_dtype
from oscar.scoring.protocols import PROTOCOL_VERSION, PROTOCOLS
from oscar.scoring.latent import latent_window_nll
from oscar.scoring.nll import window_nll
from oscar.kernels.window_attention import simulated
from oscar.stats.artifact import LatentArtifact

OBJECTIVES = TUNE_OBJECTIVES  # named in the leaf so the CLI lists them without importing torch
COPY_SKIP = 2  # the copy's first tokens are not scored: nothing points at the span yet


@dataclass
class TuneConfig:
    factors: tuple[float, ...] = (1.0, 1.1, 1.2, 1.3, 1.4, 1.5)  # × the fitted key clip, capped at 1
    tokens: int = 2048  # calibration-split window scored per factor
    protocol: str = "strict"
    corpus: str = "pydoc"
    # float64: the recipe's choices are decided on objectives that no host's kernels round differently. Under INT2 a
    # float32 rounding difference flips a code, which moves later layers and flips more: float32 NLLs of the same
    # window differ by up to ~1 % between kernels (tests/test_tune.py), the size of the margins between factors. With
    # ties at the spread between stores (choose_factor) float64 still changed one choice of eight measured
    # (docs/decisions/0103-the-recipe-s-choices-tie-at-the-spread-between-stores.md).
    dtype: str = "float64"
    # The per-layer widths' copy probe and its gradient: float32. In float64 the gradient's forward + backward ran
    # 4.5x the float32 time (~9 min of a 15-minute main job on a 2-core AVX2 host); its choices tie at the spread
    # between stores instead (oscar.common.STORE_TIE_TABLE; docs/decisions/0084-the-recipe-s-choices-do-not-depend-on-the-host-s.md).
    widths_dtype: str = "float32"
    objective: str = "nll"  # nll: strict NLL; copy: copied-span NLL; guarded: copy among factors within nll_slack
    nll_slack: float = 0.005  # guarded: a factor is admissible if its strict NLL <= best * (1 + nll_slack)
    copy_windows: int = 8  # copy objective: calibration windows of copy_length tokens, the last copy_span copied
    copy_length: int = 2048
    copy_span: int = 48
    copy_protocol: str = "serving"  # how needles are served

    def __post_init__(self):
        if not self.factors or any(not (f > 0 and math.isfinite(f)) for f in self.factors):
            raise OscarError(f"tune: factors must be positive finite numbers, got {self.factors!r}")
        if self.tokens < 128:
            raise OscarError(f"tune: --tokens {self.tokens} is too short to read anything from INT2 (sink 64)")
        if self.objective not in OBJECTIVES:
            raise OscarError(f"tune: unknown objective {self.objective!r}; known: {', '.join(OBJECTIVES)}")
        if not (self.nll_slack >= 0 and math.isfinite(self.nll_slack)):
            raise OscarError(f"tune: nll_slack must be a finite number >= 0, got {self.nll_slack!r}")
        if self.copy_windows < 1 or not (COPY_SKIP < self.copy_span < self.copy_length):
            raise OscarError(f"tune: copy objective needs >= 1 window and {COPY_SKIP} < span < length, got "
                             f"{self.copy_windows} windows, span {self.copy_span}, length {self.copy_length}")


def calibration_ids(tok, corpus: str, n: int) -> list[int]:
    """The first n tokens of the corpus's calibration split (whitespace-normalised, documents joined)."""
    text = " ".join(" ".join(load_corpus(corpus, tokenizer=tok).calibration).split())  # chats: the model's template
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if len(ids) < n:
        raise OscarError(f"tune: calibration split has {len(ids)} tokens, fewer than --tokens {n}")
    return ids[:n]


def copy_windows(ids: list[int], n: int, T: int, S: int, sink: int, recent: int, seed: int = 0):
    """n (window (1, T), scored positions, span start): T - S tokens of text, then a copy of S of them.

    Windows are consecutive slices of `ids`; the span's start is drawn uniformly between the sinks and the
    last start whose whole span is older than the recent window while the copy is read (so it is INT2).
    Position i of `pos` holds the logits that predict copy token COPY_SKIP + i."""
    H, hi = T - S, T - recent - S
    if hi <= sink:
        raise OscarError(f"tune: a copy window of {T} tokens with a {S}-token span has no INT2 history "
                         f"between {sink} sinks and {recent} recent tokens; raise copy_length")
    if len(ids) < n * H:
        raise OscarError(f"tune: {n} copy windows need {n * H} tokens, the text has {len(ids)}")
    g = torch.Generator().manual_seed(seed)
    out = []
    for w in range(n):
        hay = ids[w * H:(w + 1) * H]
        p = int(torch.randint(sink, hi, (1,), generator=g))
        win = torch.tensor([hay + hay[p:p + S]])  # (1, T)
        pos = torch.arange(H + COPY_SKIP - 1, T - 1)  # (S - COPY_SKIP,)
        out.append((win, pos, p))
    return out


@torch.no_grad()
def copy_nll(model, win: torch.Tensor, pos: torch.Tensor) -> tuple[float, int]:
    """(sum NLL, top-1 hits) of the copy tokens predicted at `pos`, through whatever simulator is active."""
    h = model.model(input_ids=win, use_cache=False).last_hidden_state  # (1, T, H)
    logits = model.lm_head(h[0, pos]).float()  # (n, V)
    tgt = win[0, pos + 1]  # (n,)
    return F.cross_entropy(logits, tgt, reduction="sum").item(), int((logits.argmax(-1) == tgt).sum())


def choose_factor(nll: dict[float, float], cnll: dict[float, float] | None, objective: str, nll_slack: float) -> float:
    """The tune's rule; objectives within STORE_TIE_REL of the best are ties (stores of one model calibrated
    through different kernels move them that far: oscar.common.STORE_TIE_REL), won by the factor nearest x1.0 (the
    smaller change)."""
    if objective == "nll":
        fs = sorted(nll)
        return fs[smallest_change(fs, [nll[f] for f in fs])]
    ok = sorted(nll) if objective == "copy" else sorted(f for f in nll if nll[f] <= min(nll.values()) * (1 + nll_slack))
    return ok[smallest_change(ok, [cnll[f] for f in ok])]


def scale_key_clips(art, factor: float):
    """A copy of `art` with clip_k scaled by `factor` (ratios capped at 1 in minmax mode); a latent artifact's
    per-group clips (minmax ratios) alike."""
    out = copy.copy(art)
    out.meta = dict(art.meta)
    if isinstance(art, LatentArtifact):  # minmax ratios per group
        out.clip = [(c * factor).clamp(max=1.0) for c in art.clip]
        return out
    cap = 1.0 if art.quant.mode == "minmax" else math.inf
    out.clip_k = [(c * factor).clamp(max=cap) for c in art.clip_k]
    return out


def mean_key_clip(art) -> float:
    """The mean key clip ratio (a latent artifact's: of its latent groups)."""
    clips = art.clip if isinstance(art, LatentArtifact) else art.clip_k
    return round(float(torch.stack([c.float().mean() for c in clips]).mean()), 6)


def tune_key_clip(model, tok, art, cfg: TuneConfig | None = None, progress: bool = True, engine: str = "simulate",
                  device: str = "cpu", scorer=None):
    """Return (tuned artifact, record). The record lists the NLL per token of every factor.

    engine: simulate (the masked fake-quant window) or cache (each factor's artifact served by OscarCache,
    oscar/scoring/engine.py); device: where the model runs (execution only). scorer: the pipeline stages
    (cluster/scoring.py) score every factor's window instead of `model` (None then), as `run_ppl(scorer=...)`."""
    cfg = cfg or TuneConfig()
    if isinstance(art, LatentArtifact) and (cfg.objective != "nll" or engine != "simulate"):
        raise OscarError(f"tune of a latent artifact (MLA model): the strict-NLL objective through the latent cache's "
                         f"simulator only (got objective {cfg.objective!r}, engine {engine!r})")
    if scorer is not None:
        return _tune_on_stages(scorer, art, cfg)
    eng.check_engine(engine)
    dev = eng.resolve_device(device)
    if cfg.protocol not in PROTOCOLS:
        raise OscarError(f"tune: unknown protocol {cfg.protocol!r}; known: {', '.join(PROTOCOLS)}")
    art.check_model(model.config)
    if cfg.copy_protocol not in PROTOCOLS:
        raise OscarError(f"tune: unknown copy protocol {cfg.copy_protocol!r}; known: {', '.join(PROTOCOLS)}")
    if engine == "cache":
        eng.check_methods({"oscar-int2": art}, [PROTOCOLS[cfg.protocol], PROTOCOLS[cfg.copy_protocol]])
    t0 = time.perf_counter()
    # the cache engine runs the serving kernels, which take float32 at most: float64 is the simulator's
    dtype = "float32" if engine == "cache" and cfg.dtype == "float64" else cfg.dtype
    with_dtype(model, dtype)
    eng.to_device(model, dev)
    ids = torch.tensor([calibration_ids(tok, cfg.corpus, cfg.tokens)], device=dev)  # (1, T)
    wins = []
    if cfg.objective != "nll":
        cp = PROTOCOLS[cfg.copy_protocol]
        text = calibration_ids(tok, cfg.corpus, cfg.copy_windows * (cfg.copy_length - cfg.copy_span))
        wins = [(w.to(dev), pos.to(dev)) for w, pos, _ in
                copy_windows(text, cfg.copy_windows, cfg.copy_length, cfg.copy_span, cp.sink, cp.recent)]
    factors = sorted(set(cfg.factors))
    it = factors
    if progress:
        it = tqdm(factors, desc="tune key clip", unit="factor")
    nll, cnll = {}, {}
    for f in it:
        a = scale_key_clips(art, f)
        if isinstance(a, LatentArtifact):  # the latent cache, a page per chunk (oscar/scoring/latent.py)
            s, n = latent_window_nll(model, a, PROTOCOLS[cfg.protocol], ids)
        elif engine == "cache":
            s, n = eng.window_nll(model, "oscar-int2", a, PROTOCOLS[cfg.protocol], ids)
        else:
            with simulated(model, a, PROTOCOLS[cfg.protocol]):
                s, n = window_nll(model, ids)
        nll[f] = s / n
        if wins:
            cs = 0.0
            for win, pos in wins:
                if engine == "cache":
                    cs += float(eng.token_nll(model, "oscar-int2", a, cp, win)[pos.cpu()].sum())
                else:
                    with simulated(model, a, cp):
                        cs += copy_nll(model, win, pos)[0]
            cnll[f] = cs / sum(len(pos) for _, pos in wins)
    best = choose_factor(nll, cnll or None, cfg.objective, cfg.nll_slack)
    tuned = scale_key_clips(art, best)
    rnd = lambda d: {str(f): round(v, 6) for f, v in d.items()}  # noqa: E731
    record = {"config": asdict(cfg), **({"engine": engine, "dtype": dtype} if engine != "simulate" else {}), "protocol_version": PROTOCOL_VERSION, "nll_per_token": rnd(nll),
              **({"copy_nll_per_token": rnd(cnll)} if cnll else {}), "chosen_factor": best,
              "mean_clip_k_before": mean_key_clip(art), "mean_clip_k_after": mean_key_clip(tuned),
              "seconds": round(time.perf_counter() - t0, 2)}
    tuned.meta["clip_tuning"] = record
    return tuned, record


def _tune_on_stages(scorer, art, cfg: TuneConfig):
    """`tune_key_clip` with each factor's window scored by the pipeline stages (the strict-NLL objective)."""
    if cfg.objective != "nll":
        raise OscarError(f"tune on the pipeline stages: objective {cfg.objective!r} reads the copied span's NLL, which "
                         "the stages do not score; use the nll objective")
    if scorer.dtype != cfg.dtype:
        raise OscarError(f"tune: the stages compute in {scorer.dtype}, the tune scores in {cfg.dtype}")
    if cfg.protocol not in PROTOCOLS:
        raise OscarError(f"tune: unknown protocol {cfg.protocol!r}; known: {', '.join(PROTOCOLS)}")
    art.check_model(scorer.config)
    t0 = time.perf_counter()
    ids = torch.tensor([calibration_ids(scorer.tokenizer, cfg.corpus, cfg.tokens)])  # (1, T)
    factors = sorted(set(cfg.factors))
    scorer.load({str(f): scale_key_clips(art, f) for f in factors})
    res = list(scorer.score([(str(f), cfg.protocol, ids, ()) for f in factors]))
    nll = {f: s / n for f, (s, n) in zip(factors, res)}
    best = choose_factor(nll, None, cfg.objective, cfg.nll_slack)
    tuned = scale_key_clips(art, best)
    record = {"config": asdict(cfg), "stages": len(scorer.ranges), "protocol_version": PROTOCOL_VERSION,
              "nll_per_token": {str(f): round(v, 6) for f, v in nll.items()}, "chosen_factor": best,
              "mean_clip_k_before": mean_key_clip(art), "mean_clip_k_after": mean_key_clip(tuned),
              "seconds": round(time.perf_counter() - t0, 2)}
    tuned.meta["clip_tuning"] = record
    return tuned, record
