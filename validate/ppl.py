"""`oscar validate ppl`: held-out perplexity of each cache method under two protocols.

A window of C tokens is scored teacher-forced. The cache's behaviour is
reproduced exactly by a position mask instead of C sequential decode steps:
query i reads key/value j

    exactly     if j < sink, or i - e(j) <= recent
    from INT2   otherwise (j <= i)

where e(j) is the step at which token j is released to INT2: the last token of
j's page of `page_size` tokens for per-token groups (the paged cache writes whole
pages; e(j) = j under `strict-token`), the last token of j's group of G tokens
for KIVI-style per-channel keys. This is what token-by-token decoding through
`SimQuantCache` computes (the token being decoded reads its own K/V exactly,
then it is stored), and tests check the two agree, and agree with the paged cache.

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
ratio_vs_bf16: oscar/evidence.py), goal.json (the product goal, three-valued).
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field

import pandas as pd
import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from oscar.common import OscarError, attention_shapes, file_fingerprint
from oscar.defaults import DEFAULT_METHODS
from oscar.defaults import EMBEDDED_MODEL
from oscar.evidence import GOAL_BITS, GOAL_RATIO, GOAL_THIN, product_goal, segment_cuts  # noqa: F401 (re-exported)
from oscar.evidence import ppl_stats
from oscar.kernels import cpu_attention
from oscar.kernels.simulate import LayerQuant
from oscar.stats.artifact import load_artifact
from oscar.validate import engine, env
from oscar.validate.heldout import more_heldout_words
from oscar.validate.methods import (
    PROTOCOL_VERSION, PROTOCOLS, bits_per_element, method_artifact, parse_methods, resolve_methods,
    uncalibrated_warning,
)
from oscar.validate.niah import _Inline, load_aware_threads, load_checked
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
    dtype: str = "float32"  # model compute dtype (env.with_dtype)
    engine: str = "simulate"  # validate/engine.py: simulate (fake-quant simulator) or cache (OscarCache + kernels)
    device: str = "cpu"  # cpu, cuda, cuda:N (execution only: not part of the identity)

    def identity(self) -> dict:
        art = file_fingerprint(self.artifact) if self.artifact else None

        ident = {"model": self.model, "artifact": art, "tokens": self.tokens, "corpus": self.corpus,
                 "protocol_version": PROTOCOL_VERSION}
        if self.dtype != "float32":  # float32 outputs written before the option keep their identity
            ident["dtype"] = self.dtype
        if self.engine != "simulate":  # the cache reads one token less exactly (validate/engine.py): never mixed
            ident["engine"] = self.engine
        return ident


# ----------------------------------------------------------------- the masked attention

_SIM: dict = {"quant": None, "protocol": None, "qchunk": None}  # qchunk: the band's query block (None: by width)


def fresh_mask(T: int, sink: int, recent: int, key_group: int, device=None) -> torch.Tensor:
    """(T, T) bool: query i reads key j exactly (True) or from INT2 (False); causality not applied."""
    j = torch.arange(T, device=device)
    return _fresh(j, j, sink, recent, key_group)


def _fresh(i: torch.Tensor, j: torch.Tensor, sink: int, recent: int, key_group: int) -> torch.Tensor:
    """(len(i), len(j)) bool: query position i reads key position j exactly (see the module docstring)."""
    return _fresh_pairs(i[:, None], j[None, :], sink, recent, key_group)


def _fresh_pairs(i: torch.Tensor, j: torch.Tensor, sink: int, recent: int, key_group: int) -> torch.Tensor:
    """_fresh on broadcastable position tensors i (queries) and j (keys)."""
    if key_group > 1:
        e = torch.where(j >= sink, sink + ((j - sink) // key_group + 1) * key_group - 1, j)
    else:
        e = j
    return (j < sink) | ((i - e) <= recent)


def _flash_lse(q, k, v, scale: float, causal: bool):
    """Attention output (B, H, Tq, D) and log-sum-exp (B, H, Tq) of q over k, v (same heads); top-left causal."""
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is not None and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float64):
        out, lse = op(q, k, v, 0.0, causal, scale=scale)  # lse float32 (float64 for float64: the tune's dtype)
        return out, lse
    s = (q @ k.transpose(-1, -2)).to(torch.promote_types(q.dtype, torch.float32)) * scale  # fallback: (B, H, Tq, Tk)
    if causal:
        Tq, Tk = s.shape[-2:]
        s = s.masked_fill(torch.ones(Tq, Tk, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return (torch.softmax(s, -1).to(v.dtype) @ v), lse


def sim_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """query (B, Hq, T, D), key/value (B, Hkv, T, D) post-RoPE; a whole window from an empty cache.

    With W = recent + key_group, every key j <= i - W is read from the stored cache (INT2, or an
    exact sink) by query i: that part is one causal flash attention over the stored keys shifted
    by W. The band i - W < j <= i mixes exact and INT2 keys per (i, j) (the fresh mask); it is
    computed in query blocks, and the two parts are merged through their log-sum-exps. Same
    result as the dense masked softmax (tests compare it with token-by-token decoding).
    """
    lq = _SIM["quant"][module.layer_idx]
    p = _SIM["protocol"]
    B, Hq, T, D = query.shape
    sink = min(p.sink, T)
    b = lq.quantized_until(T, sink, 0)  # everything from sink, keys in whole groups
    kh, vh = key.clone(), value.clone()  # (B, Hkv, T, D): the stored cache (sink exact, [sink, b) INT2)
    kh[..., sink:b, :] = lq.keys(key[..., sink:b, :])
    vh[..., sink:b, :] = lq.values(value[..., sink:b, :])
    rep = Hq // key.shape[1]
    scale = scaling if scaling is not None else D ** -0.5
    W = p.recent + lq.key_group  # j <= i - W: read from the stored cache by every query i
    far = None
    if T > W:  # rows: queries W..T-1 over keys 0..T-W-1, plain causal
        qf, Ks, Vs = query[:, :, W:], kh[..., :T - W, :], vh[..., :T - W, :]
        if cpu_attention.supports(qf, Ks):  # the native kernel reads the KV heads in place (GQA)
            far = cpu_attention.causal_attention(qf, Ks, Vs, scale)
        else:
            far = _flash_lse(qf, Ks.repeat_interleave(rep, 1), Vs.repeat_interleave(rep, 1), scale, causal=True)
    band = _band if W <= 64 else _band_loop  # measured: batched blocks win for narrow bands only
    o, ln = band(query, key, value, kh, vh, sink, p.recent, lq.key_group, W, scale)  # (B, Hq, T, D), (B, Hq, T)
    if far is not None:  # queries W..T-1 also read the stored cache beyond the band: merge by log-sum-exp
        acc = torch.promote_types(query.dtype, torch.float32)
        of, lf = far[0].to(acc), far[1].to(acc)
        lse = torch.logaddexp(ln[:, :, W:], lf)
        o[:, :, W:] = torch.exp(ln[:, :, W:] - lse)[..., None] * o[:, :, W:] + torch.exp(lf - lse)[..., None] * of
    out = o.to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


def _band_loop(query, key, value, kh, vh, sink: int, recent: int, key_group: int, W: int, scale: float):
    """`_band` as a loop over blocks of 256 queries, each over its 256 + W - 1 keys (heads repeated): for
    wide bands (serving: W = 272, 320) this ran faster than the batched windows (bench/main_job_speed.py)."""
    B, Hq, T, D = query.shape
    rep = Hq // key.shape[1]
    acc = torch.promote_types(query.dtype, torch.float32)  # float32, or float64 for a float64 model (the tune)
    o_all = torch.empty(B, Hq, T, D, dtype=acc, device=query.device)
    ln_all = torch.empty(B, Hq, T, dtype=acc, device=query.device)
    pos = torch.arange(T, device=query.device)
    C = _SIM["qchunk"] or 256
    for q0 in range(0, T, C):
        q1 = min(T, q0 + C)
        k0 = max(0, q0 - W + 1)
        qi, kj = pos[q0:q1], pos[k0:q1]
        fr = _fresh(qi, kj, sink, recent, key_group)  # (c, n) exact?
        band = (kj[None, :] <= qi[:, None]) & (kj[None, :] > qi[:, None] - W)
        K, V = key[..., k0:q1, :].repeat_interleave(rep, 1), value[..., k0:q1, :].repeat_interleave(rep, 1)
        q = query[:, :, q0:q1]  # (B, Hq, c, D)
        mixed = not bool((fr | ~band).all())  # token-granular groups: the band is all exact
        s = q @ K.transpose(-1, -2)  # (B, Hq, c, n)
        if mixed:
            Kh, Vh = kh[..., k0:q1, :].repeat_interleave(rep, 1), vh[..., k0:q1, :].repeat_interleave(rep, 1)
            s = torch.where(fr, s, q @ Kh.transpose(-1, -2))
        s = s.to(acc).mul_(scale).masked_fill_(~band, float("-inf"))
        m = s.amax(-1, keepdim=True)  # every row has its own key in the band: finite
        e = torch.exp(s - m)
        z = e.sum(-1, keepdim=True)
        if mixed:
            frf = fr.to(e.dtype)
            o_all[:, :, q0:q1] = ((e * frf) @ V.to(acc) + (e * (1 - frf)) @ Vh.to(acc)) / z  # (B, Hq, c, D)
        else:
            o_all[:, :, q0:q1] = (e @ V.to(acc)) / z
        ln_all[:, :, q0:q1] = (m + torch.log(z))[..., 0]
    return o_all, ln_all


def _band(query, key, value, kh, vh, sink: int, recent: int, key_group: int, W: int, scale: float):
    """Attention of every query i over its band i - W < j <= i (exact or stored K/V per the fresh mask),
    with its log-sum-exp: (B, Hq, T, D) float32, (B, Hq, T) float32.

    Queries go in blocks of C (16 for a narrow band, else 64), each reading the window of C + W - 1 keys
    ending at its last query, all blocks in one batched matmul per product; query heads are grouped per
    KV head (no repeat_kv). Scores are the model dtype's matmul, softmax and values in float32, as before
    (the previous loop took blocks of 256 queries over 256 + W - 1 keys: ~2x the work for the serving
    band, ~9x for strict's 16-token band)."""
    B, Hq, T, D = query.shape
    Hkv = key.shape[1]
    rep = Hq // Hkv
    C = _SIM["qchunk"] or (16 if W <= 32 else 64)  # W <= 64 here (sim_attention's choice)
    nb = -(-T // C)
    Tp, n = nb * C, C + W - 1
    dev = query.device
    pq = torch.arange(Tp, device=dev).view(nb, C)  # query positions per block
    pk = (torch.arange(nb, device=dev) * C - (W - 1))[:, None] + torch.arange(n, device=dev)  # (nb, n) key positions
    band = (pk[:, None, :] <= pq[:, :, None]) & (pk[:, None, :] > pq[:, :, None] - W) & (pk >= 0)[:, None, :]  # (nb, C, n)
    fr = _fresh_pairs(pq[:, :, None], pk[:, None, :], sink, recent, key_group)  # (nb, C, n): exact?
    mixed = not bool((fr | ~band).all())  # token-granular groups: the band is all exact

    def win(x):  # (B, Hkv, T, D) -> (B, Hkv, nb, D, n): block i's window of keys, transposed (a strided view)
        return F.pad(x, (0, 0, W - 1, Tp - T)).unfold(2, n, C)

    q = F.pad(query, (0, 0, 0, Tp - T)).view(B, Hkv, rep, nb, C, D).transpose(2, 3).reshape(B, Hkv, nb, rep * C, D)
    s = (q @ win(key)).view(B, Hkv, nb, rep, C, n)  # model dtype, as a plain attention's scores
    if mixed:
        s = torch.where(fr[:, None], s, (q @ win(kh)).view(B, Hkv, nb, rep, C, n))
    acc = torch.promote_types(query.dtype, torch.float32)  # float32, or float64 for a float64 model (the tune)
    s = s.to(acc).mul_(scale).masked_fill_(~band[:, None], float("-inf"))
    m = s.amax(-1, keepdim=True)  # every query has its own key in the band: finite
    e = torch.exp(s - m)
    z = e.sum(-1, keepdim=True)
    vw = win(value).to(acc).transpose(-1, -2)  # (B, Hkv, nb, n, D)
    if mixed:
        frf = fr[:, None].to(e.dtype)
        vhw = win(vh).to(acc).transpose(-1, -2)
        o = (e * frf).view(B, Hkv, nb, rep * C, n) @ vw + (e * (1 - frf)).view(B, Hkv, nb, rep * C, n) @ vhw
    else:
        o = e.view(B, Hkv, nb, rep * C, n) @ vw  # (B, Hkv, nb, rep*C, D)
    o = (o.view(B, Hkv, nb, rep, C, D) / z).transpose(2, 3).reshape(B, Hq, Tp, D)[:, :, :T]
    ln = (m + torch.log(z)).transpose(2, 3).reshape(B, Hq, Tp)[:, :, :T]
    return o, ln


def dense_sim_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """The same masked attention as a dense (T, T) softmax over both K/V versions: the reference
    `sim_attention` is tested against, and the baseline of bench/validate_speed.py."""
    lq = _SIM["quant"][module.layer_idx]
    p = _SIM["protocol"]
    B, Hq, T, D = query.shape
    sink = min(p.sink, T)
    b = lq.quantized_until(T, sink, 0)
    kh, vh = key.clone(), value.clone()
    kh[..., sink:b, :] = lq.keys(key[..., sink:b, :])
    vh[..., sink:b, :] = lq.values(value[..., sink:b, :])
    rep = Hq // key.shape[1]
    K, V = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)  # (B, Hq, T, D)
    Kh, Vh = kh.repeat_interleave(rep, 1), vh.repeat_interleave(rep, 1)
    fresh = fresh_mask(T, sink, p.recent, lq.key_group, query.device)  # (T, T)
    pos = torch.arange(T, device=query.device)
    scale = scaling if scaling is not None else D ** -0.5
    out = torch.empty_like(query)
    C = 512
    for q0 in range(0, T, C):
        q = query[:, :, q0:q0 + C]  # (B, Hq, c, D)
        fr = fresh[q0:q0 + C]  # (c, T)
        causal = pos[None, :] <= pos[q0:q0 + C, None]
        s = torch.where(fr, q @ K.transpose(-1, -2), q @ Kh.transpose(-1, -2)) * scale  # (B, Hq, c, T)
        s = s.masked_fill(~causal, float("-inf"))
        w = torch.softmax(s.float(), dim=-1).to(query.dtype)
        frf = fr.to(w.dtype)
        out[:, :, q0:q0 + C] = (w * frf) @ V + (w * (1 - frf)) @ Vh
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    for name, fn in (("oscar_sim", sim_attention), ("oscar_sim_dense", dense_sim_attention)):
        AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, sdpa_mask)  # our functions apply causality themselves


class simulated:
    """Context manager: the model's attention reads K/V through `art` under `protocol` (dense: the reference)."""

    def __init__(self, model, art, protocol, dense: bool = False):
        self.model, self.protocol, self.dense = model, protocol, dense
        self.quant = [LayerQuant(art, l, protocol.pages) for l in range(art.num_layers)]

    def __enter__(self):
        _register()
        self.prev = self.model.config._attn_implementation
        _SIM.update(quant=self.quant, protocol=self.protocol)
        self.model.set_attn_implementation("oscar_sim_dense" if self.dense else "oscar_sim")
        return self

    def __exit__(self, *exc):
        self.model.set_attn_implementation(self.prev)
        _SIM.update(quant=None, protocol=None)


@torch.no_grad()
def window_nll(model, ids: torch.Tensor, chunk: int = 512, prefixes: tuple[int, ...] = ()):
    """Sum of next-token NLL over a (1, T) window and the count T-1 (logits computed in chunks).

    prefixes: window lengths P < T whose (nll, P-1) are returned too, as a list after the pair: under
    a causal model (and the position mask above, which only looks back) the first P positions of
    this window compute exactly what a window of P tokens starting here computes.
    """
    h = model.model(input_ids=ids, use_cache=False).last_hidden_state  # (1, T, H)
    T = ids.shape[1]
    cuts = sorted({P - 1 for P in prefixes if 1 < P < T} | {T - 1})  # predicted tokens per part
    tot, sums, a = 0.0, {}, 0
    for a in range(0, T - 1, chunk):
        for lo, hi in _split(a, min(a + chunk, T - 1), cuts):
            logits = model.lm_head(h[:, lo:hi]).float()  # (1, c, V)
            tot += F.cross_entropy(logits[0], ids[0, lo + 1:hi + 1], reduction="sum").item()
            if hi in cuts:
                sums[hi] = tot
    if not prefixes:
        return tot, T - 1
    return tot, T - 1, [(sums[P - 1], P - 1) for P in prefixes]


def _split(a: int, b: int, cuts: list[int]) -> list[tuple[int, int]]:
    """[a, b) cut at every cut point strictly inside it."""
    pts = [a] + [c for c in cuts if a < c < b] + [b]
    return list(zip(pts[:-1], pts[1:]))


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
    """window_nll of one window under method `art` (None: the plain model) and `protocol`."""
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


def run_ppl(cfg: PplConfig, loaded=None, progress: bool = True, workers: int | None = None):
    """Score every (method, protocol, context, window) not yet in OUT; returns the perplexity table.

    workers: processes scoring windows in parallel (validate/workers.py; default: one per CPU this process
    may use, up to 4, or $OSCAR_WORKERS; 1: in this process, threads by load). A worker runs one intra-op
    thread; windows are independent, so a window's NLL does not depend on which worker scored it."""
    engine.check_engine(cfg.engine)
    dev = engine.resolve_device(cfg.device)  # before loading weights: no silent CPU run
    methods = parse_methods(cfg.methods)
    bad = [p for p in cfg.protocols if p not in PROTOCOLS]
    if bad:
        raise OscarError(f"unknown protocol(s) {bad}; known: {', '.join(PROTOCOLS)}")
    for c in cfg.contexts:
        if cfg.tokens < c:
            raise OscarError(f"--tokens {cfg.tokens} is shorter than context {c}")
    model, tok = load_checked(cfg.model, cfg.artifact, methods, cfg.contexts, cfg.dtype, loaded)
    engine.to_device(model, dev)
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

    fitted = load_artifact(cfg.artifact) if cfg.artifact else None
    if (warn := uncalibrated_warning(fitted, max(cfg.contexts))):
        print(f"oscar: WARNING: {warn}", file=sys.stderr)
    arts, skipped = resolve_methods(methods, model.config, fitted, out=cfg.out)  # unsupported formats: skipped
    methods = [m for m in methods if m not in skipped]
    if cfg.engine == "cache":  # refuse what the cache format cannot hold before anything runs
        engine.check_methods({m: arts[m] for m in methods}, [PROTOCOLS[p] for p in cfg.protocols])
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
    if next(model.parameters()).device.type != "cpu" or cfg.engine == "cache":
        n = 1  # worker processes share a CPU host's cores; an accelerator runs one stream; the cache engine inline
    with open(path, "a") as f, (Workers(n, model, _ppl_init, (arts, ids)) if n > 1 else _Inline()) as W:
        if n > 1:
            results = W.map(_ppl_unit, [(job, cuts) for job, _, cuts in plan])
        else:
            def inline():
                for k, ((m, p, c, w), _, cuts) in enumerate(plan):
                    bar.set_postfix_str(f"{m} {p} {c}")
                    with load_aware_threads():  # all cores when idle, one when shared (see niah.decode_threads)
                        win = ids[:, w * c:(w + 1) * c]
                        if cfg.engine == "cache" and arts[m] is not None:  # the product path (validate/engine.py)
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
    return write_ppl(cfg, methods, arts, model.config, done)


def _segments(cum: dict, P: int, nll: float, count: int) -> list[list[float]]:
    """[[nll, count], ...] of the SEGMENT-token segments of a P-token window, from the cumulative
    (nll, count) at its cut points (`cum`: window length -> (nll, count)) and its total."""
    pts = [(0.0, 0)] + [cum[q] for q in segment_cuts(P)] + [(nll, count)]
    return [[b[0] - a[0], b[1] - a[1]] for a, b in zip(pts[:-1], pts[1:])]


def write_ppl(cfg: PplConfig, methods, arts, config, done):
    D = attention_shapes(config)["head_dim"]
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
