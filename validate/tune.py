"""`oscar validate tune`: end-to-end tuning of the key clip on calibration text.

The fit searches each layer's key clip on reservoir rows, minimising the q-weighted logit
MSE. That proxy pairs random queries with random keys of other sequences, so it sees
almost none of the large logits that real attention concentrates on — and MSE-optimal
clipping shrinks exactly those. Measured on SmolLM2, the fit's clips (≈ 0.70) were
too aggressive end to end (docs/decisions.md, "Key clip tuned end to end").

This stage keeps the fit's per-layer *shape* and scales every key clip by one factor,
clip = min(1, f · clip_fit), choosing f by the model's next-token NLL on a window of the
**calibration** split read through the INT2 cache under the strict protocol (every token
after the sinks from INT2 once its page is complete). Only calibration text is used; validation never sees it.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass

import torch

from oscar.common import OscarError


@dataclass
class TuneConfig:
    factors: tuple[float, ...] = (1.0, 1.1, 1.2, 1.3, 1.4, 1.5)  # × the fitted key clip, capped at 1
    tokens: int = 2048  # calibration-split window scored per factor
    protocol: str = "strict"
    corpus: str = "pydoc"
    dtype: str = "float32"  # deterministic scoring; the choice should not depend on thread counts

    def __post_init__(self):
        if not self.factors or any(not (f > 0 and math.isfinite(f)) for f in self.factors):
            raise OscarError(f"tune: factors must be positive finite numbers, got {self.factors!r}")
        if self.tokens < 128:
            raise OscarError(f"tune: --tokens {self.tokens} is too short to read anything from INT2 (sink 64)")


def calibration_ids(tok, corpus: str, n: int) -> list[int]:
    """The first n tokens of the corpus's calibration split (whitespace-normalised, documents joined)."""
    from oscar.pipeline.corpus import load_corpus

    text = " ".join(" ".join(load_corpus(corpus).calibration).split())
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if len(ids) < n:
        raise OscarError(f"tune: calibration split has {len(ids)} tokens, fewer than --tokens {n}")
    return ids[:n]


def scale_key_clips(art, factor: float):
    """A copy of `art` with clip_k scaled by `factor` (ratios capped at 1 in minmax mode)."""
    out = copy.copy(art)
    cap = 1.0 if art.quant.mode == "minmax" else math.inf
    out.clip_k = [(c * factor).clamp(max=cap) for c in art.clip_k]
    out.meta = dict(art.meta)
    return out


def tune_key_clip(model, tok, art, cfg: TuneConfig | None = None, progress: bool = True, engine: str = "simulate",
                  device: str = "cpu"):
    """Return (tuned artifact, record). The record lists the NLL per token of every factor.

    engine: simulate (the masked fake-quant window) or cache (each factor's artifact served by OscarCache,
    validate/engine.py); device: where the model runs (execution only)."""
    from oscar.validate import engine as eng
    from oscar.validate.env import with_dtype
    from oscar.validate.methods import PROTOCOL_VERSION, PROTOCOLS
    from oscar.validate.ppl import simulated, window_nll

    cfg = cfg or TuneConfig()
    eng.check_engine(engine)
    dev = eng.resolve_device(device)
    if cfg.protocol not in PROTOCOLS:
        raise OscarError(f"tune: unknown protocol {cfg.protocol!r}; known: {', '.join(PROTOCOLS)}")
    art.check_model(model.config)
    if engine == "cache":
        eng.check_methods({"oscar-int2": art}, [PROTOCOLS[cfg.protocol]])
    t0 = time.perf_counter()
    with_dtype(model, cfg.dtype)
    eng.to_device(model, dev)
    ids = torch.tensor([calibration_ids(tok, cfg.corpus, cfg.tokens)], device=dev)  # (1, T)
    factors = sorted(set(cfg.factors))
    it = factors
    if progress:
        from tqdm import tqdm

        it = tqdm(factors, desc="tune key clip", unit="factor")
    nll = {}
    for f in it:
        if engine == "cache":
            s, n = eng.window_nll(model, "oscar-int2", scale_key_clips(art, f), PROTOCOLS[cfg.protocol], ids)
        else:
            with simulated(model, scale_key_clips(art, f), PROTOCOLS[cfg.protocol]):
                s, n = window_nll(model, ids)
        nll[f] = s / n
    best = min(factors, key=lambda f: (nll[f], f))  # ties: the smaller change
    tuned = scale_key_clips(art, best)
    record = {"config": asdict(cfg), **({"engine": engine} if engine != "simulate" else {}), "protocol_version": PROTOCOL_VERSION, "nll_per_token": {str(f): round(v, 6) for f, v in nll.items()},
              "chosen_factor": best, "mean_clip_k_before": round(float(torch.stack([c.float().mean() for c in art.clip_k]).mean()), 6),
              "mean_clip_k_after": round(float(torch.stack([c.float().mean() for c in tuned.clip_k]).mean()), 6),
              "seconds": round(time.perf_counter() - t0, 2)}
    tuned.meta["clip_tuning"] = record
    return tuned, record
