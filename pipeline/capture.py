"""Attention capture: a registered transformers attention function that records statistics.

`oscar_capture_<impl>` (e.g. `oscar_capture_sdpa`, `oscar_capture_eager`) wraps the
implementation `<impl>` and, while a `Capture` is active (`with cap.batch(mask, seq_offset)`),
feeds it the post-RoPE / post-q-norm q, k, v the model passes to its attention function and
the per-head output o = S V (the o_proj input). The matching mask function is registered
under the same name, so padding and causal masks are built exactly as for `<impl>`.

Nothing here assumes one process owns the whole model: a `Capture` accumulates only the
layers it was built for (a stage actor passes its layer range) and ignores the others, and
the function works for any subset of decoder layers that is run (it keys on `module.layer_idx`).

All accumulation is float64 and batched per layer and sequence (a C kernel over every head,
or matmuls and reductions over whole tensors): no Python loop over tokens or heads.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
from transformers.models.llama.modeling_llama import eager_attention_forward as llama_eager_attention

from oscar.common import OscarError
from oscar.native_build import CPU_ATTENTION
from oscar.pipeline import latent, native

PREFIX = "oscar_capture_"
XS = ("q", "k", "v", "o")
CHUNK_BYTES = 768 << 10    # torch path: float64 rows per chunk (x, x^3, x^4 stay in cache)

# The capture that the registered attention function feeds (None: plain pass-through).
_ACTIVE: contextvars.ContextVar["_BatchContext | None"] = contextvars.ContextVar("oscar_capture", default=None)


# --------------------------------------------------------------------------- registration

def _eager_for(module: torch.nn.Module) -> Callable:
    """The model's own eager attention function (each modeling file defines one)."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    return llama_eager_attention if fn is None else fn


def _make_capture_fn(impl: str) -> Callable:

    def oscar_capture_attention(module, query, key, value, attention_mask, **kwargs):
        indices = kwargs.pop("indices", None)  # GLM-5's DSA top-k, given to a custom attention function to apply
        if indices is not None:
            attention_mask = latent.dsa_mask(attention_mask, indices, query.dtype)
        if impl == "eager":
            inner = _eager_for(module)
        elif impl == "sdpa":  # the native CPU kernel where a caller registered it (native_attention), else SDPA itself
            inner = native_attention()
        else:
            inner = ALL_ATTENTION_FUNCTIONS[impl]
        out, weights = inner(module, query, key, value, attention_mask, **kwargs)  # out: (B, T, Hq, D)
        ctx = _ACTIVE.get()
        if ctx is not None:
            # attend(values): the same attention (scores, mask, DSA top-k) over other values: a latent capture's õ = S C
            attend = lambda v: inner(module, query, key, v, attention_mask, **kwargs)[0]  # noqa: E731
            ctx.capture.record(module.layer_idx, query, key, value, out, ctx, module=module, attend=attend,
                               mask=attention_mask, scale=kwargs.get("scaling"))
        return out, weights

    oscar_capture_attention.__name__ = f"{PREFIX}{impl}"
    return oscar_capture_attention


def native_attention() -> Callable:
    """The attention an `sdpa` capture runs: the CPU attention kernel registered under `CPU_ATTENTION`
    (kernels/cpu_attention.py `register()`: native where it applies, SDPA otherwise), else SDPA.

    Looked up at call time in transformers' registry, so the capture never imports kernels (later in the
    data flow): the callers that may (the `oscar` dispatcher, the main job, the Ray stage actors) register it."""

    if CPU_ATTENTION in ALL_ATTENTION_FUNCTIONS._global_mapping:
        return ALL_ATTENTION_FUNCTIONS[CPU_ATTENTION]
    return ALL_ATTENTION_FUNCTIONS["sdpa"]


def register(impl: str = "sdpa") -> str:
    """Register `oscar_capture_<impl>` (attention + mask function); return its name. Idempotent."""

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
    """Switch `model` to the capturing wrapper of `impl` (default: its current implementation); an MLA model's
    latents are hooked too (`hook_latents`)."""
    impl = impl or model.config._attn_implementation or "sdpa"
    name = register(impl)
    model.set_attn_implementation(name)
    hook_latents(model)
    return name


def _stash_latent(layer: int, c: torch.Tensor) -> None:
    ctx = _ACTIVE.get()
    if ctx is not None:
        ctx.latent[layer] = c.detach()


def hook_latents(root: torch.nn.Module) -> int:
    """Hand every MLA layer's latent (its kv_a_layernorm output) to the active capture (a model, or a stage's
    layer range); the number of MLA layers hooked."""
    return latent.hook_latents(root, _stash_latent)


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


_SCRATCH = threading.local()


def _scratch(numel: int, device: torch.device, use: str = "chunks") -> torch.Tensor:
    """A float64 work buffer of at least `numel` elements for `use`, shared by every layer of this thread."""
    bufs = _SCRATCH.__dict__.setdefault("bufs", {})
    b = bufs.get((device, use))
    if b is None or b.numel() < numel:
        b = bufs[(device, use)] = torch.empty(numel, dtype=torch.float64, device=device)
    return b[:numel]


def _rows(p: torch.Tensor, head: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """p[head, t] as float32 for p (heads, T, D) and broadcastable index tensors: (*idx, D).

    One index_select over p's rows seen as a flat (N, D) table (q/k/v are head-major, o is
    token-major: both are whole rows of D at strides that are multiples of D), instead of
    advanced indexing of a strided view.
    """
    s0, s1, s2 = p.stride()
    D = p.shape[2]
    if s2 != 1 or s0 % D or s1 % D:
        return p[head, t].float()
    n = ((p.shape[0] - 1) * s0 + (p.shape[1] - 1) * s1) // D + 1
    flat = p.as_strided((n, D), (D, 1))                                               # (N, D) rows of p's storage
    idx = head * (s0 // D) + t * (s1 // D)                                            # (*idx)
    return flat.index_select(0, idx.reshape(-1)).view(*idx.shape, D).float()


def _native_ok(src: list[torch.Tensor]) -> bool:
    """The C kernel takes CPU float32/float64 rows with contiguous channels (the usual case)."""
    p = src[0]
    return (p.device.type == "cpu" and p.dtype in (torch.float32, torch.float64) and p.shape[2] <= native.MAX_D
            and all(s.dtype == p.dtype and s.stride(2) == 1 for s in src) and native.chosen())


class LayerAccumulator:
    """float64 sums of one layer over one block (everything lives on the activations' device).

    Per sequence, its counted rows of q, k, v and o (heads: Hq query | Hkv key | Hkv value | Hq
    output) go through one of two implementations of the same sums:
      - CPU: the C kernel (pipeline/_moments.c via `native`), one call per sequence that reads each
        row once for every head's Gram and moments, adds them to the totals, adds the value target
        and chooses the sequence's reservoir candidates;
      - otherwise (GPU, no C compiler, NaN/Inf rows, non-contiguous positions): torch ops on
        cache-sized chunks gathered into one (Htot, c, D) float64 tensor, so that every statistic
        is one op for all heads at once.
    Sums run per sequence, so every sum is bit-identical whatever the batch size. At the end of
    the block heads are pooled into (x, KV head) slots (a GQA group's query/output heads share
    their KV head's slot).
    """

    def __init__(self, spec: CaptureSpec, layer: int, block: int, device: torch.device):
        H, D, G = spec.num_kv_heads, spec.head_dim, spec.group
        Hq = H * G
        z = lambda *s: torch.zeros(*s, dtype=torch.float64, device=device)  # noqa: E731
        self.spec, self.layer, self.block, self.device = spec, layer, block, device
        Htot = 2 * Hq + 2 * H
        self.gram = z(Htot, D, D)               # per head (q heads | k | v | o); pooled in arrays()
        self.mom = z(3, Htot, D)                # sum, sum x^3, sum x^4
        self.absmax2 = z(Htot, D)              # max x^2 (sqrt at the end: exact, and no |x| pass)
        self.vw_gram, self.w_sum = z(H, D, D), z(H)
        self.kv_count = self.nonfinite = 0
        # Rows per chunk: on CPU the chunk's float64 copy and its powers stay in cache (~768 KiB).
        self.htot = Htot
        self.chunk = max(8, CHUNK_BYTES // (Htot * D * 8)) if device.type == "cpu" else 1 << 14
        # Reservoir keys: one uniform per (sequence, token) for k/v and per (sequence, token, group
        # head) for q/o, drawn once per (seed, block, layer); the R smallest keys are kept.
        self._gen = torch.Generator().manual_seed(reservoir_seed(spec.seed, block, layer))
        self.keys_kv = self.keys_qo = None  # sized on the first batch (T known then)
        # Candidates per batch (at most R each); the R smallest keys of the block are picked in arrays().
        self.cand: dict[str, list] = {"kv": [], "qo": []}   # (keys (n,), rows (n, 2*Hkv, D) float32)
        self.res: "native.SequenceReservoir | None" = None  # the C kernel's candidates (made on its first call)

    def _keys(self, T: int) -> None:
        S, G = self.spec.seqs_per_block, self.spec.group
        self.keys_kv = torch.rand(S, T, generator=self._gen, dtype=torch.float64).to(self.device)     # (S, T)
        self.keys_qo = torch.rand(S, T, G, generator=self._gen, dtype=torch.float64).to(self.device)  # (S, T, G)

    def _candidates(self, kind: str, keys: torch.Tensor, take: Callable) -> None:
        """Keep the batch's R smallest keys (only those can end in the block's reservoir)."""
        R = self.spec.reservoir
        sel = torch.topk(keys, R, largest=False, sorted=False).indices if keys.numel() > R else None
        self.cand[kind].append((keys if sel is None else keys[sel], take(sel)))

    def update(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, rows: "_Rows") -> None:
        """q: (B, Hq, T, D); k, v: (B, Hkv, T, D); out: (B, T, Hq, D) (the attention output, o_proj input)."""
        T = q.shape[2]
        for b, sel in enumerate(rows.per_seq):  # a loop over the batch's sequences, not tokens
            if sel is not None:
                src = [q[b], k[b], v[b], out[b].transpose(0, 1)]                      # (heads, T, D) each
                self._sequence(src, sel, rows.seq_offset + b, T)

    def _sequence(self, src: list[torch.Tensor], sel: "slice | torch.Tensor", seq: int, T: int) -> None:
        """One sequence's counted positions `sel` (a slice or (n,) indices) of src = [q, k, v, o], each (heads, T, D)."""
        spec = self.spec
        H, G, D = spec.num_kv_heads, spec.group, spec.head_dim
        Hq = H * G
        if spec.reservoir > 0:
            if self.keys_kv is None:
                self._keys(T)
            elif self.keys_kv.shape[1] != T:
                raise OscarError(f"sequence length changed within block {self.block}")
        if isinstance(sel, slice) and _native_ok(src):
            if spec.reservoir > 0 and self.res is None:
                self.res = native.SequenceReservoir(self.keys_kv, self.keys_qo, spec.reservoir, H, D)
            if native.sequence(src, sel.start, sel.stop, G, self.gram, self.mom, self.absmax2, self.vw_gram, self.w_sum,
                               _scratch(native.sequence_scratch(self.htot, H, D), src[0].device, "sequence"),
                               None if self.res is None else (self.res, seq)):
                # one C call added every statistic and chose the reservoir's candidates: no torch op in between
                self.kv_count += sel.stop - sel.start
                return
        # torch ops: GPU, index selections, NaN/Inf rows (nothing was added), or no C compiler
        tok = torch.arange(sel.start, sel.stop, device=src[0].device) if isinstance(sel, slice) else sel   # (n,)
        gseq, sel, tok = self._torch_sums(src, sel, tok)
        n = tok.numel()
        self.gram += gseq
        if n == 0:
            return
        # Value target: w_t = k_t C_Q k_t^T with this sequence's own C_Q (docs/decisions/0015-capture-value-target-w-t-v-t-v-t-uses-the-c-q-of.md).
        cq = gseq[:Hq].view(H, G, D, D).sum(1) / (n * G)                              # (Hkv, D, D)
        pick = (lambda p: p[:, sel]) if isinstance(sel, slice) else (lambda p: p.index_select(1, tok))
        Kh, Vh = pick(src[1]).double(), pick(src[2]).double()                        # (Hkv, n, D) each
        wt = ((Kh @ cq) * Kh).sum(-1)                                                 # (Hkv, n)
        self.vw_gram += (Vh * wt[..., None]).mT @ Vh
        self.w_sum += wt.sum(1)
        self.kv_count += n
        if spec.reservoir > 0:
            self._reservoir(src, tok, seq)

    def _torch_sums(self, src: list[torch.Tensor], sel: "slice | torch.Tensor", tok: torch.Tensor):
        """Grams and moments with torch ops; rows with NaN/Inf are dropped (and counted).

        Rows go through in chunks of `self.chunk` so that the float64 copy and its powers stay in
        cache: a float64 pass over a whole 2048-token batch per statistic costs more than the MLP.
        Returns (this sequence's Grams (Htot, D, D), the kept rows as `sel` and as positions (n,)).
        """
        Htot, D = self.htot, self.spec.head_dim
        n_all, C = tok.numel(), self.chunk
        buf = _scratch(3 * Htot * C * D, self.device)
        gseq = torch.zeros(Htot, D, D, dtype=torch.float64, device=self.device)      # this sequence's Grams
        bad: list[torch.Tensor] = []                                                  # positions of dropped rows
        for c0 in range(0, n_all, C):
            c = min(C, n_all - c0)
            P = buf[: 3 * Htot * c * D].view(3, Htot, c, D)                          # powers x, x^3, x^4
            x = P[0]
            if isinstance(sel, slice):
                torch.cat([p[:, sel.start + c0: sel.start + c0 + c] for p in src], dim=0, out=x)  # (Htot, c, D) f64
            else:
                torch.cat([p.index_select(1, tok[c0:c0 + c]) for p in src], dim=0, out=x)
            x2 = torch.mul(x, x, out=P[2])                                            # x^2 (exact from fp32)
            sq_max = x2.amax(1)                                                       # (Htot, D)
            torch.mul(x2, x, out=P[1])                                                # x^3
            x2.mul_(x2)                                                               # x^4
            sums = P.sum(2)                                                           # (3, Htot, D): one reduction
            if not bool(torch.isfinite(sums).all()):  # NaN/Inf would poison every sum: redo without those rows
                fin = x.isfinite().all(2).all(0)                                      # (c,)
                bad.append(tok[c0:c0 + c][~fin])
                P = P[:, :, fin]
                x = P[0]
                if x.shape[1] == 0:
                    continue
                torch.mul(x, x, out=P[2])
                sq_max = P[2].amax(1)
                torch.mul(P[2], x, out=P[1])
                P[2].mul_(P[2])
                sums = P.sum(2)
            self.mom += sums
            torch.maximum(self.absmax2, sq_max, out=self.absmax2)
            gseq.baddbmm_(x.mT, x)                                                    # (Htot, D, D) += (D, c) @ (c, D)
        if bad:
            nb = torch.cat(bad)
            self.nonfinite += nb.numel()
            tok = sel = tok[~torch.isin(tok, nb)]
        return gseq, sel, tok

    def _reservoir(self, src: list[torch.Tensor], tok: torch.Tensor, seq: int) -> None:
        """Offer the sequence's rows at positions tok (as captured, float32) with their keys; keep the R smallest
        per kind (the torch ops' path: the C kernel's call chooses them itself)."""
        G, H = self.spec.group, self.spec.num_kv_heads
        q, k, v, o = src                                                              # (heads, T, D) each
        kk = self.keys_kv[seq, tok]                                                   # (n,)
        kq = self.keys_qo[seq, tok].reshape(-1)                                       # (n*G,) as (row, g)

        def take_kv(i):
            t = (tok if i is None else tok[i])[:, None]                               # (m, 1)
            h = torch.arange(H, device=t.device)                                      # (Hkv,)
            return torch.cat([_rows(k, h, t), _rows(v, h, t)], dim=1)                # (m, 2*Hkv, D) float32

        def take_qo(i):  # i = row*G + g -> q and o heads h*G + g of every KV head h
            if i is None:
                i = torch.arange(tok.numel() * G, device=tok.device)
            t = tok[i // G][:, None]                                                  # (m, 1)
            h = torch.arange(H, device=t.device) * G + (i % G)[:, None]               # (m, Hkv)
            return torch.cat([_rows(q, h, t), _rows(o, h, t)], dim=1)

        self._candidates("kv", kk, take_kv)
        self._candidates("qo", kq, take_qo)

    def arrays(self) -> dict[str, np.ndarray]:
        """The block's values under their store names (numpy, CPU)."""
        spec = self.spec
        H, D, R = spec.num_kv_heads, spec.head_dim, spec.reservoir
        G, Hq = spec.group, spec.num_q_heads

        def pool(t: torch.Tensor, dim: int, red) -> np.ndarray:
            """Per-head (..., Htot, ...) -> (4, ..., Hkv, ...): a GQA group's q/o heads reduced with `red`."""
            q, k, v, o = t.split([Hq, H, H, Hq], dim=dim)
            g = lambda x: red(x.unflatten(dim, (H, G)), dim + 1)  # noqa: E731
            return torch.stack([g(q), k, v, g(o)]).cpu().numpy()

        gram = pool(self.gram, 0, torch.sum)                                          # (4, Hkv, D, D)
        mom = pool(self.mom, 1, torch.sum).transpose(1, 0, 2, 3)                      # (3, 4, Hkv, D)
        amax = pool(self.absmax2.sqrt(), 0, torch.amax)                                       # (4, Hkv, D)
        res, counts = {}, {}
        for i, (kind, (x, y)) in enumerate((("kv", ("k", "v")), ("qo", ("q", "o")))):
            r = np.zeros((0, 2 * H, D), np.float32)
            cand = self.cand[kind] + ([] if self.res is None else self.res.candidates(i))
            if cand:
                keys = torch.cat([c[0] for c in cand])
                top = torch.topk(keys, min(R, keys.numel()), largest=False, sorted=True).indices
                r = torch.cat([c[1] for c in cand]).index_select(0, top).cpu().numpy()  # (n, 2*Hkv, D)
            counts[kind] = r.shape[0]
            for j, name in enumerate((x, y)):
                a = np.zeros((H, R, D), dtype=np.float32)
                a[:, : r.shape[0]] = r[:, j * H:(j + 1) * H].transpose(1, 0, 2)
                res[name] = a
        out: dict[str, np.ndarray] = {}
        for i, x in enumerate(XS):
            out[f"{x}_gram"] = gram[i]
            out[f"{x}_sum"] = mom[0, i]
            out[f"{x}_m3"] = mom[1, i]
            out[f"{x}_m4"] = mom[2, i]
            out[f"{x}_absmax"] = amax[i]
            out[f"{x}_res"] = res[x]
        out["q_count"] = np.array(self.kv_count * spec.group, dtype=np.int64)
        out["kv_count"] = np.array(self.kv_count, dtype=np.int64)
        out["vw_gram"] = self.vw_gram.cpu().numpy()
        out["w_sum"] = self.w_sum.cpu().numpy()
        out["nonfinite"] = np.array(self.nonfinite, dtype=np.int64)
        out["res_count"] = np.array(counts["kv"], dtype=np.int64)
        out["qo_res_count"] = np.array(counts["qo"], dtype=np.int64)
        return out


@dataclass
class _Rows:
    """The counted rows of one batch (shared by every layer)."""
    per_seq: list          # per sequence: slice of contiguous token positions, (n,) positions, or None
    seq_offset: int        # index of the batch's first sequence in its block


@dataclass
class _BatchContext:
    capture: "Capture"
    eligible: torch.Tensor  # (B, T) bool: real tokens at position >= sink
    seq_offset: int
    _rows: dict = field(default_factory=dict)
    latent: dict = field(default_factory=dict)  # layer -> (B, T, r) latent of an MLA layer (its kv_a_layernorm hook)

    def rows(self, device: torch.device) -> _Rows:
        r = self._rows.get(device)
        if r is None:
            per_seq = []
            for e in self.eligible.cpu():  # (T,) per sequence; padding and sinks leave one contiguous run
                idx = torch.nonzero(e).flatten()
                if not len(idx):
                    per_seq.append(None)
                elif int(idx[-1]) - int(idx[0]) + 1 == len(idx):
                    per_seq.append(slice(int(idx[0]), int(idx[-1]) + 1))
                else:
                    per_seq.append(idx.to(device))
            r = self._rows[device] = _Rows(per_seq, self.seq_offset)
        return r


class StopForward(BaseException):
    """Raised after the `stop_after` layer's attention was recorded: nothing later is needed.

    A BaseException so that no broad ``except Exception`` in a modeling file can swallow it.
    """


class Capture:
    """Accumulates one block at a time for the layers in `spec.layers`.

    cap.start_block(b)
    for each batch of the block's sequences:
        with cap.batch(mask, seq_offset):      # mask: (B, T) 1 = real token
            run decoder layers (any subset; layers not owned are ignored)
    arrays = cap.finish_block()                # {layer: {name: ndarray}}
    """

    def __init__(self, spec: CaptureSpec, stop_after: int | None = None):
        self.spec = spec
        self.stop_after = stop_after  # raise StopForward once this layer is recorded (the rest is dead compute)
        self.block: int | None = None
        self.acc: dict[int, LayerAccumulator] = {}
        self.calls: dict[int, int] = {}
        self.stats_s = 0.0  # wall time spent in the statistics (record + finish_block), all blocks

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

    def record(self, layer, q, k, v, out, ctx: _BatchContext, module=None, attend=None, **_) -> None:
        """q: (B, Hq, T, D), k/v: (B, Hkv, T, D) as passed to attention; out: (B, T, Hq, D) its output. A latent
        capture (`LatentSpec`) reads the layer's latent from `ctx`, its up-projections from `module` and õ through
        `attend`."""
        c = ctx.latent.pop(layer, None)  # (B, T, r): an MLA layer's latent, handed over by its hook
        if layer not in self.spec.layers:
            return
        if q.shape[2] != ctx.eligible.shape[1] or q.shape[0] != ctx.eligible.shape[0] or k.shape[2] != q.shape[2]:
            raise OscarError(f"capture: attention saw q {tuple(q.shape)}, k {tuple(k.shape)} but the batch mask is "
                             f"{tuple(ctx.eligible.shape)} (KV cache on? calibration runs with use_cache=False)")
        if ctx.seq_offset + q.shape[0] > self.spec.seqs_per_block:
            raise OscarError(f"batch rows {ctx.seq_offset}..{ctx.seq_offset + q.shape[0]} exceed "
                             f"seqs_per_block={self.spec.seqs_per_block}")
        t0 = time.perf_counter()
        acc = self.acc.get(layer)
        lat = isinstance(self.spec, latent.LatentSpec)
        if lat and (c is None or module is None or not latent.is_latent_attention(module)):
            raise OscarError(f"capture: layer {layer} gave no latent (a latent capture needs an MLA model whose "
                             "kv_a_layernorm is hooked: capture.install / hook_latents)")
        if acc is None:
            cls = latent.LatentAccumulator if lat else LayerAccumulator
            acc = self.acc[layer] = cls(self.spec, layer, self.block, q.device)
        if lat:
            acc.update(module, q.detach(), c, attend, ctx.rows(q.device))
        else:
            acc.update(q.detach(), k.detach(), v.detach(), out.detach(), ctx.rows(q.device))
        self.stats_s += time.perf_counter() - t0
        self.calls[layer] = self.calls.get(layer, 0) + 1
        if layer == self.stop_after:
            raise StopForward

    def finish_block(self, layers: tuple[int, ...] | None = None) -> dict[int, dict[str, np.ndarray]]:
        layers = self.spec.layers if layers is None else layers
        missing = [l for l in layers if l not in self.acc]
        if missing:
            raise OscarError(f"capture: block {self.block} never reached layers {missing} "
                             f"(is the model using attn_implementation '{PREFIX}*'?)")
        t0 = time.perf_counter()
        out = {l: self.acc[l].arrays() for l in layers}
        self.stats_s += time.perf_counter() - t0
        self.block, self.acc = None, {}
        return out


# --------------------------------------------------------------------------- raw rows

class RowCapture:
    """Keeps the q/k/v rows the attention function receives (post-RoPE, post q/k-norm), unreduced.

    The same registered attention function and `_ACTIVE` context as `Capture`, so validation reads
    exactly what calibration accumulates. One sequence per forward (no padding):

        cap = RowCapture(layers=(0, 10), q_every=64)
        with cap.batch(mask):                  # mask: (1, T)
            base(input_ids=ids, attention_mask=mask, use_cache=False)   # StopForward after max(layers)
        cap.k[l], cap.v[l]                     # lists of (Hkv, T, D) per sequence, captured dtype, CPU
        cap.q[l]                               # lists of (Hq, n, D): positions p with p % q_every == q_every - 1

    q is kept at every `q_every`-th position only (what the caller scores as queries): a whole
    128k-token capture of every query head would be several times the K/V memory.
    """

    def __init__(self, layers, q_every: int = 1):
        self.layers = tuple(sorted(int(l) for l in layers))
        self.q_every = int(q_every)
        self.stop_after = max(self.layers)
        self.k: dict[int, list[torch.Tensor]] = {l: [] for l in self.layers}
        self.v: dict[int, list[torch.Tensor]] = {l: [] for l in self.layers}
        self.q: dict[int, list[torch.Tensor]] = {l: [] for l in self.layers}

    @contextlib.contextmanager
    def batch(self, mask: torch.Tensor, seq_offset: int = 0) -> Iterator[None]:
        if mask.shape[0] != 1 or not bool(mask.bool().all()):
            raise OscarError(f"{type(self).__name__} takes one unpadded sequence per forward")
        token = _ACTIVE.set(_BatchContext(self, mask.bool(), int(seq_offset)))
        try:
            with torch.no_grad():
                yield
        except StopForward:
            pass
        finally:
            _ACTIVE.reset(token)

    def record(self, layer, q, k, v, out, ctx: _BatchContext, **_) -> None:
        """q: (1, Hq, T, D), k/v: (1, Hkv, T, D) as passed to attention."""
        if layer not in self.layers:
            return
        if k.shape[2] != ctx.eligible.shape[1]:
            raise OscarError(f"capture: attention saw k {tuple(k.shape)} for a {ctx.eligible.shape[1]}-token "
                             f"sequence (KV cache on? capture runs with use_cache=False)")
        e = self.q_every
        self.k[layer].append(k[0].detach().cpu().clone())                            # (Hkv, T, D)
        self.v[layer].append(v[0].detach().cpu().clone())
        self.q[layer].append(q[0, :, e - 1::e].detach().cpu().clone())                # (Hq, T // e, D)
        if layer == self.stop_after:
            raise StopForward


class LatentRowCapture:
    """Keeps what an MLA model's attention reads, per layer, unreduced (one unpadded sequence per forward): the
    queries (1, H, T, nope + rope) with RoPE applied, the latents (1, T, r), the RoPE keys (1, T, rope), the mask as
    the attention applies it (GLM-5's DSA top-k included) and the logit scale; `rows` lists them by layer. The same
    registered attention function and latent hooks as `Capture` (`install` the model first)."""

    def __init__(self):
        self.rows: list[dict] = []

    batch = RowCapture.batch  # one unpadded sequence per forward, as RowCapture reads it

    def record(self, layer, q, k, v, out, ctx: _BatchContext, module=None, mask=None, scale=None, **_) -> None:
        c = ctx.latent.pop(layer, None)
        if c is None or module is None or not latent.is_latent_attention(module):
            raise OscarError(f"capture: layer {layer} gave no latent (LatentRowCapture reads MLA models)")
        nope = module.qk_nope_head_dim
        self.rows.append({"layer": int(layer), "q": q.detach().cpu(), "c": c.cpu(),
                          "k_pe": k[:, 0, :, nope:].detach().cpu(), "mask": None if mask is None else mask.cpu(),
                          "scale": float(scale), "module": module})
