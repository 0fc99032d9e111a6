"""The paged mixed-precision KV cache: layout, page pool, sequences, prefix sharing.

Per layer (one `PagedLayerCache` per attention layer; `PagedKVCache` groups them):

    sink      (max_seqs, Hkv, S, D)        cfg.dtype  first S tokens, never quantized
    ring      (max_seqs, Hkv, R + P, D)    cfg.dtype  recent window (ring buffer)
    k_codes   (num_pages, Hkv, P, D*bits/8) uint8     packed INT2 history, 4 codes per byte
              (num_pages, Hkv, P, D*bits/8 + W/8)     split keys (quant.key_split = W): the low 2 bits of every
                                                      channel, then the top bit of the W wide ones (pack_planes)
              (num_pages, Hkv, P, S*bits/8 + T*W/8)   tiers (quant.key_top = T, key_drop): the low plane of the
                                                      S = D - key_drop stored channels, then T top-bit planes
    v_codes   (num_pages, Hkv, P, D*bits/8) uint8
    k_scale, k_zero   fp16 (cfg.quant.torch_param_dtype: float8_e4m3fn for 8-bit params, float32 for the published format), by mode:
        minmax / token axis : (num_pages, Hkv, P, D // G)   one pair per token and channel group
        split keys          : (num_pages, Hkv, P, 2)        one pair per token and key part (wide, narrow)
        minmax / channel    : (num_pages, Hkv, D)           KIVI: one pair per channel per page
        static              : (Hkv, D)                      layer constants from the artifact clips
    v_scale, v_zero   as keys with the token axis (never channel)

Everything stored is in the *rotated* space: ``k_rot = (k - mu) @ R_K``,
``v_rot = v @ R_V`` (row vectors, see docs/artifact-format.md), rounded to ``cfg.dtype`` on
arrival. Pages are quantized from those stored values, so the layout and the
codes are a pure function of the token stream: prefilling 1000 tokens at once
or in 10 chunks or one by one gives bit-identical caches.

Layout of a sequence of n tokens (`layout(n, cfg)`): tokens [0, S) live in the
sink; of the m = n - S later tokens, the oldest ``P * floor((m - R) / P)`` (when
m >= R) are in full pages, the rest (between R and R + P - 1 tokens once the
window has filled) in the ring. Token t >= S lives at ring slot (t - S) % (R + P)
while it is recent and in page (t - S - ...) // P of the block table once it
leaves. Pages are written whole and never modified afterwards, which makes
prefix sharing trivial: `fork` copies the block table and bumps refcounts, no
copy-on-write is ever needed.

The byte layout, rounding rule and policies are documented in docs/cache-format.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, NamedTuple

import torch
from transformers.cache_utils import DynamicLayer

from oscar.common import OscarError
from oscar.constraints import quant_problems
from oscar.quant import FP8_MAX, FP8_PARAM, QuantSpec, choose_qparams
from oscar.kernels.rotation import LayerRotation
from oscar.stats.artifact import LAYER_QUANT_FIELDS, Artifact, QuantConfig, layout_differences


# writes whole rotated pages k, v (N, Hkv, P, D) (cfg.dtype) of a layer into its pool at page ids (N,)
PageQuantizer = Callable[["PagedLayerCache", torch.Tensor, torch.Tensor, torch.Tensor], None]


class PoolExhausted(OscarError):
    """Raised when an append needs more free pages than the pool has (nothing was written)."""


class ParamRangeError(OscarError):
    """Raised when a page to quantize has values that 8-bit (e4m3) scale/zero cannot hold (nothing was written)."""


@dataclass
class PagedConfig:
    """Shape and format of one layer's paged cache (all layers of a model share it).

    `quant` is the format, the artifact's `QuantConfig` as is (bits, grouping, mode, sink S, recent R,
    page size P, clip rule, scale/zero dtype): mode="minmax" stores scale+zero per token and channel
    group (per channel and page for key_axis="channel"); mode="static" stores no per-token metadata
    (grid [-c, c] with c the artifact's clip thresholds, exactly `bits` bits per element). The rest
    are pool sizes and storage. Nothing of `quant` is copied here: the quantizers are
    `quant.key_spec` / `quant.value_spec`, the one derivation fit and validation use too. A 16-bit
    pass-through cache is ``recent >= max context``: no token ever leaves the ring
    (see `PagedConfig.passthrough`).
    """

    quant: QuantConfig
    num_kv_heads: int
    head_dim: int
    num_pages: int  # pool size (pages per layer)
    max_seqs: int = 8  # sequence slots (rows of sink / ring / block table)
    dtype: torch.dtype = torch.bfloat16  # sink / ring storage
    device: str | torch.device = "cpu"
    max_pages_per_seq: int | None = None  # block table width; None = num_pages
    # derived
    ring_size: int = field(init=False)  # R + P slots per sequence
    packed_dim: int = field(init=False)  # D * bits // 8 bytes per token row (values; keys unless split)
    k_low_dim: int = field(init=False)  # bytes of the keys' low `bits` plane: (D - key_drop) * bits // 8
    k_packed_dim: int = field(init=False)  # key bytes per token row: + key_top * key_split // 8 top bits for split keys

    def __post_init__(self):
        q, D = self.quant, self.head_dim
        if not isinstance(q, QuantConfig):
            raise OscarError(f"PagedConfig.quant must be a QuantConfig, got {type(q).__name__}")
        P = q.page_size
        if P < 1 or q.recent < 0 or q.sink < 0:
            raise ValueError(f"page_size must be >= 1 and sink/recent >= 0 (got P={P}, S={q.sink}, R={q.recent})")
        if q.recent % P:
            raise ValueError(f"recent window ({q.recent}) must be a multiple of page_size ({P})")
        if (D * q.bits) % 8:
            raise ValueError(f"head_dim {D} * bits {q.bits} is not a whole number of bytes")
        if q.mode == "static" and q.key_axis == "channel":
            raise ValueError("mode='static' has no per-channel page metadata; use key_axis='token'")
        if q.value_axis != "token":
            raise OscarError(f"value_axis={q.value_axis!r} is not a cache format (values are per token)")
        if q.key_axis == "channel" and q.group_size and q.group_size != P:
            # QuantConfig.key_spec groups channel keys over `group_size or page_size` tokens; the cache's
            # token group is the page, so the two must agree for the fitted clips to mean the same thing
            raise OscarError(f"key_axis='channel' groups keys over group_size={q.group_size} tokens but pages hold "
                             f"{P}: the cache groups per page, set page_size = group_size")
        self.value_spec.group(D)  # raises if group_size does not divide head_dim
        if q.key_split:
            probs = [p for p in quant_problems(D, q) if "key_split" in p or "key_drop" in p]
            if probs:
                raise OscarError("; ".join(probs))
        self.ring_size = q.recent + P
        self.packed_dim = D * q.bits // 8
        self.k_low_dim = (D - q.key_drop) * q.bits // 8  # the low plane: every stored key channel
        self.k_packed_dim = self.k_low_dim + q.key_top * q.key_split // 8 if q.key_split else self.packed_dim
        self.max_pages_per_seq = self.max_pages_per_seq or self.num_pages

    @classmethod
    def passthrough(cls, num_kv_heads: int, head_dim: int, max_len: int, quant: QuantConfig | None = None,
                    **kw) -> "PagedConfig":
        """No quantization at all: every token stays in `dtype` (the ring holds max_len tokens).

        quant: the format whose page size (and sink, default 0 here) the ring is counted in."""
        quant = quant or QuantConfig(sink=0)
        P = quant.page_size
        return cls(replace(quant, recent=-(-max_len // P) * P), num_kv_heads, head_dim, kw.pop("num_pages", 1), **kw)

    @property
    def key_spec(self) -> QuantSpec:
        return self.quant.key_spec(self.head_dim)

    @property
    def value_spec(self) -> QuantSpec:
        return self.quant.value_spec(self.head_dim)

    @property
    def key_parts(self) -> list[tuple[int, int, QuantSpec]] | None:
        """Split keys: [(0, W, wide spec), (W, D - key_drop, spec)] (QuantConfig.key_parts); None otherwise."""
        return self.quant.key_parts(self.head_dim)

    @property
    def groups(self) -> int:
        """Channel groups per token (token-axis minmax)."""
        return self.head_dim // (self.quant.group_size or self.head_dim)


def layer_config(cfg: PagedConfig, quant: QuantConfig) -> PagedConfig:
    """Layer l's config: the model's layout and pool sizes with the layer's own format (same sink, window, page)."""
    bad = layout_differences(cfg.quant, quant)
    if bad:
        raise OscarError(f"a layer's format differs from the model's layout in {', '.join(bad)}: layers share sink, "
                         f"window, pages and grid kind; only {', '.join(LAYER_QUANT_FIELDS)} may differ")
    return replace(cfg, quant=quant)


class DecodeBatch(NamedTuple):
    block_table: torch.Tensor  # (max_seqs, max_pages_per_seq) int32, row = sequence slot
    seq_lens: torch.Tensor  # (B,) int32
    slots: torch.Tensor  # (B,) int32 sequence slot of each batch row
    max_pages: int  # longest page list in the batch (sizes the split-K grid)


class Layout(NamedTuple):
    sink_len: int  # tokens in the sink
    num_pages: int  # full pages in the block table
    ring_len: int  # tokens in the ring
    ring_start: int  # ring slot of the oldest ring token


def layout(n: int, cfg: PagedConfig) -> Layout:
    """Where the n tokens of a sequence live (a pure function of n; kernels compute it too)."""
    S, R, P, C = cfg.quant.sink, cfg.quant.recent, cfg.quant.page_size, cfg.ring_size
    m = max(n - S, 0)
    pages = (m - R) // P if m >= R else 0
    q = pages * P
    return Layout(min(n, S), pages, m - q, q % C)


def _clip_layout(clip: torch.Tensor, cfg: PagedConfig, axis: str) -> torch.Tensor:
    """Broadcast an artifact clip onto the qparams layout of pages (N, Hkv, ...)."""
    H, D = cfg.num_kv_heads, cfg.head_dim
    if cfg.quant.mode == "static":  # absolute thresholds -> (Hkv, 1, D) for a group of one channel
        c = clip.float().reshape(H, -1)
        if c.shape[1] not in (1, D):
            raise OscarError(f"static clip has shape {tuple(clip.shape)}, expected ({H},) or ({H}, {D})")
        if not bool((c > 0).all()):
            raise OscarError("static mode needs positive clip thresholds (got a value <= 0)")
        return c.expand(H, D).reshape(H, 1, D)
    parts = len(cfg.key_parts) if axis == "k" and cfg.quant.key_split else 0
    if parts == 1 and tuple(clip.shape) == (H,):  # keys of one wide part (key_split = stored channels): a ratio per head
        clip = clip.reshape(H, 1)
    split = parts > 0
    if split and tuple(clip.shape) != (H, parts):
        raise OscarError(f"split keys need one clip ratio per KV head and key part ({H}, {parts}), got shape {tuple(clip.shape)}")
    if not split and (clip.dim() != 1 or clip.shape[0] != H):
        raise OscarError(f"minmax mode needs one clip ratio per KV head, got shape {tuple(clip.shape)}")
    if not bool(((clip > 0) & (clip <= 1)).all()):
        raise OscarError("minmax clip ratios must lie in (0, 1]")
    if split:
        return clip.float().reshape(1, H, 1, parts)  # part j: [..., j:j + 1] over (N, Hkv, P, 1)
    return clip.float().reshape(1, H, 1, 1)  # over (N, Hkv, P, groups) or (N, Hkv, D, 1)


@dataclass
class QuantParams:
    """What the quantizer needs for one layer: specs, clips laid out, static scale/zero."""

    k_spec: QuantSpec
    v_spec: QuantSpec
    clip_k: torch.Tensor  # (1, Hkv, 1, 1) ratio or (Hkv, 1, D) threshold
    clip_v: torch.Tensor
    k_static: tuple[torch.Tensor, torch.Tensor] | None  # (scale, zero) each (Hkv, D) fp16, static mode
    v_static: tuple[torch.Tensor, torch.Tensor] | None

    @classmethod
    def build(cls, cfg: PagedConfig, rot: LayerRotation) -> "QuantParams":
        ck, cv = _clip_layout(rot.clip_k, cfg, "k"), _clip_layout(rot.clip_v, cfg, "v")
        ks = vs = None
        if cfg.quant.mode == "static":
            probe = torch.zeros(cfg.num_kv_heads, 1, cfg.head_dim, device=ck.device)
            s, z = choose_qparams(probe, cfg.key_spec, ck)  # (Hkv, 1, D)
            ks = (s[:, 0].contiguous(), z[:, 0].contiguous())
            s, z = choose_qparams(probe, cfg.value_spec, cv)
            vs = (s[:, 0].contiguous(), z[:, 0].contiguous())
        return cls(cfg.key_spec, cfg.value_spec, ck, cv, ks, vs)


class PagedLayerCache:
    """One layer's page pool, sink/ring buffers, block tables and refcounts.

    Sequences are integer slots in [0, cfg.max_seqs): `new_sequence()`, `fork(src)`,
    `free(seq)`. `append(seq, k, v)` takes post-RoPE k, v (Hkv, T, D) in the model
    space; rotation and rounding to cfg.dtype happen here, page quantization in the
    `quantizer` the pool is handed (`oscar.kernels.dispatch.quantize_pages`: the backend
    chosen per call; `oscar.kernels.reference.quantize_pages`: the definition).
    Decode attention over this layer: `oscar.kernels.dispatch.decode_attention`.
    """

    def __init__(self, cfg: PagedConfig, rot: LayerRotation | None = None, *, quantizer: PageQuantizer):
        self.cfg = cfg
        self.quantizer = quantizer
        dev = torch.device(cfg.device)
        H, D, P, N = cfg.num_kv_heads, cfg.head_dim, cfg.quant.page_size, cfg.num_pages
        rot = rot or LayerRotation.identity_for(H, D, device=dev)
        if tuple(rot.rot_k.shape) != (H, D, D) or tuple(rot.rot_v.shape) != (H, D, D):
            raise OscarError(f"rotation shape {tuple(rot.rot_k.shape)} does not match the cache ({H}, {D}, {D})")
        if rot.rot_k.device.type != dev.type:
            raise OscarError(f"rotation is on {rot.rot_k.device}, cache on {dev}")
        self.rot = rot
        self.qp = QuantParams.build(cfg, rot)
        z8 = lambda *s: torch.zeros(*s, dtype=torch.uint8, device=dev)  # noqa: E731
        zk = lambda *s: torch.zeros(*s, dtype=cfg.quant.torch_key_param_dtype, device=dev)  # noqa: E731  scale/zero storage
        zv = lambda *s: torch.zeros(*s, dtype=cfg.quant.torch_param_dtype, device=dev)  # noqa: E731
        self.k_codes, self.v_codes = z8(N, H, P, cfg.k_packed_dim), z8(N, H, P, cfg.packed_dim)
        if cfg.quant.mode == "static":
            self.k_scale, self.k_zero = self.qp.k_static
            self.v_scale, self.v_zero = self.qp.v_static
        else:
            kshape = (N, H, D) if cfg.quant.key_axis == "channel" else (N, H, P, len(cfg.key_parts) if cfg.quant.key_split else cfg.groups)
            self.k_scale, self.k_zero = zk(*kshape), zk(*kshape)
            self.v_scale, self.v_zero = zv(N, H, P, cfg.groups), zv(N, H, P, cfg.groups)
        fz = lambda *s: torch.zeros(*s, dtype=cfg.dtype, device=dev)  # noqa: E731
        self.sink_k, self.sink_v = fz(cfg.max_seqs, H, cfg.quant.sink, D), fz(cfg.max_seqs, H, cfg.quant.sink, D)
        self.ring_k, self.ring_v = fz(cfg.max_seqs, H, cfg.ring_size, D), fz(cfg.max_seqs, H, cfg.ring_size, D)
        # host-side bookkeeping (python ints: cheap, and never synchronises the device)
        self.refcount = [0] * N
        self.free_pages = list(range(N - 1, -1, -1))  # pop() hands out page 0 first
        self.pages: list[list[int] | None] = [None] * cfg.max_seqs  # None = free slot
        self.lengths = [0] * cfg.max_seqs
        # the same page lists on the device, one row per sequence slot (what kernels read)
        self.block_table = torch.zeros(cfg.max_seqs, cfg.max_pages_per_seq, dtype=torch.int32, device=dev)

    # ---------------------------------------------------------------- sequences
    def new_sequence(self, seq: int | None = None) -> int:
        """Claim a free sequence slot (or the given one) with length 0."""
        if seq is None:
            free = [i for i, p in enumerate(self.pages) if p is None]
            if not free:
                raise OscarError(f"all {self.cfg.max_seqs} sequence slots are in use; free one or raise max_seqs")
            seq = free[0]
        self._check_slot(seq, active=False)
        self.pages[seq], self.lengths[seq] = [], 0
        return seq

    def fork(self, src: int, dst: int | None = None) -> int:
        """A new sequence with src's full content: pages shared (refcount +1), sink/ring copied."""
        self._check_slot(src, active=True)
        dst = self.new_sequence(dst)
        for p in self.pages[src]:
            self.refcount[p] += 1
        self.pages[dst] = list(self.pages[src])
        self.lengths[dst] = self.lengths[src]
        self.block_table[dst].copy_(self.block_table[src])
        for buf in (self.sink_k, self.sink_v, self.ring_k, self.ring_v):
            buf[dst].copy_(buf[src])
        return dst

    def free(self, seq: int) -> None:
        """Release a sequence; pages whose refcount drops to 0 return to the pool."""
        self._check_slot(seq, active=True)
        for p in self.pages[seq]:
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self.free_pages.append(p)
        self.pages[seq], self.lengths[seq] = None, 0

    def length(self, seq: int) -> int:
        return self.lengths[seq]

    def _check_slot(self, seq: int, active: bool) -> None:
        if not 0 <= seq < self.cfg.max_seqs:
            raise OscarError(f"sequence id {seq} outside [0, {self.cfg.max_seqs})")
        if (self.pages[seq] is not None) != active:
            raise OscarError(f"sequence {seq} is {'not ' if active else ''}active")

    # ---------------------------------------------------------------- appending
    def append(self, seq: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append T tokens (k, v: (Hkv, T, D), model space) to one sequence.

        Checks everything (shapes, dtype, device, free pages) before writing, so a
        refused append leaves every sequence, this one included, unchanged.
        """
        self._check_slot(seq, active=True)
        self._check_kv(k, v, batched=False)
        self.append_batch([seq], k.unsqueeze(0), v.unsqueeze(0))

    def append_batch(self, seqs: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Append T tokens to each of B sequences (k, v: (B, Hkv, T, D)); all-or-nothing."""
        cfg = self.cfg
        self._check_kv(k, v, batched=True)
        if len(seqs) != k.shape[0] or len(set(seqs)) != len(seqs):
            raise OscarError(f"append_batch: {len(seqs)} distinct sequence ids needed for a batch of {k.shape[0]}")
        for s in seqs:
            self._check_slot(s, active=True)
        T = k.shape[2]
        plans = [(s, self.lengths[s], layout(self.lengths[s], cfg), layout(self.lengths[s] + T, cfg)) for s in seqs]
        need = sum(l1.num_pages - l0.num_pages for _, _, l0, l1 in plans)
        if need > len(self.free_pages):
            raise PoolExhausted(
                f"page pool exhausted: this append needs {need} new pages of {cfg.quant.page_size} tokens, "
                f"{len(self.free_pages)} of {cfg.num_pages} are free; nothing was written "
                f"(free sequences or build the cache with more pages)")
        for s, _, _, l1 in plans:
            if l1.num_pages > cfg.max_pages_per_seq:
                raise PoolExhausted(f"page pool exhausted for sequence {s}: it would need {l1.num_pages} pages, "
                                    f"more than max_pages_per_seq={cfg.max_pages_per_seq}; nothing was written")
        kr = self.rot.rotate_k(k).to(cfg.dtype)  # (B, Hkv, T, D) rotated, rounded to storage dtype
        vr = self.rot.rotate_v(v).to(cfg.dtype)
        S, P, C = cfg.quant.sink, cfg.quant.page_size, cfg.ring_size
        # the tokens [a, e) that leave the window (a whole number of pages) of each sequence, gathered
        # before anything is written so a refused append (fp8 range) changes nothing
        leaving = {}
        for b, (s, n0, l0, l1) in enumerate(plans):
            if l1.num_pages > l0.num_pages:
                a, e = S + l0.num_pages * P, S + l1.num_pages * P
                t = torch.arange(a, e, device=k.device)
                old = t < n0
                tk = torch.empty(cfg.num_kv_heads, e - a, cfg.head_dim, dtype=cfg.dtype, device=k.device)
                tv = torch.empty_like(tk)
                slots = (t[old] - S) % C
                tk[:, old], tv[:, old] = self.ring_k[s][:, slots], self.ring_v[s][:, slots]
                tk[:, ~old], tv[:, ~old] = kr[b][:, t[~old] - n0], vr[b][:, t[~old] - n0]
                leaving[b] = (tk, tv)
        fp8 = [i for i, d in enumerate((cfg.quant.torch_key_param_dtype, cfg.quant.torch_param_dtype)) if d == FP8_PARAM]
        if leaving and fp8 and cfg.quant.mode == "minmax":
            self._check_fp8_range(leaving, fp8)
        new_pages, page_k, page_v = [], [], []
        for b, (s, n0, l0, l1) in enumerate(plans):
            n1 = n0 + T
            if n0 < S:  # sink
                e = min(S, n1)
                self.sink_k[s, :, n0:e] = kr[b, :, : e - n0]
                self.sink_v[s, :, n0:e] = vr[b, :, : e - n0]
            if b in leaving:
                tk, tv = leaving[b]
                npg = l1.num_pages - l0.num_pages
                ids = [self.free_pages.pop() for _ in range(npg)]
                for p in ids:
                    self.refcount[p] = 1
                self.pages[s].extend(ids)
                self.block_table[s, l0.num_pages:l1.num_pages] = torch.tensor(ids, dtype=torch.int32).to(k.device)
                new_pages += ids
                page_k.append(tk.reshape(cfg.num_kv_heads, npg, P, cfg.head_dim).transpose(0, 1))
                page_v.append(tv.reshape(cfg.num_kv_heads, npg, P, cfg.head_dim).transpose(0, 1))
            a = max(n0, S + l1.num_pages * P)  # tokens that end in the ring
            if n1 > a:
                slots = (torch.arange(a, n1, device=k.device) - S) % C
                self.ring_k[s][:, slots] = kr[b, :, a - n0:]
                self.ring_v[s][:, slots] = vr[b, :, a - n0:]
            self.lengths[s] = n1
        if new_pages:
            ids = torch.tensor(new_pages, device=k.device, dtype=torch.int64)
            self.quantizer(self, ids, torch.cat(page_k), torch.cat(page_v))

    def _check_fp8_range(self, leaving: dict, sides: list[int]) -> None:
        """8-bit scale/zero (e4m3, finite range +-448) need every value entering a page within +-448.

        Checked once per page flush (a device sync every page_size decode steps, fp8 pools only), on the
        sides (0 keys, 1 values) whose parameters are e4m3."""
        for name, i in (("keys", 0), ("values", 1)):
            if i not in sides:
                continue
            m = torch.stack([torch.nan_to_num(x[i].float().abs(), nan=float("inf")).amax() for x in leaving.values()])
            worst = float(m.max())
            if not worst <= FP8_MAX:
                raise ParamRangeError(
                    f"rotated {name} entering INT2 pages reach |x| = {worst:.4g}, beyond what 8-bit (e4m3) scale/zero "
                    f"can hold (+-{FP8_MAX:g}); nothing was written. Use param_dtype float16 for this model "
                    f"(docs/decisions/0038-8-bit-scale-zero-param-dtype-float8-e4m3fn-the.md: 8-bit scale/zero range)")

    def _check_kv(self, k: torch.Tensor, v: torch.Tensor, batched: bool) -> None:
        cfg = self.cfg
        want = (cfg.num_kv_heads, cfg.head_dim)
        nd = 4 if batched else 3
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor) or x.dim() != nd or (x.shape[-3], x.shape[-1]) != want:
                raise OscarError(f"{name} must be {'(B, ' if batched else '('}Hkv={want[0]}, T, D={want[1]}), "
                                 f"got {tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
            if not x.is_floating_point():
                raise OscarError(f"{name} must be a floating tensor, got {x.dtype}")
            if x.device.type != torch.device(cfg.device).type:
                raise OscarError(f"{name} is on {x.device}, the cache is on {cfg.device}")
        if k.shape != v.shape:
            raise OscarError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")

    # ---------------------------------------------------------------- kernel views
    def batch_tables(self, seqs: list[int]) -> "DecodeBatch":
        """What the decode kernels need for a batch of sequences (the block table is not copied)."""
        for s in seqs:
            self._check_slot(s, active=True)
        dev = self.block_table.device
        return DecodeBatch(
            block_table=self.block_table,
            seq_lens=torch.tensor([self.lengths[s] for s in seqs], dtype=torch.int32).to(dev),
            slots=torch.tensor(seqs, dtype=torch.int32).to(dev),
            max_pages=max([len(self.pages[s]) for s in seqs] + [0]),
        )

    def bytes_used(self) -> dict[str, int]:
        """Bytes allocated by component (the whole pool, not only pages in use)."""
        t = lambda *xs: sum(x.numel() * x.element_size() for x in xs)  # noqa: E731
        return {
            "codes": t(self.k_codes, self.v_codes),
            "scales": t(self.k_scale, self.k_zero, self.v_scale, self.v_zero),
            "sink": t(self.sink_k, self.sink_v),
            "recent": t(self.ring_k, self.ring_v),
        }


class PagedKVCache:
    """All layers of a model: one `PagedLayerCache` each, sequence ops applied to every layer.

    `cfg` is the model's layout (sink, window, page, pool sizes) and the format of every layer unless
    `layer_quant` gives layer l its own (`Artifact.layer_quant`: wider keys in some layers); `layer_configs[l]`
    is what layer l stores. Layers share the layout, so a sequence has the same pages in every layer.

    `held`: the layers this pool holds (a pipeline stage's own range; None: every layer). Only they get pages and
    buffers (`layers` lists them in order); `pool[l]` of another layer is refused. `rotations[l]` and
    `layer_quant[l]` are indexed by the model's layer, those of layers outside `held` unused (None allowed)."""

    def __init__(self, cfg: PagedConfig, rotations: list[LayerRotation | None], *, quantizer: PageQuantizer,
                 layer_quant: list[QuantConfig] | None = None, held: range | None = None):
        self.cfg = cfg
        L = len(rotations)
        if layer_quant is not None and len(layer_quant) != L:
            raise OscarError(f"layer_quant has {len(layer_quant)} formats for {L} layers")
        self.held = check_held(held, L)
        self.layer_configs = [layer_config(cfg, q) for q in layer_quant] if layer_quant is not None else [cfg] * L
        self.layers = [PagedLayerCache(self.layer_configs[l], rotations[l], quantizer=quantizer) for l in self.held]

    @classmethod
    def from_artifact(cls, art: Artifact, num_pages: int, *, quantizer: PageQuantizer, max_seqs: int = 8,
                      dtype=torch.bfloat16, device="cpu", held: range | None = None, **overrides) -> "PagedKVCache":
        """The artifact's format (its QuantConfig, fields replaced by `overrides`) with pool sizes from the caller;
        `held`: the layers it holds (None: all)."""
        art.validate()
        cfg = PagedConfig(replace(art.quant, **overrides), art.num_kv_heads, art.head_dim, num_pages,
                          max_seqs=max_seqs, dtype=dtype, device=device)
        lq = None if art.layer_quant is None else [replace(q, **overrides) for q in art.layer_quant]
        return cls(cfg, held_rotations(art, device, held), quantizer=quantizer, layer_quant=lq, held=held)

    def new_sequence(self, seq: int | None = None) -> int:
        seq = self.layers[0].new_sequence(seq)
        for layer in self.layers[1:]:
            layer.new_sequence(seq)
        return seq

    def fork(self, src: int, dst: int | None = None) -> int:
        dst = self.layers[0].fork(src, dst)
        for layer in self.layers[1:]:
            layer.fork(src, dst)
        return dst

    def free(self, seq: int) -> None:
        for layer in self.layers:
            layer.free(seq)

    def __getitem__(self, layer: int) -> PagedLayerCache:
        if layer not in self.held:
            raise OscarError(f"layer {layer} is not held by this cache (it holds layers {self.held.start}.."
                             f"{self.held.stop - 1}: a pipeline stage's own)")
        return self.layers[layer - self.held.start]

    def __len__(self) -> int:
        return len(self.layers)


def check_held(held: range | None, num_layers: int) -> range:
    """The layers a cache holds: `held` (a pipeline stage's contiguous range, step 1) or all `num_layers`."""
    held = range(num_layers) if held is None else held
    if not isinstance(held, range) or not held or held.step != 1 or held.start < 0 or held.stop > num_layers:
        raise OscarError(f"held layers {held} are not a non-empty range within the model's {num_layers} layers")
    return held


class Elsewhere(DynamicLayer):
    """A layer another pipeline stage holds: reading or writing it here is a bug, never an empty cache."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def update(self, *args, **kwargs):
        raise OscarError(f"layer {self.index} is held by another pipeline stage")


def held_rotations(art: Artifact, device, held: range | None) -> list[LayerRotation | None]:
    """Each layer's rotation from the artifact, on `device`, for the layers in `held` (None: all); None elsewhere."""
    held = check_held(held, art.num_layers)
    return [LayerRotation.from_artifact(art, l, device) if l in held else None for l in range(art.num_layers)]
