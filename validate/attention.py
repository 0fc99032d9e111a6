"""`oscar validate attention`: attention-level needle retrieval to 128k on held-out captured q/k/v.

NOT a model run. The embedded model stops at 8k; this asks the narrower question the INT2 cache
must answer at any length: at the end of N real keys, does the key a real query prefers stay
ranked first once the keys are read from INT2, and how far does the attention output move?

Data (validate/heldout.py): held-out text the calibration never saw (the corpus's held-out split,
then standard-library docstrings), cut into whole sequences of `seq_len` tokens and run through
the model once; `pipeline.capture.RowCapture` keeps the post-RoPE q/k/v the attention function
receives, at their own positions. Before anything is captured the text is checked against the
calibration store's tokens (no shared 32-token run) and the artifact against the store (its
provenance names this store's model, corpus and blocks).

Layout, per layer: the *stream* is every sequence's rows at positions [sink, T) laid end to end
(no row repeated); a context of length N is the first sequence's `sink` rows (exact) followed by
N - sink consecutive stream rows starting at an aligned offset `a`. The query is the captured query
of the context's last token (a decode step at the end of the context), one trial per query head.

Needle: the real key with the highest exact logit among the context's non-sink keys; its margin is
its lead over the best other non-sink key, in nats (logit difference / sqrt(D): exp(margin) = the
ratio of their attention weights) and in standard deviations of the logits. Results are binned
by margin: retrieval as a curve over margins, not at one planted margin.

Measured per trial and method: top-1 kept (argmax of q·k̂ over non-sink keys is the needle), the
needle's rank after INT2, the relative error of the attention output ||ô - o|| / ||o|| (sink
included, values INT2 too) and the needle's attention weight exact / INT2. Every non-sink key is
read from INT2 (per-channel key groups: the trailing incomplete group stays exact), as before.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd
import torch
from tqdm import tqdm

from oscar.common import OscarError, config_fingerprint, model_mismatch
from oscar.defaults import DEFAULT_METHODS
from oscar.defaults import SINK
from oscar.kernels import cpu_attention
from oscar.kernels.simulate import LayerQuant
from oscar.kernels.protocol import Protocol
from oscar.pipeline import capture as C
from oscar.pipeline.store import open_verified, store_fingerprint
from oscar.stats.artifact import load_artifact
from oscar.scoring import engine
from oscar.validate.env import load_model, max_context
from oscar.scoring.dtype import with_dtype
from oscar.validate.heldout import check_disjoint, heldout_sequences
from oscar.validate.methods import NEEDS_ARTIFACT, parse_methods, resolve_methods

# Margin bin edges in nats (exp(0.25) = 1.28x the runner-up's weight, exp(4) = 55x).
MARGIN_EDGES = (0.0, 0.125, 0.25, 0.5, 1.0, 2.0, 4.0, math.inf)


def margin_bin(m: float) -> str:
    for lo, hi in zip(MARGIN_EDGES[:-1], MARGIN_EDGES[1:]):
        if m < hi:
            return f"{lo:g}-{hi:g}" if hi != math.inf else f">={lo:g}"
    return f">={MARGIN_EDGES[-2]:g}"


@dataclass
class AttnConfig:
    out: str
    store: str
    artifact: str | None = None
    methods: list[str] = field(default_factory=lambda: [m for m in DEFAULT_METHODS if m != "bf16"])
    lengths: list[int] = field(default_factory=lambda: [4096, 16384, 65536, 131072])
    windows: int = 8  # contexts per (layer, length); each is scored by every query head (trials = windows x Hq)
    layers: list[int] = field(default_factory=list)  # default: 4 spread over depth
    sink: int = SINK
    seq_len: int = 4096  # tokens per captured held-out sequence (<= the model's context)
    model: str | None = None  # default: the store's model
    corpus: str = "pydoc"  # whose held-out split comes first (then standard-library docstrings)
    dtype: str = "float32"  # model compute dtype of the capture
    seed: int = 0
    engine: str = "simulate"  # INT2 reading: simulate (LayerQuant) or cache (the paged cache: oscar/scoring/engine.py)
    device: str = "cpu"  # where the capture runs (cpu, cuda, cuda:N)


def check_provenance(fitted, store_meta, store_attrs: dict, store_path: str) -> dict:
    """Refuse an artifact not fitted on this store (model, corpus, job config, blocks): the token
    check against the store would then prove nothing about the artifact."""
    prov = fitted.meta.get("provenance") or {}

    why = model_mismatch(fitted.meta.get("model", {}), store_meta.model, "artifact")
    if why:
        raise OscarError(f"{why} (store {store_path})")
    if not prov:
        return {"checked": False, "why": "artifact records no provenance (baseline methods only)"}
    pc, sc = (prov.get("corpus") or {}).get("fingerprint"), store_meta.corpus.get("fingerprint")
    if pc != sc:
        raise OscarError(f"artifact was fitted on corpus fingerprint {pc}, store {store_path} holds corpus {sc}: "
                         f"pass the store the artifact was fitted on (its provenance: {prov.get('store')})")
    blocks = prov.get("blocks")
    if blocks is not None:
        fp = store_fingerprint(store_attrs, blocks)
        if fp != prov.get("store_fingerprint"):
            raise OscarError(f"artifact provenance store fingerprint {prov.get('store_fingerprint')} is not that of "
                             f"{store_path} ({fp}): the artifact was fitted on another store")
        if blocks and max(blocks) >= store_meta.num_blocks:
            raise OscarError(f"artifact was fitted on blocks {blocks} but {store_path} has {store_meta.num_blocks}")
    return {"checked": True, "store_fingerprint": prov.get("store_fingerprint"), "corpus_fingerprint": pc,
            "blocks": blocks}


def plan_windows(lengths: list[int], stream: int, sink: int, align: int, windows: int, seed: int) -> dict[int, list[int]]:
    """{N: sorted distinct aligned stream offsets a} with a + N - sink <= stream, `windows` per N (fewer if they don't fit)."""
    g = np.random.default_rng(seed)
    out = {}
    for N in lengths:
        n_starts = (stream - (N - sink)) // align + 1
        if n_starts < 1:
            raise OscarError(f"length {N} needs {N - sink} stream rows, the capture has {stream}")
        out[N] = sorted(int(a) * align for a in g.choice(n_starts, min(windows, n_starts), replace=False))
    return out


def stream_rows_needed(lengths: list[int], sink: int, align: int, windows: int) -> int:
    return max(lengths) - sink + (windows - 1) * align


def sequence_lengths(stream: int, seq_len: int, sink: int) -> list[int]:
    """Token counts of the captured sequences giving `stream` rows at positions >= sink (the last one shorter)."""
    per = seq_len - sink
    k = -(-stream // per)
    return [seq_len] * (k - 1) + [stream - (k - 1) * per + sink]


@dataclass
class Window:
    """The keys and values one trial's query attends to: the sink rows and the window's non-sink rows."""
    k0: torch.Tensor  # (Hkv, s, D) sink keys
    v0: torch.Tensor  # (Hkv, s, D)
    k: torch.Tensor   # (Hkv, n, D) non-sink keys
    v: torch.Tensor   # (Hkv, n, D)


def trial_metrics(exact: Window, int2: Window, Q: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every query head's trial on one context.

    `exact`: the window as captured; `int2`: its INT2 reading (sink rows exact, passed for symmetry);
    Q (Hkv, G, D): the last token's query heads, grouped by KV head. Returns (Hkv, G) tensors: needle
    (index into the non-sink rows), margin (nats), margin_std, top1, rank_int2, out_rel_err,
    needle_weight, needle_weight_int2.
    """
    K0, V0, Kw, Vw = exact.k0, exact.v0, exact.k, exact.v
    K0q, V0q, Kwq, Vwq = int2.k0, int2.v0, int2.k, int2.v
    D = Q.shape[-1]
    s = 1.0 / math.sqrt(D)
    lw = torch.einsum("hnd,hgd->hgn", Kw, Q)                                          # (Hkv, G, n)
    l0 = torch.einsum("hnd,hgd->hgn", K0, Q)                                          # (Hkv, G, s)
    top2 = lw.topk(2, dim=-1)
    needle = top2.indices[..., 0]                                                     # (Hkv, G)
    gap = top2.values[..., 0] - top2.values[..., 1]
    lwq = torch.einsum("hnd,hgd->hgn", Kwq, Q)
    l0q = torch.einsum("hnd,hgd->hgn", K0q, Q)
    nq = lwq.gather(-1, needle[..., None])                                            # (Hkv, G, 1)
    rank = (lwq > nq).sum(-1)
    pe = torch.softmax(torch.cat([l0, lw], -1) * s, -1)                               # (Hkv, G, s + n)
    pq = torch.softmax(torch.cat([l0q, lwq], -1) * s, -1)
    n0 = K0.shape[1]
    o = torch.einsum("hgn,hnd->hgd", pe[..., :n0], V0) + torch.einsum("hgn,hnd->hgd", pe[..., n0:], Vw)
    oh = torch.einsum("hgn,hnd->hgd", pq[..., :n0], V0q) + torch.einsum("hgn,hnd->hgd", pq[..., n0:], Vwq)
    return {"needle": needle, "margin": gap * s, "margin_std": gap / lw.std(-1).clamp_min(1e-12),
            "top1": (rank == 0).float(), "rank_int2": rank,
            "out_rel_err": (oh - o).norm(dim=-1) / o.norm(dim=-1).clamp_min(1e-12),
            "needle_weight": pe[..., n0:].gather(-1, needle[..., None])[..., 0],
            "needle_weight_int2": pq[..., n0:].gather(-1, needle[..., None])[..., 0]}


def quantize_stream(lq, Ks: torch.Tensor, Vs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """INT2 reading of the stream (Hkv, S, D): keys in whole groups from offset 0 (the tail exact), values per token."""
    G = lq.key_group
    b = Ks.shape[1] // G * G
    Kq = Ks.clone()
    Kq[:, :b] = lq.keys(Ks[None, :, :b])[0]
    return Kq, lq.values(Vs[None])[0]


def window_keys_int2(Kq: torch.Tensor, Ks: torch.Tensor, a: int, n: int, group: int) -> torch.Tensor:
    """The INT2 reading of stream keys [a, a + n) (a a multiple of `group`): whole groups from Kq, the incomplete tail exact."""
    nf = n // group * group
    return torch.cat([Kq[:, a:a + nf], Ks[:, a + nf:a + n]], 1) if nf < n else Kq[:, a:a + n]


def capture_rows(model, seqs: list[np.ndarray], layers: list[int], q_pos: dict[int, list[int]], progress: bool = False):
    """Run each sequence through the model once; (k, v per layer: lists (Hkv, T, D); q per layer: {seq: (Hq, n, D)})."""
    impl = model.config._attn_implementation
    cpu_attention.register()  # the capture's sdpa: the native kernel, as calibration ran it (bit-equal K/V)
    C.install(model, impl if impl in ("eager", "sdpa") else "sdpa")  # q/k/v do not depend on the kernel
    base = C.base_model(model)
    dev = next(model.parameters()).device
    cap = C.RowCapture(layers, q_every=1)
    qs: dict[int, dict[int, torch.Tensor]] = {l: {} for l in layers}
    try:
        for i, s in enumerate(tqdm(seqs, desc="capture held-out sequences", disable=not progress, dynamic_ncols=True)):
            ids = torch.from_numpy(s)[None].to(dev)                                   # (1, T)
            with cap.batch(torch.ones_like(ids), seq_offset=i):
                base(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
            pos = torch.tensor(q_pos.get(i, []), dtype=torch.long)
            for l in layers:  # keep only the query positions scored (the rest would be ~2x the K/V memory)
                qs[l][i] = cap.q[l][-1].index_select(1, pos).clone()                  # (Hq, n, D)
                cap.q[l][-1] = None
    finally:
        model.set_attn_implementation(impl[len(C.PREFIX):] if impl.startswith(C.PREFIX) else impl)
    return cap.k, cap.v, qs


def run_attention(cfg: AttnConfig, progress: bool = True, loaded=None):
    t0 = time.perf_counter()
    engine.check_engine(cfg.engine)
    dev = engine.resolve_device(cfg.device)  # before loading weights: no silent CPU run
    methods = parse_methods(cfg.methods)
    if cfg.artifact is None and any(m in NEEDS_ARTIFACT for m in methods):
        raise OscarError("oscar-int2 needs --artifact")
    if not cfg.lengths or min(cfg.lengths) <= cfg.sink + 1:
        raise OscarError(f"lengths {cfg.lengths} must all exceed the sink ({cfg.sink}) + 1: a needle needs a runner-up")
    if cfg.windows < 1:
        raise OscarError(f"windows must be >= 1, got {cfg.windows}")
    if cfg.seq_len <= cfg.sink + 1:
        raise OscarError(f"seq_len {cfg.seq_len} must exceed the sink {cfg.sink} + 1")
    st = open_verified(cfg.store)  # the store format's owner: a damaged done block is refused
    mi = st.meta.model
    L, Hkv, D = int(mi["num_layers"]), int(mi["num_kv_heads"]), int(mi["head_dim"])
    layers = sorted(set(cfg.layers)) if cfg.layers else sorted({0, L // 3, (2 * L) // 3, L - 1})
    bad = [l for l in layers if not 0 <= l < L]
    if bad:
        raise OscarError(f"layers {bad} out of range for a {L}-layer model")
    fitted = load_artifact(cfg.artifact) if cfg.artifact else None
    prov = {"checked": False, "why": "no artifact"}
    if fitted is not None:
        have = (fitted.num_layers, fitted.num_kv_heads, fitted.head_dim)
        if have != (L, Hkv, D):
            raise OscarError(f"artifact {cfg.artifact} (shapes {have}) was not fitted for the store's model "
                             f"(shapes {(L, Hkv, D)})")
        prov = check_provenance(fitted, st.meta, dict(st.group.attrs), cfg.store)

    model, tok, _ = loaded if loaded is not None else load_model(cfg.model or mi.get("source") or mi["name"])

    if mi.get("fingerprint") and config_fingerprint(model.config) != mi.get("config_fingerprint", mi["fingerprint"]):
        raise OscarError(f"model {cfg.model or mi.get('name')} (fingerprint {config_fingerprint(model.config)}) is not "
                         f"the store's model ({mi.get('name')}, {mi['fingerprint']})")
    ctx = max_context(model)
    if ctx and cfg.seq_len > ctx:
        raise OscarError(f"seq_len {cfg.seq_len} exceeds the model's context ({ctx}): capture sequences at real positions")
    with_dtype(model, cfg.dtype)
    engine.to_device(model, dev)
    Hq = int(model.config.num_attention_heads)
    Gq = Hq // Hkv

    class _Shapes:  # the store model's attention shapes, for the baselines' identity artifacts
        def __init__(self, d):
            self.__dict__.update(d)

        def to_dict(self):
            return dict(self.__dict__)

    shapes = _Shapes({"num_hidden_layers": L, "num_attention_heads": Hq, "num_key_value_heads": Hkv, "head_dim": D,
                      "hidden_size": Hq * D})
    arts, skipped = resolve_methods(methods, shapes, fitted, checked=False, out=cfg.out)  # unsupported: skipped
    methods = [m for m in methods if m not in skipped]
    if not methods:
        raise OscarError(f"no method can serve this model: {skipped}")
    if cfg.engine == "cache":  # refuse what the cache format cannot hold before the capture

        engine.check_methods({m: arts[m] for m in methods}, [Protocol("attention", sink=0, recent=0)])
    align = math.lcm(*[LayerQuant(arts[m], 0, pages=False).key_group for m in methods])

    # 1. held-out sequences, checked against every calibration token of the store
    stream = stream_rows_needed(cfg.lengths, cfg.sink, align, cfg.windows)
    lens = sequence_lengths(stream, cfg.seq_len, cfg.sink)
    held = heldout_sequences(tok, sum(lens), cfg.seq_len, cfg.corpus)
    seqs = held.seqs
    if [len(s) for s in seqs] != lens:
        raise OscarError(f"held-out sequences {[len(s) for s in seqs]} differ from the plan {lens}")
    overlap = check_disjoint(seqs, st.array("tokens")[:], st.array("mask")[:])

    # 2. contexts and their last tokens' queries
    wins = plan_windows(cfg.lengths, stream, cfg.sink, align, cfg.windows, cfg.seed)
    starts = np.cumsum([0] + [n - cfg.sink for n in lens])                           # stream offset of each sequence
    q_pos: dict[int, list[int]] = {}
    ends = {}
    for N, aa in wins.items():
        for a in aa:
            e = a + N - cfg.sink - 1
            s = int(np.searchsorted(starts, e, side="right") - 1)
            p = int(e - starts[s] + cfg.sink)
            ends[(N, a)] = (s, p)
            if p not in q_pos.setdefault(s, []):
                q_pos[s].append(p)
    q_pos = {s: sorted(v) for s, v in q_pos.items()}
    t_cap = time.perf_counter()
    K, V, Qs = capture_rows(model, seqs, layers, q_pos, progress)
    cap_s = time.perf_counter() - t_cap

    rows = []
    bar = tqdm(total=len(layers) * len(methods), desc="attention", disable=not progress, dynamic_ncols=True)
    for l in layers:
        K0, V0 = K[l][0][:, :cfg.sink].float(), V[l][0][:, :cfg.sink].float()        # (Hkv, sink, D)
        Ks = torch.cat([k[:, cfg.sink:] for k in K[l]], 1).float()                    # (Hkv, S, D)
        Vs = torch.cat([v[:, cfg.sink:] for v in V[l]], 1).float()
        K[l], V[l] = None, None
        seq_of = np.searchsorted(starts, np.arange(Ks.shape[1]), side="right") - 1
        for m in methods:
            bar.set_postfix_str(f"layer {l} {m}")
            lq = LayerQuant(arts[m], l, pages=False)  # every non-sink key INT2 (whole groups for per-channel keys)
            if cfg.engine == "cache":  # the paged cache's own pages (dispatcher quantizer), read back
                Kq, Vq = engine.cache_stream(m, arts[m], l, Ks, Vs, getattr(torch, cfg.dtype))
            else:
                Kq, Vq = quantize_stream(lq, Ks, Vs)
            for N, aa in wins.items():
                n = N - cfg.sink
                for w, a in enumerate(aa):
                    s, p = ends[(N, a)]
                    Q = Qs[l][s][:, q_pos[s].index(p)].float().view(Hkv, Gq, D)    # (Hkv, G, D)
                    Kwq = window_keys_int2(Kq, Ks, a, n, lq.key_group)                   # (Hkv, n, D)
                    r = trial_metrics(Window(K0, V0, Ks[:, a:a + n], Vs[:, a:a + n]),
                                      Window(K0, V0, Kwq, Vq[:, a:a + n]), Q)
                    for h in range(Hkv):
                        for g in range(Gq):
                            j = a + int(r["needle"][h, g])
                            mg = float(r["margin"][h, g])
                            rows.append({
                                "layer": l, "head": h, "q_head": h * Gq + g, "length": N, "method": m, "window": w,
                                "start": a, "query_seq": s, "query_pos": p, "needle_seq": int(seq_of[j]),
                                "needle_pos": int(j - starts[seq_of[j]] + cfg.sink), "needle_back": a + n - 1 - j,
                                "margin": mg, "margin_std": float(r["margin_std"][h, g]), "margin_bin": margin_bin(mg),
                                "top1": float(r["top1"][h, g]), "rank_int2": int(r["rank_int2"][h, g]),
                                "out_rel_err": float(r["out_rel_err"][h, g]),
                                "needle_weight": float(r["needle_weight"][h, g]),
                                "needle_weight_int2": float(r["needle_weight_int2"][h, g]),
                                "unique_tokens": N, "sink": cfg.sink, "seq_len": cfg.seq_len})
            bar.update(1)
    bar.close()
    df = pd.DataFrame(rows)
    os.makedirs(cfg.out, exist_ok=True)
    df.to_parquet(os.path.join(cfg.out, "attention.parquet"), index=False)
    meta = {"kind": "attention-level (not a model run)", "config": asdict(cfg), "methods": methods, "layers": layers,
            "heldout": {**held.info, "fingerprint": held.fingerprint, "tokens": held.num_tokens,
                        "sources": sorted(set(held.sources))},
            "stream_rows": stream, "sequence_lengths": lens, "align": align, "overlap_check": overlap,
            "provenance_check": prov, "capture_seconds": round(cap_s, 2),
            "seconds": round(time.perf_counter() - t0, 2)}
    with open(os.path.join(cfg.out, "attention.json"), "w") as f:
        json.dump(meta, f, indent=1, default=str)
    return df.groupby(["method", "length"])[["top1", "out_rel_err"]].mean().reset_index()
