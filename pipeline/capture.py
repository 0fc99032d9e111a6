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
            ctx.capture.record(module.layer_idx, query, key, value, out.transpose(1, 2), ctx)
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
    """float64 sums of one layer over one block (everything lives on the activations' device)."""

    def __init__(self, spec: CaptureSpec, layer: int, block: int, device: torch.device):
        H, D, R, G = spec.num_kv_heads, spec.head_dim, spec.reservoir, spec.group
        z = lambda *s: torch.zeros(*s, dtype=torch.float64, device=device)  # noqa: E731
        self.spec, self.layer, self.block, self.device = spec, layer, block, device
        self.gram = {x: z(H, D, D) for x in XS}
        self.sum = {x: z(H, D) for x in XS}
        self.m3 = {x: z(H, D) for x in XS}
        self.m4 = {x: z(H, D) for x in XS}
        self.absmax = {x: z(H, D) for x in XS}
        self.vw_gram, self.w_sum = z(H, D, D), z(H)
        i64 = lambda: torch.zeros((), dtype=torch.int64, device=device)  # noqa: E731
        self.kv_count, self.nonfinite = i64(), i64()
        # Reservoir keys: one uniform per (sequence, token) for k/v and per (sequence, group head,
        # token) for q/o, drawn once per (seed, block, layer); the R smallest keys are kept.
        self._gen = torch.Generator().manual_seed(reservoir_seed(spec.seed, block, layer))
        self._S = spec.seqs_per_block
        self.keys_kv = self.keys_qo = None  # lazily sized on the first batch (T known then)
        self.res = {x: torch.zeros(H, 0, D, dtype=torch.float32, device=device) for x in XS}
        self.res_key = {"kv": torch.zeros(0, dtype=torch.float64, device=device),
                        "qo": torch.zeros(0, dtype=torch.float64, device=device)}

    # (B, Hkv, N, D) float64 rows -> gram / sums / moments, summed over B and N
    def _moments(self, x: str, X: torch.Tensor) -> None:
        Xf = X.transpose(0, 1).reshape(X.shape[1], -1, X.shape[-1])  # (Hkv, B*N, D)
        self.gram[x] += Xf.mT @ Xf
        self.sum[x] += Xf.sum(1)
        X2 = Xf * Xf
        self.m3[x] += (X2 * Xf).sum(1)
        self.m4[x] += (X2 * X2).sum(1)
        self.absmax[x] = torch.maximum(self.absmax[x], Xf.abs().amax(1))

    def _keys(self, T: int) -> None:
        S, G = self._S, self.spec.group
        self.keys_kv = torch.rand(S, T, generator=self._gen, dtype=torch.float64).to(self.device)     # (S, T)
        self.keys_qo = torch.rand(S, G, T, generator=self._gen, dtype=torch.float64).to(self.device)  # (S, G, T)

    def _reservoir(self, kind: str, xs: tuple[str, ...], keys: torch.Tensor, take: Callable) -> None:
        """Merge candidates (keys: (N,), +inf for excluded rows; take(idx) -> {x: (Hkv, n, D)})."""
        R = self.spec.reservoir
        old = self.res_key[kind]
        thresh = old[-1] if old.numel() >= R else torch.inf
        new = torch.nonzero(keys < thresh).flatten()  # few rows once the reservoir is full
        k_all = torch.cat([old, keys[new]])
        top = torch.topk(k_all, min(R, k_all.numel()), largest=False, sorted=True).indices
        self.res_key[kind] = k_all[top]
        rows = take(new)
        for x in xs:
            cand = torch.cat([self.res[x], rows[x].float()], dim=1)  # (Hkv, r_old + n, D)
            self.res[x] = cand.index_select(1, top)

    def update(self, q, k, v, o, eligible: torch.Tensor, seq_offset: int) -> None:
        """q, o: (B, Hq, T, D); k, v: (B, Hkv, T, D); eligible: (B, T) bool (real, past the sink)."""
        spec = self.spec
        B, _, T, D = q.shape
        H, G = spec.num_kv_heads, spec.group
        if seq_offset + B > spec.seqs_per_block:
            raise OscarError(f"batch rows {seq_offset}..{seq_offset + B} exceed seqs_per_block={spec.seqs_per_block}")
        finite = (q.isfinite().all(-1).all(1) & k.isfinite().all(-1).all(1)
                  & v.isfinite().all(-1).all(1) & o.isfinite().all(-1).all(1))            # (B, T)
        ok = eligible & finite                                                            # (B, T)
        self.nonfinite += (eligible & ~finite).sum()
        self.kv_count += ok.sum()

        m = ok[:, None, :, None]                                                          # (B, 1, T, 1)
        mg = ok[:, None, None, :, None]                                                   # (B, 1, 1, T, 1)
        zero = torch.zeros((), dtype=torch.float64, device=q.device)
        # where() (not a multiply): excluded rows may hold NaN/Inf.
        Q = torch.where(mg, q.reshape(B, H, G, T, D).double(), zero).reshape(B, H, G * T, D)  # (B, Hkv, G*T, D)
        O = torch.where(mg, o.reshape(B, H, G, T, D).double(), zero).reshape(B, H, G * T, D)  # (B, Hkv, G*T, D)
        K = torch.where(m, k.double(), zero)                                              # (B, Hkv, T, D)
        V = torch.where(m, v.double(), zero)                                              # (B, Hkv, T, D)

        # Per-sequence query Gram: its sum is q_gram, and it is the C_Q of the value weights.
        q_gram_b = Q.mT @ Q                                                               # (B, Hkv, D, D)
        self.gram["q"] += q_gram_b.sum(0)
        Xf = Q.transpose(0, 1).reshape(H, -1, D)                                          # (Hkv, B*G*T, D)
        self.sum["q"] += Xf.sum(1)
        X2 = Xf * Xf
        self.m3["q"] += (X2 * Xf).sum(1)
        self.m4["q"] += (X2 * X2).sum(1)
        self.absmax["q"] = torch.maximum(self.absmax["q"], Xf.abs().amax(1))
        for x, X in (("o", O), ("k", K), ("v", V)):
            self._moments(x, X)

        # Published value target: sum_t w_t v_t v_t^T, w_t = k_t C_Q k_t^T, C_Q of the same sequence.
        nq = (ok.sum(1) * G).clamp(min=1).double()                                        # (B,)
        cq = q_gram_b / nq[:, None, None, None]                                           # (B, Hkv, D, D)
        w = ((K @ cq) * K).sum(-1)                                                        # (B, Hkv, T)
        Vf = V.transpose(0, 1).reshape(H, B * T, D)                                       # (Hkv, B*T, D)
        wf = w.transpose(0, 1).reshape(H, B * T, 1)                                       # (Hkv, B*T, 1)
        self.vw_gram += (Vf * wf).mT @ Vf
        self.w_sum += w.sum((0, 2))

        # Reservoirs (raw activations, not the float64 copies).
        if spec.reservoir > 0:
            if self.keys_kv is None or self.keys_kv.shape[1] != T:
                if self.keys_kv is not None:
                    raise OscarError(f"sequence length changed within block {self.block}")
                self._keys(T)
            inf = torch.full((), torch.inf, dtype=torch.float64, device=q.device)
            kk = torch.where(ok, self.keys_kv[seq_offset:seq_offset + B], inf).reshape(-1)           # (B*T,)
            kq = torch.where(ok[:, None], self.keys_qo[seq_offset:seq_offset + B], inf).reshape(-1)  # (B*G*T,)
            def take_kv(i):  # flat index b*T + t -> rows (Hkv, n, D)
                b, t = i // T, i % T
                return {"k": k[b, :, t].transpose(0, 1), "v": v[b, :, t].transpose(0, 1)}

            def take_qo(i):  # flat index (b*G + g)*T + t; query head of KV head h is h*G + g
                b, g, t = i // (G * T), (i // T) % G, i % T
                return {"q": q.reshape(B, H, G, T, D)[b, :, g, t].transpose(0, 1),
                        "o": o.reshape(B, H, G, T, D)[b, :, g, t].transpose(0, 1)}

            self._reservoir("kv", ("k", "v"), kk, take_kv)
            self._reservoir("qo", ("q", "o"), kq, take_qo)

    def arrays(self) -> dict[str, np.ndarray]:
        """The block's values under their store names (numpy, CPU)."""
        spec = self.spec
        H, D, R = spec.num_kv_heads, spec.head_dim, spec.reservoir
        out: dict[str, np.ndarray] = {}
        n = int(self.kv_count)
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
        out["q_count"] = np.array(n * spec.group, dtype=np.int64)
        out["kv_count"] = np.array(n, dtype=np.int64)
        out["vw_gram"] = self.vw_gram.cpu().numpy()
        out["w_sum"] = self.w_sum.cpu().numpy()
        out["nonfinite"] = np.array(int(self.nonfinite), dtype=np.int64)
        out["res_count"] = np.array(self.res_key["kv"].numel(), dtype=np.int64)
        out["qo_res_count"] = np.array(self.res_key["qo"].numel(), dtype=np.int64)
        return out


@dataclass
class _BatchContext:
    capture: "Capture"
    eligible: torch.Tensor  # (B, T) bool
    seq_offset: int


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

    def record(self, layer, q, k, v, o, ctx: _BatchContext) -> None:
        if layer not in self.spec.layers:
            return
        if q.shape[2] != ctx.eligible.shape[1] or q.shape[0] != ctx.eligible.shape[0]:
            raise OscarError(f"capture: attention saw q {tuple(q.shape)} but the batch mask is "
                             f"{tuple(ctx.eligible.shape)} (KV cache on? calibration runs with use_cache=False)")
        acc = self.acc.get(layer)
        if acc is None:
            acc = self.acc[layer] = LayerAccumulator(self.spec, layer, self.block, q.device)
        eligible = ctx.eligible.to(q.device)
        acc.update(q.detach(), k.detach(), v.detach(), o.detach(), eligible, ctx.seq_offset)
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
