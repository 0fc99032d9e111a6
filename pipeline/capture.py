"""Attention capture: a registered transformers attention function that records statistics.

`oscar_capture_<impl>` (e.g. `oscar_capture_sdpa`, `oscar_capture_eager`) wraps the
implementation `<impl>` and, while a `Capture` is active (`with cap.batch(mask, seq_offset)`),
feeds it the post-RoPE / post-q-norm q, k, v the model passes to its attention function and
the per-head output o = S V (the o_proj input). The matching mask function is registered
under the same name, so padding and causal masks are built exactly as for `<impl>`.

Nothing here assumes one process owns the whole model: a `Capture` accumulates only the
layers it was built for (a stage actor passes its layer range) and ignores the others, and
the function works for any subset of decoder layers that is run (it keys on `module.layer_idx`).

All accumulation is float64 and batched per layer (matmuls and reductions over whole
tensors): no Python loop over tokens or heads.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import sys
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
import torch

from oscar.common import OscarError

PREFIX = "oscar_capture_"
XS = ("q", "k", "v", "o")

# The capture that the registered attention function feeds (None: plain pass-through).
_ACTIVE: contextvars.ContextVar["_BatchContext | None"] = contextvars.ContextVar("oscar_capture", default=None)


# --------------------------------------------------------------------------- registration

def _eager_for(module: torch.nn.Module) -> Callable:
    """The model's own eager attention function (each modeling file defines one)."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward as fn
    return fn


def _make_capture_fn(impl: str) -> Callable:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def oscar_capture_attention(module, query, key, value, attention_mask, **kwargs):
        inner = _eager_for(module) if impl == "eager" else ALL_ATTENTION_FUNCTIONS[impl]
        out, weights = inner(module, query, key, value, attention_mask, **kwargs)  # out: (B, T, Hq, D)
        ctx = _ACTIVE.get()
        if ctx is not None:
            ctx.capture.record(module.layer_idx, query, key, value, out, ctx)
        return out, weights

    oscar_capture_attention.__name__ = f"{PREFIX}{impl}"
    return oscar_capture_attention


def register(impl: str = "sdpa") -> str:
    """Register `oscar_capture_<impl>` (attention + mask function); return its name. Idempotent."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    if impl.startswith(PREFIX):
        impl = impl[len(PREFIX):]
    if impl != "eager" and impl not in ALL_ATTENTION_FUNCTIONS:
        raise OscarError(f"unknown attention implementation {impl!r}; transformers offers "
                         f"eager, {', '.join(sorted(ALL_ATTENTION_FUNCTIONS.valid_keys()))}")
    if impl not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise OscarError(f"attention implementation {impl!r} has no mask function to pair the capture with")
    name = PREFIX + impl
    if name not in ALL_ATTENTION_FUNCTIONS._global_mapping:
        AttentionInterface.register(name, _make_capture_fn(impl))
        # Without the mask function transformers would silently build no mask at all.
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[impl])
    return name


def install(model: torch.nn.Module, impl: str | None = None) -> str:
    """Switch `model` to the capturing wrapper of `impl` (default: its current implementation)."""
    impl = impl or model.config._attn_implementation or "sdpa"
    name = register(impl)
    model.set_attn_implementation(name)
    return name


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack without LM head (logits are never computed during calibration)."""
    return getattr(model, getattr(model, "base_model_prefix", ""), None) or model


# --------------------------------------------------------------------------- accumulators

@dataclass
class CaptureSpec:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    layers: tuple[int, ...]          # layers this capture owns (a stage: its contiguous range)
    sink: int = 0
    reservoir: int = 256             # R rows per block, KV head and x
    seed: int = 0
    seqs_per_block: int = 1
    group: int = field(init=False)   # query heads per KV head

    def __post_init__(self):
        self.layers = tuple(int(l) for l in self.layers)
        if self.num_q_heads % self.num_kv_heads:
            raise OscarError(f"{self.num_q_heads} query heads are not a multiple of {self.num_kv_heads} KV heads")
        self.group = self.num_q_heads // self.num_kv_heads


def reservoir_seed(seed: int, block: int, layer: int) -> int:
    """Generator seed of the reservoir keys of (block, layer): independent of batching and process."""
    h = hashlib.sha256(f"oscar-reservoir/{seed}/{block}/{layer}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


class LayerAccumulator:
    """float64 sums of one layer over one block (everything lives on the activations' device).

    Per batch and x in q/k/v/o: gather the counted rows once as an (N, heads*D) float64 matrix,
    then one batched matmul (Gram) and a few column reductions (sum, x^3, x^4, min/max).
    Query and output heads of a GQA group are pooled by summing their per-head results.
    """

    def __init__(self, spec: CaptureSpec, layer: int, block: int, device: torch.device):
        H, D = spec.num_kv_heads, spec.head_dim
        z = lambda *s: torch.zeros(*s, dtype=torch.float64, device=device)  # noqa: E731
        self.spec, self.layer, self.block, self.device = spec, layer, block, device
        self.gram = {x: z(H, D, D) for x in XS}
        self.sum = {x: z(H, D) for x in XS}
        self.m3 = {x: z(H, D) for x in XS}
        self.m4 = {x: z(H, D) for x in XS}
        self.absmax = {x: z(H, D) for x in XS}
        self.vw_gram, self.w_sum = z(H, D, D), z(H)
        self.kv_count = self.nonfinite = 0
        # Reservoir keys: one uniform per (sequence, token) for k/v and per (sequence, token, group
        # head) for q/o, drawn once per (seed, block, layer); the R smallest keys are kept.
        self._gen = torch.Generator().manual_seed(reservoir_seed(spec.seed, block, layer))
        self.keys_kv = self.keys_qo = None  # sized on the first batch (T known then)
        self.res = {x: torch.zeros(H, 0, D, dtype=torch.float32, device=device) for x in XS}
        self.res_key = {"kv": z(0), "qo": z(0)}

    def _keys(self, T: int) -> None:
        S, G = self.spec.seqs_per_block, self.spec.group
        self.keys_kv = torch.rand(S, T, generator=self._gen, dtype=torch.float64).to(self.device)     # (S, T)
        self.keys_qo = torch.rand(S, T, G, generator=self._gen, dtype=torch.float64).to(self.device)  # (S, T, G)

    def _gram(self, X: torch.Tensor, heads: int) -> torch.Tensor:
        """X: (N, heads*D) rows -> (Hkv, D, D) Gram pooled over the heads of each KV group."""
        H, D = self.spec.num_kv_heads, self.spec.head_dim
        A = X.view(-1, heads, D).permute(1, 2, 0)                          # (heads, D, N) strided, no copy
        return (A @ A.mT).view(H, heads // H, D, D).sum(1)                 # (Hkv, D, D)

    def _column_stats(self, x: str, X: torch.Tensor, heads: int, colsum: torch.Tensor, gram: bool = True) -> None:
        """X: (N, heads*D) float64 counted rows -> Gram, sum, x^3, x^4, absmax pooled per KV head."""
        H, D = self.spec.num_kv_heads, self.spec.head_dim
        g = heads // H
        if gram:
            self.gram[x] += self._gram(X, heads)
        X2 = X * X                                                          # (N, heads*D)
        pool = lambda t: t.view(H, g, D).sum(1)                             # noqa: E731
        self.sum[x] += pool(colsum)
        self.m3[x] += pool(torch.linalg.vecdot(X2, X, dim=0))
        self.m4[x] += pool(torch.linalg.vecdot(X2, X2, dim=0))
        lo, hi = torch.aminmax(X, dim=0) if X.shape[0] else (X.new_zeros(X.shape[1]),) * 2
        self.absmax[x] = torch.maximum(self.absmax[x], torch.maximum(-lo, hi).view(H, g, D).amax(1))

    def _reservoir(self, kind: str, keys: torch.Tensor, take: Callable) -> None:
        """Merge candidates (keys: (M,)) into the R-smallest-key reservoir; take(idx) -> {x: (Hkv, n, D)}."""
        R = self.spec.reservoir
        new = torch.topk(keys, min(R, keys.numel()), largest=False, sorted=False).indices  # only these can enter
        k_all = torch.cat([self.res_key[kind], keys[new]])
        top = torch.topk(k_all, min(R, k_all.numel()), largest=False, sorted=True).indices
        self.res_key[kind] = k_all[top]
        for x, rows in take(new).items():
            cand = torch.cat([self.res[x], rows.float()], dim=1)           # (Hkv, r_old + n, D)
            self.res[x] = cand.index_select(1, top)

    def update(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, rows: "_Rows") -> None:
        """q: (B, Hq, T, D); k, v: (B, Hkv, T, D); out: (B, T, Hq, D) (the attention output, o_proj input)."""
        spec = self.spec
        B, Hq, T, D = q.shape
        H, G = spec.num_kv_heads, spec.group
        idx = rows.idx                                                      # (N,) flat b*T + t, sorted
        take = lambda t: t.reshape(B * T, -1).index_select(0, idx).double()  # noqa: E731
        Q = take(q.transpose(1, 2))                                         # (N, Hq*D)
        K = take(k.transpose(1, 2))                                         # (N, Hkv*D)
        V = take(v.transpose(1, 2))                                         # (N, Hkv*D)
        O = take(out)                                                       # (N, Hq*D)
        seq_n = rows.seq_n                                                  # (B,) counted rows per sequence
        # Fast check: column sums are finite iff every gathered value is. Otherwise drop bad rows.
        sums = [X.sum(0) for X in (Q, K, V, O)]
        if not bool(torch.isfinite(torch.stack([s.sum() for s in sums])).all()):
            fin = Q.isfinite().all(1) & K.isfinite().all(1) & V.isfinite().all(1) & O.isfinite().all(1)  # (N,)
            self.nonfinite += int((~fin).sum())
            Q, K, V, O, idx = Q[fin], K[fin], V[fin], O[fin], idx[fin]
            seq_n = torch.bincount(idx // T, minlength=B)
            sums = [X.sum(0) for X in (Q, K, V, O)]
        N = Q.shape[0]
        self.kv_count += N
        for x, X, heads, cs in zip(XS, (Q, K, V, O), (Hq, H, H, Hq), sums):
            self._column_stats(x, X, heads, cs, gram=(x != "q"))

        # q Gram per sequence: summed it is q_gram; each is the C_Q of the published value target
        # sum_t w_t v_t v_t^T, w_t = k_t C_Q k_t^T (C_Q of the same sequence, see docs/decisions.md).
        Kh = K.view(N, H, D).transpose(0, 1)                                # (Hkv, N, D)
        Vh = V.view(N, H, D).transpose(0, 1)                                # (Hkv, N, D)
        ws, start = [], 0
        for n in seq_n.tolist():  # the batch's sequences (not tokens)
            gq = self._gram(Q[start:start + n], Hq)                         # (Hkv, D, D)
            self.gram["q"] += gq
            Kb = Kh[:, start:start + n]                                     # (Hkv, n, D)
            ws.append(((Kb @ (gq / max(n * G, 1))) * Kb).sum(-1))           # (Hkv, n)
            start += n
        w = torch.cat(ws, dim=1) if ws else Kh.new_zeros(H, 0)              # (Hkv, N)
        self.vw_gram += (Vh * w[..., None]).mT @ Vh
        self.w_sum += w.sum(1)

        if spec.reservoir > 0 and N:
            if self.keys_kv is None:
                self._keys(T)
            elif self.keys_kv.shape[1] != T:
                raise OscarError(f"sequence length changed within block {self.block}")
            s0 = rows.seq_offset
            b, t = idx // T, idx % T
            kk = self.keys_kv[s0 + b, t]                                    # (N,)
            kq = self.keys_qo[s0 + b, t].reshape(-1)                        # (N*G,) row-major (n, g)
            Qg, Og = Q.view(N, H, G, D), O.view(N, H, G, D)

            def take_kv(i):
                return {"k": Kh[:, i], "v": Vh[:, i]}

            def take_qo(i):  # i = n*G + g; query head of KV head h is h*G + g
                n, g = i // G, i % G
                return {"q": Qg[n, :, g].transpose(0, 1), "o": Og[n, :, g].transpose(0, 1)}

            self._reservoir("kv", kk, take_kv)
            self._reservoir("qo", kq, take_qo)

    def arrays(self) -> dict[str, np.ndarray]:
        """The block's values under their store names (numpy, CPU)."""
        spec = self.spec
        H, D, R = spec.num_kv_heads, spec.head_dim, spec.reservoir
        out: dict[str, np.ndarray] = {}
        for x in XS:
            out[f"{x}_gram"] = self.gram[x].cpu().numpy()
            out[f"{x}_sum"] = self.sum[x].cpu().numpy()
            out[f"{x}_m3"] = self.m3[x].cpu().numpy()
            out[f"{x}_m4"] = self.m4[x].cpu().numpy()
            out[f"{x}_absmax"] = self.absmax[x].cpu().numpy()
            res = np.zeros((H, R, D), dtype=np.float32)
            r = self.res[x].cpu().numpy()
            res[:, : r.shape[1]] = r
            out[f"{x}_res"] = res
        out["q_count"] = np.array(self.kv_count * spec.group, dtype=np.int64)
        out["kv_count"] = np.array(self.kv_count, dtype=np.int64)
        out["vw_gram"] = self.vw_gram.cpu().numpy()
        out["w_sum"] = self.w_sum.cpu().numpy()
        out["nonfinite"] = np.array(self.nonfinite, dtype=np.int64)
        out["res_count"] = np.array(self.res_key["kv"].numel(), dtype=np.int64)
        out["qo_res_count"] = np.array(self.res_key["qo"].numel(), dtype=np.int64)
        return out


@dataclass
class _Rows:
    """The counted-row candidates of one batch on one device (shared by every layer)."""
    idx: torch.Tensor     # (N,) flat indices b*T + t of eligible rows, ascending
    seq_n: torch.Tensor   # (B,) eligible rows per sequence
    seq_offset: int       # index of the batch's first sequence in its block


@dataclass
class _BatchContext:
    capture: "Capture"
    eligible: torch.Tensor  # (B, T) bool: real tokens at position >= sink
    seq_offset: int
    _rows: dict = field(default_factory=dict)

    def rows(self, device: torch.device) -> _Rows:
        r = self._rows.get(device)
        if r is None:
            e = self.eligible.to(device)
            r = self._rows[device] = _Rows(torch.nonzero(e.reshape(-1)).flatten(), e.sum(1), self.seq_offset)
        return r


class Capture:
    """Accumulates one block at a time for the layers in `spec.layers`.

    cap.start_block(b)
    for each batch of the block's sequences:
        with cap.batch(mask, seq_offset):      # mask: (B, T) 1 = real token
            run decoder layers (any subset; layers not owned are ignored)
    arrays = cap.finish_block()                # {layer: {name: ndarray}}
    """

    def __init__(self, spec: CaptureSpec):
        self.spec = spec
        self.block: int | None = None
        self.acc: dict[int, LayerAccumulator] = {}
        self.calls: dict[int, int] = {}

    def start_block(self, block: int) -> None:
        self.block, self.acc, self.calls = int(block), {}, {}

    def eligible_rows(self, mask: torch.Tensor) -> torch.Tensor:
        """(B, T) bool: real tokens whose position (real tokens before them) is >= sink."""
        real = mask.bool()
        pos = real.long().cumsum(-1) - 1
        return real & (pos >= self.spec.sink)

    @contextlib.contextmanager
    def batch(self, mask: torch.Tensor, seq_offset: int = 0) -> Iterator[None]:
        if self.block is None:
            raise RuntimeError("Capture.batch() outside a block: call start_block() first")
        token = _ACTIVE.set(_BatchContext(self, self.eligible_rows(mask), int(seq_offset)))
        try:
            with torch.no_grad():
                yield
        finally:
            _ACTIVE.reset(token)

    def record(self, layer, q, k, v, out, ctx: _BatchContext) -> None:
        """q: (B, Hq, T, D), k/v: (B, Hkv, T, D) as passed to attention; out: (B, T, Hq, D) its output."""
        if layer not in self.spec.layers:
            return
        if q.shape[2] != ctx.eligible.shape[1] or q.shape[0] != ctx.eligible.shape[0] or k.shape[2] != q.shape[2]:
            raise OscarError(f"capture: attention saw q {tuple(q.shape)}, k {tuple(k.shape)} but the batch mask is "
                             f"{tuple(ctx.eligible.shape)} (KV cache on? calibration runs with use_cache=False)")
        if ctx.seq_offset + q.shape[0] > self.spec.seqs_per_block:
            raise OscarError(f"batch rows {ctx.seq_offset}..{ctx.seq_offset + q.shape[0]} exceed "
                             f"seqs_per_block={self.spec.seqs_per_block}")
        acc = self.acc.get(layer)
        if acc is None:
            acc = self.acc[layer] = LayerAccumulator(self.spec, layer, self.block, q.device)
        acc.update(q.detach(), k.detach(), v.detach(), out.detach(), ctx.rows(q.device))
        self.calls[layer] = self.calls.get(layer, 0) + 1

    def finish_block(self, layers: tuple[int, ...] | None = None) -> dict[int, dict[str, np.ndarray]]:
        layers = self.spec.layers if layers is None else layers
        missing = [l for l in layers if l not in self.acc]
        if missing:
            raise OscarError(f"capture: block {self.block} never reached layers {missing} "
                             f"(is the model using attn_implementation '{PREFIX}*'?)")
        out = {l: self.acc[l].arrays() for l in layers}
        self.block, self.acc = None, {}
        return out
