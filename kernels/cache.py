"""OscarCache: the paged INT2 KV cache as a transformers `Cache` (the serving cache).

    cache = OscarCache.from_artifact(model, "artifact.safetensors")
    out = model.generate(ids, cache=cache, max_new_tokens=32)

`from_artifact` checks the artifact against the model, registers the ``"oscar"``
attention function *and* its mask function (kernels/cache_attention.py: a custom attention name without a
registered mask function silently gets no padding mask in transformers 5.x) and
switches the model to it. For a cache that is not an OscarCache the function
falls back to transformers' SDPA, so the same model still runs with DynamicCache.

How it works. Each layer's `update` appends the new post-RoPE k, v to kern's
paged pool (`oscar.kernels.paged.PagedKVCache`: sink and recent window in the
model dtype, history rotated + INT2 in pages) and returns the new k tagged with
the layer; the attention function finds the layer through that tag and attends:

- decode (one query token, no padding): the fused decode path through the
  dispatcher (Triton on CUDA, torch reference on CPU);
- prefill chunks: a torch path with *decode semantics*: query position p sees
  exactly the cache a decode step at p would see, i.e. key j is dequantized INT2
  iff it lies in the pages of ``layout(p + 1)``, the stored 16-bit value
  otherwise. Hence chunked prefill == one-shot prefill == token-by-token decode
  (up to float summation order) and a later chunk (the question of a needle test)
  attends to the already-quantized history (the haystack).
- format="passthrough": nothing is quantized (every token stays in the ring);
  attention is transformers' SDPA on the un-rotated cache, so with identity
  rotations generation matches DynamicCache token for token.

OscarCache is the product's member of one cache family; kernels/backends.py `make_cache(spec, backend)` builds any
member (this cache, or the simulators of the same format, which this module never imports). `prefill` and
`generate` (which never loses work) are kernels/generation.py's.
"""

from __future__ import annotations

import warnings
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, Literal

import torch
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from oscar.common import OscarError, attention_shapes
from oscar.constraints import check_model
from oscar.kernels import dispatch
from oscar.kernels.cache_attention import ATTN_NAME, register_attention
from oscar.kernels.generation import CacheRoom
from oscar.kernels.memory import cache_bytes
from oscar.kernels.reference import gather_rotated
from oscar.kernels.paged import (Elsewhere, PagedConfig, PagedKVCache, ParamRangeError, PoolExhausted, check_held,
                                 held_rotations, layer_config, layout)
from oscar.stats.artifact import Artifact, QuantConfig, beyond_calibration, load_artifact

Format = Literal["int2", "passthrough"]
# the QuantConfig fields from_artifact may override (value_axis has one value)
_QUANT_FIELDS = tuple(f.name for f in fields(QuantConfig) if f.name != "value_axis")


def _decode(q: torch.Tensor, pc, seqs: list[int], scale: float, backend: str | None) -> torch.Tensor:
    """Fused decode attention (B, Hq, D) through kern's dispatcher; `backend` forces one implementation.

    The dispatcher chooses by device and $OSCAR_KERNELS (which also governs page quantization);
    this thin adapter adds a per-cache override for the decode call.
    """
    return dispatch.decode_attention(q, pc, seqs, scale=scale, want=backend)


# --------------------------------------------------------------------------- one layer
class OscarLayer(CacheLayerMixin):
    """One attention layer of an OscarCache: a view on layer `idx` of the shared paged pool."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, owner: "OscarCache", idx: int):
        super().__init__()
        self.owner, self.idx = owner, idx
        self.n = 0  # tokens held per sequence (all sequences of the batch have the same length)
        self._chunk: tuple | None = None  # what the attention call after this update needs

    @property
    def pc(self):
        return self.owner.pool[self.idx]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.owner._ensure_pool(key_states)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        o = self.owner
        o._check_attn_impl()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        o._check_states(key_states, value_states, self.idx)
        B, H, T, D = key_states.shape
        cfg, pc = o.pool.cfg, self.pc
        n0, n1 = self.n, self.n + T
        if not o._warned_len and (why := beyond_calibration(o.artifact if o.format == "int2" else None, n1)):
            o._warned_len = True  # once per cache
            warnings.warn(f"OscarCache: a sequence reaches {n1} tokens, {why}", stacklevel=3)
        if n1 > o.max_len:  # the first layer held refuses first: no layer holds the chunk
            kind = "pass-through " if o.format == "passthrough" else ""
            raise OscarError(f"{kind}OscarCache holds at most max_len={o.max_len} tokens per sequence, "
                             f"this update would make {n1} (nothing was written); build it with a larger max_len, "
                             f"or use oscar.kernels.generation.generate, which checks the length before decoding")
        # A multi-token chunk needs the 16-bit values of the tokens it flushes into pages (queries of the
        # chunk that precede the flush still see them unquantized): snapshot the old ring tail first.
        tail_old = None
        if T > 1 and o.format != "passthrough":
            l0 = layout(n0, cfg)
            c0 = cfg.quant.sink + l0.num_pages * cfg.quant.page_size
            if n0 > c0:
                slots = (torch.arange(c0, n0, device=pc.ring_k.device) - cfg.quant.sink) % cfg.ring_size
                sl = torch.tensor(o.seqs, device=slots.device)
                tail_old = (pc.ring_k[sl][:, :, slots], pc.ring_v[sl][:, :, slots])  # (B, H, n0 - c0, D)
        if o.broken:
            raise OscarError(f"this OscarCache is unusable after a refused update: {o.broken}")
        try:
            pc.append_batch(o.seqs, key_states, value_states)  # all-or-nothing (PoolExhausted before any write)
        except PoolExhausted as e:  # every layer has the same pages: the first layer held refuses first, nothing is written
            raise PoolExhausted(f"{e}; the cache holds {n0} tokens per sequence, room for {o.capacity()} "
                                f"(oscar.kernels.generation.generate checks this before decoding and keeps the tokens "
                                f"generated)") from None
        except ParamRangeError as e:
            # 8-bit params: layer l learns its range only now, after layers < l appended this chunk
            first = o.held.start  # the first layer this cache holds
            if self.idx > first:
                o.broken = (f"layer {self.idx} refused the chunk that layers {first}..{self.idx - 1} already hold "
                            "(8-bit scale/zero range); build a new cache with param_dtype='float16'")
            raise ParamRangeError(f"layer {self.idx}: {e}" + (f"; {o.broken}" if self.idx > first else "")) from e
        self.n = n1
        self._chunk = (n0, key_states, value_states, tail_old)
        key_states._oscar_layer = self
        return key_states, value_states

    # ---- attention
    def attend(self, module, query: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        o = self.owner
        B, Hq, Tq, D = query.shape
        n0, k_new, v_new, tail_old = self._chunk
        self._chunk = None
        if Tq != k_new.shape[2]:
            raise OscarError(f"attention got {Tq} queries for {k_new.shape[2]} new keys")
        if mask is not None and (mask.dtype != torch.bool or mask.shape[-1] != self.n):
            raise OscarError(f"OscarCache expects the 'oscar' boolean mask over {self.n} keys, got "
                             f"{mask.dtype} {tuple(mask.shape)}; was the mask function registered?")
        if o.format == "passthrough":
            return self._attend_sdpa(module, query, mask, scaling)
        if Tq == 1 and (mask is None or bool(mask.all())):
            return _decode(query[:, :, 0], self.pc, o.seqs, scaling, o.backend).unsqueeze(1)  # (B, 1, Hq, D)
        return self._attend_torch(query, mask, scaling, n0, k_new, v_new, tail_old)

    def gather(self, rotated: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's K, V as the cache represents them: (B, H, n, D) float32 (rotated space by default)."""

        ks, vs = zip(*(gather_rotated(self.pc, s) for s in self.owner.seqs))
        k, v = torch.stack(ks), torch.stack(vs)
        if not rotated:
            k, v = self.pc.rot.unrotate_k(k), self.pc.rot.unrotate_v(v)
        return k, v

    def _attend_sdpa(self, module, query, mask, scaling):

        k, v = self.gather(rotated=False)
        out, _ = sdpa_attention_forward(module, query, k.to(query.dtype), v.to(query.dtype), mask, dropout=0.0,
                                        scaling=scaling)
        return out

    def _attend_torch(self, query, mask, scaling, n0, k_new, v_new, tail_old):
        """Decode-semantics attention for Tq queries at positions [n0, n): float32, rotated space."""
        cfg, rot = self.owner.pool.cfg, self.pc.rot
        S, P = cfg.quant.sink, cfg.quant.page_size
        B, Hq, Tq, D = query.shape
        H = cfg.num_kv_heads
        G, n = Hq // H, self.n
        k_dq, v_dq = self.gather()  # (B, H, n, D): sink | dequantized pages | ring
        hist_end = lambda m: S + layout(m, cfg).num_pages * P  # noqa: E731  end of INT2 history at length m
        c0 = hist_end(n0) if n0 >= S else S  # first position whose 16-bit value the chunk still knows
        k_fp, v_fp = k_dq, v_dq
        if Tq > 1 and hist_end(n) > c0:  # tokens flushed by this chunk: rebuild their 16-bit (rotated, stored dtype) values
            a = max(n0, S)
            new_k = rot.rotate_k(k_new[:, :, a - n0:]).to(cfg.dtype).float()
            new_v = rot.rotate_v(v_new[:, :, a - n0:]).to(cfg.dtype).float()
            parts_k, parts_v = [new_k], [new_v]
            if tail_old is not None:
                parts_k.insert(0, tail_old[0].float())
                parts_v.insert(0, tail_old[1].float())
            k_fp, v_fp = k_dq.clone(), v_dq.clone()
            k_fp[:, :, c0:] = torch.cat(parts_k, 2)
            v_fp[:, :, c0:] = torch.cat(parts_v, 2)
        qf = query.float().reshape(B, H, G, Tq, D)
        q_rot = qf if rot.identity else qf @ rot.rot_q[None, :, None]  # (B, H, G, Tq, D); q.mu cancels in softmax
        out = torch.empty(B, H, G, Tq, D, dtype=torch.float32, device=query.device)
        pos_k = torch.arange(n, device=query.device)
        budget = (1 << 27) if query.is_cuda else (1 << 24)  # fp32 scores: 512 MiB on a GPU, 64 MiB on CPU
        blk = max(1, min(Tq, 256, budget // max(1, B * Hq * n)))  # bounds the (B, H, G, blk, n) scores
        for s0 in range(0, Tq, blk):
            s1 = min(Tq, s0 + blk)
            nq = s1 - s0
            p0, p1 = n0 + s0, n0 + s1  # absolute query positions [p0, p1)
            a, b = hist_end(p0 + 1), hist_end(p1)  # INT2 for every query below a; mixed in [a, b)
            ke = torch.cat([k_dq[:, :, :a], k_fp[:, :, a:p1]], 2)  # (B, H, p1, D) causal horizon p1
            ve = torch.cat([v_dq[:, :, :a], v_fp[:, :, a:p1]], 2)
            qb = q_rot[:, :, :, s0:s1].reshape(B, H, G * nq, D)
            s = torch.matmul(qb, ke.transpose(-1, -2)).mul_(scaling).view(B, H, G, nq, p1)
            pos_q = torch.arange(p0, p1, device=query.device)
            if b > a:  # per query: key j < hist_end(p + 1) is INT2
                ends = torch.tensor([hist_end(p + 1) for p in range(p0, p1)], device=query.device)
                sel = pos_k[None, a:b] < ends[:, None]  # (nq, b - a)
                s_mix = torch.matmul(qb, k_dq[:, :, a:b].transpose(-1, -2)).mul_(scaling).view(B, H, G, nq, b - a)
                s[..., a:b] = torch.where(sel, s_mix, s[..., a:b])
            allowed = pos_k[None, :p1] <= pos_q[:, None]  # (nq, p1) causal
            if mask is not None:
                allowed = allowed & mask[:, 0, s0:s1, :p1].reshape(B, 1, 1, nq, p1)
            bias = torch.zeros(allowed.shape, dtype=torch.float32, device=query.device).masked_fill_(~allowed, float("-inf"))
            pr = torch.softmax(s.add_(bias), -1)
            if mask is not None:
                pr.nan_to_num_(0.0)  # fully masked rows (padding queries) -> 0
            o = torch.matmul(pr.view(B, H, G * nq, p1), ve)  # (B, H, G*nq, D)
            if b > a:
                pm = (pr[..., a:b] * sel).reshape(B, H, G * nq, b - a)
                o = o + torch.matmul(pm, v_dq[:, :, a:b] - v_fp[:, :, a:b])
            out[:, :, :, s0:s1] = o.view(B, H, G, nq, D)
        if not rot.identity:
            out = out @ rot.rot_v.transpose(-1, -2)[None, :, None]  # back to the model's value space
        return out.reshape(B, Hq, Tq, D).transpose(1, 2).to(query.dtype)  # (B, Tq, Hq, D)

    # ---- Cache layer API
    def get_seq_length(self) -> int:
        return self.n

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.n + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.n = 0  # OscarCache.reset releases the pool's sequences for every layer at once

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise OscarError("OscarCache cannot be cropped (pages are written once)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise OscarError("OscarCache does not support beam search")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.n:
            raise OscarError("OscarCache cannot expand a filled batch; use fork() per copy")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise OscarError("OscarCache does not support batch selection")

    def offload(self):  # the pool stays on its device
        pass

    def prefetch(self):
        pass


# --------------------------------------------------------------------------- the cache
class OscarCache(Cache):
    """transformers Cache over the paged INT2 pool; build it with `from_artifact`.

    The pool (`self.pool`, a `PagedKVCache`) is created at the first update, when
    batch size, dtype and device are known; sequences `self.seqs` are its slots.
    `held`: the layers it holds (a pipeline stage's own range, None: all); the others are `Elsewhere`
    (writing one is refused) and the pool allocates nothing for them.
    """

    def __init__(self, artifact: Artifact, config: Any, quant: QuantConfig, *, format: Format = "int2",
                 max_len: int | None = None, max_pages: int | None = None, max_seqs: int | None = None,
                 backend: str | None = None, dtype: torch.dtype | None = None, pool: PagedKVCache | None = None,
                 layer_quant: list[QuantConfig] | None = None, held: range | None = None):
        if format not in ("int2", "passthrough"):
            raise OscarError(f"format must be 'int2' or 'passthrough', got {format!r}")

        check_model(config, what="the model")  # sliding-window layers: refused here as in every stage
        self.artifact, self.config, self.quant, self.format = artifact, config, quant, format
        self.layer_quant = layer_quant  # layer l stores its K/V as layer_quant[l] (per-layer widths); None: `quant`
        self.shapes = attention_shapes(config)
        c = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.max_len = int(max_len or min(getattr(c, "max_position_embeddings", 32768) or 32768, 32768))
        self.max_pages, self.max_seqs, self.backend, self.store_dtype = max_pages, max_seqs, backend, dtype
        self.broken: str | None = None  # why the layers disagree after a refused 8-bit-param update
        self._warned_len = False  # a sequence past the artifact's calibration length warns once
        self.pool: PagedKVCache | None = pool
        self.seqs: list[int] = []
        self._ids: list[torch.Tensor] | None = []  # token ids fed so far (None: unknown, e.g. embeddings fed)
        if pool is None:
            self.paged_config(1, torch.float32, "cpu")  # validate the format now, not at the first update
            if layer_quant is not None and format == "int2":
                self.layer_configs(self.paged_config(1, torch.float32, "cpu"))
        self.held = check_held(held, self.shapes["num_layers"])
        super().__init__(layers=[OscarLayer(self, i) if i in self.held else Elsewhere(i)
                                 for i in range(self.shapes["num_layers"])])

    @classmethod
    def from_artifact(cls, model, artifact: str | Path | Artifact, *, format: Format = "int2",
                      quant: QuantConfig | None = None, max_len: int | None = None, max_pages: int | None = None,
                      max_seqs: int | None = None, backend: str | None = None, dtype: torch.dtype | None = None,
                      allow_weights_mismatch: bool | None = None, held: range | None = None,
                      **overrides) -> "OscarCache":
        """An empty cache for `model` from an artifact (path or `Artifact`).

        overrides: any of bits, group_size, key_axis, mode, sink, recent, page_size, clip_rule, param_dtype (replace the
        artifact's QuantConfig; or pass a whole `quant`). max_len: longest sequence (sizes the
        default pool: ceil(max_len / page_size) pages per sequence; the pass-through ring).
        max_pages: pool size in pages per layer (shared by the batch's sequences).
        backend: None (Triton on CUDA, reference on CPU), "triton" or "reference".
        dtype: storage dtype of sink / recent window (default: the model's k/v dtype).
        allow_weights_mismatch: accept an artifact fitted on other weights of the same config (a
        deliberate transfer; default: `oscar --allow-weights-mismatch` / $OSCAR_ALLOW_WEIGHTS_MISMATCH).
        held: the layers the cache holds, for a `model` that runs only them (a pipeline stage); None: all.
        """
        art = load_artifact(str(artifact)) if isinstance(artifact, (str, Path)) else artifact
        if not isinstance(art, Artifact):
            raise OscarError(f"artifact must be a path or an Artifact, got {type(artifact).__name__}")
        art.validate()
        art.check_model(model.config, allow_weights_mismatch=allow_weights_mismatch)
        bad = set(overrides) - set(_QUANT_FIELDS)
        if bad:
            raise OscarError(f"unknown OscarCache option(s) {sorted(bad)}; quant overrides are {list(_QUANT_FIELDS)}")
        ov = {k: v for k, v in overrides.items() if v is not None}
        q = replace(quant or art.quant, **ov)
        # per-layer widths (Artifact.layer_quant) unless a whole `quant` replaces the artifact's format
        lq = [replace(x, **ov) for x in art.layer_quant] if art.layer_quant is not None and quant is None else None
        register_attention()
        if model.config._attn_implementation != ATTN_NAME:
            model.set_attn_implementation(ATTN_NAME)
        if not getattr(model, "_oscar_position_hook", None):  # refuses a cache reused for another prompt
            model._oscar_position_hook = model.register_forward_pre_hook(_check_cache_positions, with_kwargs=True)
            if hasattr(model, "prepare_inputs_for_generation"):  # generate: the whole prompt vs the cached tokens
                model.prepare_inputs_for_generation = _guard_prefix(model.prepare_inputs_for_generation)
        return cls(art, model.config, q, format=format, max_len=max_len, max_pages=max_pages, max_seqs=max_seqs,
                   backend=backend, dtype=dtype, layer_quant=lq, held=held)

    # ---- pool
    def paged_config(self, batch: int, dtype: torch.dtype, device) -> PagedConfig:
        H, D = self.shapes["num_kv_heads"], self.shapes["head_dim"]
        q = self.quant
        seqs = self.max_seqs or batch
        if self.format == "passthrough":
            fmt = QuantConfig(page_size=q.page_size, sink=q.sink, mode=q.mode)  # no token reaches a page
            return PagedConfig.passthrough(H, D, self.max_len, fmt, max_seqs=seqs, dtype=dtype, device=device)
        pages = self.max_pages or seqs * (-(-self.max_len // q.page_size))
        try:
            return PagedConfig(q, H, D, pages, max_seqs=seqs, dtype=dtype, device=device)
        except ValueError as e:
            raise OscarError(f"cache format: {e}") from e

    def layer_configs(self, cfg: PagedConfig) -> list[PagedConfig]:
        """Each layer's config (the model's layout `cfg` with the layer's own format); refuses what a layer cannot store."""
        L = self.shapes["num_layers"]
        if self.layer_quant is None or self.format != "int2":
            return [cfg] * L
        if len(self.layer_quant) != L:
            raise OscarError(f"layer_quant has {len(self.layer_quant)} formats for the model's {L} layers")
        try:
            return [layer_config(cfg, q) for q in self.layer_quant]
        except ValueError as e:
            raise OscarError(f"cache format: {e}") from e

    def _ensure_pool(self, k: torch.Tensor) -> None:
        if self.pool is not None and self.seqs:
            return
        B = k.shape[0]
        dtype = self.store_dtype or k.dtype
        if self.pool is None:
            cfg = self.paged_config(B, dtype, k.device)
            rots = held_rotations(self.artifact, k.device, self.held)
            lq = self.layer_quant if self.format == "int2" else None
            self.pool = PagedKVCache(cfg, rots, quantizer=dispatch.quantize_pages, layer_quant=lq, held=self.held)
        self.seqs = [self.pool.new_sequence() for _ in range(B)]

    def _check_attn_impl(self) -> None:
        impl = self.config._attn_implementation
        if impl != ATTN_NAME:
            raise OscarError(f"the model's attention implementation is {impl!r}; OscarCache needs {ATTN_NAME!r} "
                             "(OscarCache.from_artifact sets it)")

    def _check_states(self, k: torch.Tensor, v: torch.Tensor, idx: int) -> None:
        cfg = self.pool.cfg
        B, H, T, D = k.shape
        if (H, D) != (cfg.num_kv_heads, cfg.head_dim) or k.shape != v.shape:
            raise OscarError(f"layer {idx}: k/v {tuple(k.shape)}/{tuple(v.shape)} do not match the cache "
                             f"(B, {cfg.num_kv_heads}, T, {cfg.head_dim})")
        if B != len(self.seqs):
            raise OscarError(f"layer {idx}: batch {B} but the cache holds {len(self.seqs)} sequences")
        if k.device != torch.device(cfg.device) and k.device.type != torch.device(cfg.device).type:
            raise OscarError(f"layer {idx}: k/v on {k.device}, the cache lives on {cfg.device}")
        first = self.layers[idx]
        if getattr(first, "dtype", k.dtype) != k.dtype or k.dtype != v.dtype:
            raise OscarError(f"layer {idx}: k/v dtype {k.dtype}/{v.dtype}, the cache was started with {first.dtype}")

    # ---- layers
    def own_layers(self) -> list[OscarLayer]:
        """The layers this cache holds (every layer, or a pipeline stage's own range)."""
        return [self.layers[l] for l in self.held]

    def get_seq_length(self, layer_idx: int | None = None) -> int:
        """Tokens held per sequence, read from `layer_idx` (default: the first layer held); another layer is refused."""
        l = self.held.start if layer_idx is None else layer_idx
        if l not in self.held:
            raise OscarError(f"layer {l} is held by another pipeline stage (this cache holds layers "
                             f"{self.held.start}..{self.held.stop - 1})")
        return self.layers[l].n

    # ---- sequences
    def fork(self) -> "OscarCache":
        """A new cache over the same pool holding a copy of this one's sequences (prefix pages shared)."""
        if self.pool is None:
            raise OscarError("fork() needs a filled cache (run a prefill first)")
        new = OscarCache(self.artifact, self.config, self.quant, format=self.format, max_len=self.max_len,
                         max_pages=self.max_pages, max_seqs=self.max_seqs, backend=self.backend,
                         dtype=self.store_dtype, pool=self.pool, layer_quant=self.layer_quant, held=self.held)
        new.seqs = [self.pool.fork(s) for s in self.seqs]
        new._ids = [t] if (t := self.token_ids()) is not None else None
        for a, b in zip(new.own_layers(), self.own_layers()):
            a.n, a.is_initialized = b.n, b.is_initialized
            a.dtype, a.device = getattr(b, "dtype", None), getattr(b, "device", None)
        return new

    def release(self) -> None:
        """Give this cache's sequences (and pages no other sequence shares) back to the pool."""
        for s in self.seqs:
            self.pool.free(s)
        self.seqs = []
        for layer in self.own_layers():
            layer.n = 0

    def reset(self) -> None:
        """Empty the cache for a new prompt: its sequences (and unshared pages) go back to the pool."""
        if self.pool is not None and self.seqs:
            self.release()
        for layer in self.own_layers():
            layer.n, layer.is_initialized = 0, False  # the next update claims new sequences of the same pool
        self.broken = None
        self._ids = []

    def capacity(self, batch: int | None = None) -> int:
        """Longest length (tokens per sequence) `batch` sequences of this cache can reach: max_len, the
        pool's free pages (shared with forks) and the block table width, whichever binds first."""
        if self.format == "passthrough":
            return self.max_len
        B = len(self.seqs) or batch or 1
        cfg = self.pool.cfg if self.pool is not None else self.paged_config(B, torch.float32, "cpu")
        n = self.get_seq_length() if self.seqs else 0
        free = len(self.pool.layers[0].free_pages) if self.pool is not None else cfg.num_pages
        pages_now = layout(n, cfg).num_pages
        p_max = min(cfg.max_pages_per_seq, pages_now + free // B)  # pages per sequence reachable
        room = cfg.quant.sink + cfg.quant.recent + (p_max + 1) * cfg.quant.page_size - 1  # layout(room).num_pages == p_max
        return min(self.max_len, room)

    def check_positions(self, input_ids: torch.Tensor | None, position_ids: torch.Tensor | None,
                        attention_mask: torch.Tensor | None) -> None:
        """Refuse a forward whose positions do not continue this cache (a reuse for another prompt)."""
        n = self.get_seq_length()
        T = input_ids.shape[-1] if input_ids is not None else None
        ok = True
        if attention_mask is not None and T is not None and attention_mask.dim() == 2:
            ok = attention_mask.shape[-1] == n + T
        elif position_ids is not None and position_ids.numel():
            ok = int(position_ids.reshape(-1, position_ids.shape[-1])[:, 0].max()) == n
        if not ok:
            raise OscarError(f"this OscarCache holds {n} tokens per sequence, but the model is fed a chunk that does "
                             f"not continue them: it is being reused for another prompt (or the prompt does not "
                             f"start with the cached tokens); call cache.reset() to start over, or build a new cache")
        held = self.token_ids()
        if input_ids is not None and (held is None or held.shape[0] == input_ids.shape[0]):
            # record the token ids the cache holds (what check_prefix compares)
            self._ids = [held, input_ids.detach()] if held is not None else ([input_ids.detach()] if n == 0 else None)
        else:
            self._ids = None  # fed embeddings: the tokens are unknown, prefix checks are off

    def token_ids(self) -> torch.Tensor | None:
        """(B, n) token ids this cache holds, when every chunk was fed as input_ids (None otherwise)."""
        ids = getattr(self, "_ids", None)
        if not ids:
            return None
        t = torch.cat(ids, 1)
        if t.shape[1] < self.get_seq_length():  # a chunk went in unrecorded: the tokens are unknown
            self._ids = None
            return None
        t = t[:, : self.get_seq_length()]
        self._ids = [t]
        return t

    def check_prefix(self, input_ids: torch.Tensor) -> None:
        """Refuse a prompt that does not start with the tokens this cache holds (a reuse for another prompt)."""
        n, held = self.get_seq_length(), self.token_ids()
        if not n or held is None:
            return
        if input_ids.shape[1] < n or held.shape != input_ids[:, :n].shape or \
                not torch.equal(held.to(input_ids.device), input_ids[:, :n]):
            raise OscarError(f"this OscarCache holds {n} tokens per sequence of another prompt: the prompt does not "
                             f"start with them, so the cache is being reused for another prompt; call cache.reset() "
                             f"to start over, or build a new cache")

    def stopping_criteria(self):
        """A transformers StoppingCriteria that ends `model.generate` before the cache runs out (keeps the tokens)."""
        return CacheRoom(self)

    def memory(self) -> dict:
        """Bytes held by component for the tokens in this cache (see oscar.kernels.memory)."""

        return cache_bytes(self)


def _check_cache_positions(module, args, kwargs):
    """Forward pre-hook of a model served with OscarCache: the chunk must continue the cache. A pipeline stage
    is fed hidden states (B, T, H), not token ids: only their positions are checked."""
    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    if isinstance(cache, OscarCache):
        ids = kwargs.get("input_ids", args[0] if args else None)
        ids = None if ids is not None and ids.is_floating_point() else ids
        cache.check_positions(ids, kwargs.get("position_ids"), kwargs.get("attention_mask"))


def _guard_prefix(prepare):
    """Wrap a model's prepare_inputs_for_generation: the full sequence must extend the OscarCache's tokens."""
    import functools

    @functools.wraps(prepare)
    def guarded(input_ids, *args, **kwargs):
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        if isinstance(cache, OscarCache) and input_ids is not None:
            cache.check_prefix(input_ids)
        return prepare(input_ids, *args, **kwargs)

    return guarded
