"""The INT2 latent cache as an MLA engine stores it, decoding through the latent kernel: `LatentPagedCache`.

Per layer and token the history [sink, quantized) holds the rotated, centred latent as 2-bit codes (four per byte)
with a scale and a zero per 128-value group (`pack_latents`), and the RoPE key in the model dtype; the sinks and
the tokens not yet released (the recent window, the page being filled) stay exact, rotated and centred in float32.
Tokens leave the exact tail in whole pages, by the rule of the simulator (`LatentLayerQuant.quantized_until`), and
one chunk late: a chunk reads the history as the cache held it before the chunk, as `LatentSimCache` serves it.
Outside `serve` every step gets the whole history expanded (the simulator's reading, slower, never wrong).

transformers' MLA attention hands the cache the latent and the RoPE key (`update`) and expands what it returns
through kv_b_proj. A chunk of several tokens (a prefill) gets the dequantized history and its own latents, the
exact attention of the simulator. A single token (a decode step) gets its own latent only, so nothing is expanded;
the attention function registered here (`ATTN_NAME`, installed by `serve`) then reads the layer's storage in the
absorbed form through `latent_decode`: Triton where the dispatcher picks it (CUDA, or the interpreter), its torch
reference elsewhere. GLM-5's DSA top-k reaches a custom attention function as `indices`: the decode gathers the
selected tokens, a prefill masks the others. One sequence per cache.

    cache = LatentPagedCache(art)
    with serve(model):
        model.generate(ids, past_key_values=cache, max_new_tokens=16)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from oscar.common import OscarError
from oscar.kernels import dispatch
from oscar.kernels.latent import LatentLayerQuant, _LayerBase, latent_layers, pack_latents, up_projections
from oscar.quant import dequantize, unpack
from oscar.stats.artifact import LatentArtifact

ATTN_NAME = "oscar_latent"


class LatentPagedLayer(_LayerBase):
    """One layer of one sequence: exact sinks, INT2 history pages, the exact tail, every RoPE key."""

    def __init__(self, lq: LatentLayerQuant, sink: int, recent: int):
        super().__init__()
        self.lq, self.sink, self.recent = lq, sink, recent
        self.n = 0                      # tokens written
        self.n_quant = sink             # [sink, n_quant) stored INT2
        self.exact = None               # (E, r) float32 rotated, centred: tokens [0, min(n, sink)) + [n_quant, n)
        self.codes = self.scale = self.zero = None  # (N, r / 4) uint8, (N, G) float32 x 2: tokens [sink, n_quant)
        self.k_pe = None                # (n, rope) model dtype
        self.served = False             # `serve` installed the attention that reads the storage
        self.up = None                  # (W_UK, W_UV) in float32, from the first decode step

    def get_seq_length(self) -> int:
        return self.n

    def _commit(self) -> None:
        """Release the whole pages owed since the last update to INT2 (the chunk that owed them has read them)."""
        b = self.lq.quantized_until(self.n, self.sink, self.recent)
        if b <= self.n_quant:
            return
        s = min(self.n, self.sink)
        rows = self.exact[s:s + b - self.n_quant]                                    # (b - n_quant, r)
        codes, scale, zero = pack_latents(rows, self.lq.spec, self.lq.clip)
        cat = lambda a, x: x if a is None else torch.cat([a, x])  # noqa: E731
        self.codes, self.scale, self.zero = cat(self.codes, codes), cat(self.scale, scale.float()), cat(self.zero, zero.float())
        self.exact = torch.cat([self.exact[:s], self.exact[s + b - self.n_quant:]])
        self.n_quant = b

    def history(self) -> torch.Tensor:
        """(N, r) float32: the INT2 history, dequantized (rotated, centred)."""
        if self.codes is None:
            return self.exact.new_zeros(0, self.exact.shape[1])
        return dequantize(unpack(self.codes, self.lq.spec.bits), self.scale, self.zero, self.lq.spec)

    def rotated(self) -> torch.Tensor:
        """(n, r) float32: every token as the cache serves it, rotated and centred (sinks, history, tail)."""
        s = min(self.n, self.sink)
        return torch.cat([self.exact[:s], self.history(), self.exact[s:]])

    def update(self, c: torch.Tensor, k_pe: torch.Tensor, *args, **kwargs):
        """c (1, 1, T, r), k_pe (1, 1, T, rope): the chunk's latents; returns what the attention expands."""
        if c.shape[0] != 1:
            raise OscarError(f"LatentPagedCache holds one sequence; got a batch of {c.shape[0]}")
        if not self.is_initialized:
            self.lazy_initialization(c, k_pe)
            self.lq.to(c.device)
        if self.exact is not None:
            self._commit()
        x = (c[0, 0].float() - self.lq.mean) @ self.lq.rot                            # (T, r) rotated, centred
        self.exact = x if self.exact is None else torch.cat([self.exact, x])
        self.k_pe = k_pe[0, 0] if self.k_pe is None else torch.cat([self.k_pe, k_pe[0, 0]])
        self.n += c.shape[2]
        if c.shape[2] == 1 and self.served:  # a decode step: `latent_attention` reads the storage, nothing expanded
            return c, k_pe
        full = (self.rotated() @ self.lq.rot.T + self.lq.mean).to(c.dtype)          # (n, r) the history INT2
        return full[None, None], self.k_pe[None, None]


class LatentPagedCache(Cache):
    """The paged INT2 latent cache of one MLA model (one artifact) and one sequence."""

    def __init__(self, art: LatentArtifact, *, sink: int | None = None, recent: int | None = None):
        super().__init__(layers=latent_layers(art, LatentPagedLayer, sink, recent))


def decode_inputs(layer: LatentPagedLayer, pick: torch.Tensor | None = None):
    """The layer's storage as `latent_decode` reads it (one sequence): its history and exact segments as they are
    stored, or (`pick`: positions, GLM-5's DSA top-k of the step) the selected tokens gathered from them."""
    # late: Triton is imported only where a kernel may run (a CPU host without it runs the reference)
    from oscar.kernels.triton_latent import LatentDecodeInputs

    s = min(layer.n, layer.sink)
    h_end = layer.n_quant if layer.n > layer.sink else s                               # history: tokens [s, h_end)
    r, dev = layer.exact.shape[1], layer.exact.device
    G = r // layer.lq.spec.group_size
    if layer.codes is None:
        codes, scale, zero = (torch.zeros(0, w, dtype=dt, device=dev)
                              for w, dt in ((r // 4, torch.uint8), (G, torch.float32), (G, torch.float32)))
    else:
        codes, scale, zero = layer.codes, layer.scale, layer.zero
    k_hist, c_ex = layer.k_pe[s:h_end], layer.exact                                    # exact rows: [0, s) + [h_end, n)
    k_ex = torch.cat([layer.k_pe[:s], layer.k_pe[h_end:]])
    if pick is not None:  # the step's top-k only (copies of the selected tokens)
        keep = torch.zeros(layer.n, dtype=torch.bool, device=dev)
        keep[pick.long()] = True
        kh, ke = keep[s:h_end], torch.cat([keep[:s], keep[h_end:]])
        codes, scale, zero, k_hist, c_ex, k_ex = codes[kh], scale[kh], zero[kh], k_hist[kh], c_ex[ke], k_ex[ke]
    pad = lambda t: t if len(t) else torch.zeros(1, *t.shape[1:], dtype=t.dtype, device=t.device)  # noqa: E731
    return LatentDecodeInputs(codes=pad(codes)[None], scale=pad(scale)[None], zero=pad(zero)[None],
                              k_pe=pad(k_hist)[None], n_hist=torch.tensor([len(codes)], dtype=torch.int32),
                              c_exact=pad(c_ex)[None], k_pe_exact=pad(k_ex)[None],
                              n_exact=torch.tensor([len(c_ex)], dtype=torch.int32), group=layer.lq.spec.group_size)


def latent_decode_reference(qa_rot: torch.Tensor, q_pe: torch.Tensor, qmu: torch.Tensor, inp, scale: float,
                            spec) -> torch.Tensor:
    """`triton_latent.latent_decode`'s result in torch: softmax over [exact, history] of ((q̃ R)·ĉ_rot + q̃·mean +
    q_pe·k_pe) x scale, times ĉ_rot. qa_rot (B, H, r), q_pe (B, H, rope), qmu (B, H) -> (B, H, r) float32."""
    outs = []
    for b in range(qa_rot.shape[0]):
        m, n = int(inp.n_exact[b]), int(inp.n_hist[b])
        hist = dequantize(unpack(inp.codes[b, :n], spec.bits), inp.scale[b, :n], inp.zero[b, :n], spec)  # (n, r)
        c = torch.cat([inp.c_exact[b, :m].float(), hist])                            # (m + n, r)
        kp = torch.cat([inp.k_pe_exact[b, :m], inp.k_pe[b, :n]]).float()
        s = (qa_rot[b].float() @ c.T + q_pe[b].float() @ kp.T + qmu[b, :, None].float()) * scale   # (H, m + n)
        outs.append(torch.softmax(s, -1) @ c)
    return torch.stack(outs)


_ACTIVE: dict = {}  # id(model config) -> the cache `serve` installed


def latent_attention(module, query, key, value, attention_mask=None, dropout=0.0, scaling=None, indices=None, **kw):
    """The attention of an MLA layer over a `LatentPagedCache` (installed by `serve`). A decode step (one query
    token, the key its own latent only) reads the layer's storage in the absorbed form; a chunk attends to what
    `update` returned, the DSA top-k applied as a mask."""
    cache = _ACTIVE.get(id(module.config))
    layer = cache.layers[module.layer_idx] if cache is not None else None
    if layer is None or query.shape[2] != 1 or key.shape[2] != 1 or layer.n == 1:
        B, Tq, Tk = query.shape[0], query.shape[2], key.shape[2]
        mask = attention_mask if attention_mask is not None else \
            torch.ones(Tq, Tk, dtype=torch.bool, device=query.device).tril(Tk - Tq)[None, None]  # (1, 1, Tq, Tk)
        if indices is not None:  # GLM-5: a custom attention applies the DSA top-k itself
            keep = torch.zeros(B, Tq, Tk, dtype=torch.bool, device=query.device).scatter(-1, indices.long(), True)
            mask = mask & keep[:, None] if mask.dtype == torch.bool else \
                mask.masked_fill(~keep[:, None], torch.finfo(mask.dtype).min)
        groups = query.shape[1] // key.shape[1]
        k, v = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling)  # (B, H, Tq, v)
        return out.transpose(1, 2).contiguous(), None
    nope = module.qk_nope_head_dim
    if layer.up is None:  # the up-projections in float32, once per cache (not per step)
        layer.up = up_projections(module.kv_b_proj.weight.detach().float(), module.num_heads, nope, module.v_head_dim)
    w_uk, w_uv = layer.up
    q = query[:, :, 0].float()                                                       # (1, H, nope + rope)
    qa = torch.einsum("bhd,hdr->bhr", q[..., :nope], w_uk)                           # (1, H, r) absorbed
    qa_rot, qmu = qa @ layer.lq.rot, qa @ layer.lq.mean                              # (1, H, r), (1, H)
    inp = decode_inputs(layer, indices[0, 0] if indices is not None else None)
    if dispatch.backend(query.device) == "triton":
        # late: Triton is imported only where a kernel may run
        from oscar.kernels.triton_latent import latent_decode

        lat = latent_decode(qa_rot, q[..., nope:], qmu, inp, scaling)                # (1, H, r)
    else:
        lat = latent_decode_reference(qa_rot, q[..., nope:], qmu, inp, scaling, layer.lq.spec)
    lat = lat @ layer.lq.rot.T + layer.lq.mean                                       # un-rotated once
    out = torch.einsum("bhr,hvr->bhv", lat, w_uv)[:, None]                           # (1, 1, H, v)
    return out.to(query.dtype), None


def register() -> str:
    AttentionInterface.register(ATTN_NAME, latent_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    return ATTN_NAME


class serve:
    """Context manager: `model` attends through `cache` (a LatentPagedCache) with `latent_attention`; its attention
    implementation restored after."""

    def __init__(self, model, cache: LatentPagedCache):
        self.model, self.cache = model, cache

    def __enter__(self):
        self.prev = self.model.config._attn_implementation
        register()
        self.model.set_attn_implementation(ATTN_NAME)
        _ACTIVE[id(self.model.config)] = self.cache
        for layer in self.cache.layers:
            layer.served = True
        return self.cache

    def __exit__(self, *exc):
        _ACTIVE.pop(id(self.model.config), None)
        for layer in self.cache.layers:  # outside `serve` a decode step gets the whole history expanded
            layer.served = False
        self.model.set_attn_implementation(self.prev)
