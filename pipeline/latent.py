"""Latent-attention (MLA) capture: per layer, what the INT2 latent cache's rotation and clips are fitted on.

An MLA layer (GLM-5 `GlmMoeDsaAttention`, DeepSeek-V3 `DeepseekV3Attention`) caches per token the latent
c = kv_a_layernorm(...) (kv_lora_rank values) and one shared RoPE key; each head's key and value are up-projections
of c through `kv_b_proj` (W_UK,h and W_UV,h). Quantizing c moves

    logit_h(t, s)  by  q̃_h,t · (ĉ_s - c_s),   q̃_h = q_nope,h W_UK,h        (the absorbed query, r values)
    output_h(t)    by  (S_h (Ĉ - C))_t W_UV,hᵀ                              (S_h: head h's attention)

so the latent analogues of C_Q and C_S are Σ q̃ q̃ᵀ and Σ õ õᵀ with õ_h = S_h C, the attention-weighted latent,
pooled over heads. õ is computed by running the layer's own attention (the same scores, its mask and the DSA
top-k included) once more with the latent as the values; no score matrix is materialised here either.

The latent itself is not an input of the attention function: a forward hook on each layer's `kv_a_layernorm`
hands it to the capture (`hook_latents`). Sums are float64, per sequence (bit-identical whatever the batch size),
over the counted positions (padding and sinks excluded), as for per-head statistics; store names are
`pipeline.store.latent_layer_arrays`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from oscar.common import OscarError


@dataclass
class LatentSpec:
    num_heads: int
    kv_lora_rank: int
    nope_dim: int
    v_dim: int
    layers: tuple[int, ...]          # layers this capture owns (a stage: its contiguous range)
    sink: int = 0
    reservoir: int = 256             # R latent and absorbed-query rows per block and layer
    seed: int = 0
    seqs_per_block: int = 1

    def __post_init__(self):
        self.layers = tuple(int(l) for l in self.layers)

    @classmethod
    def of(cls, latent: dict, layers, **kw) -> "LatentSpec":
        """From `oscar.common.latent_shapes` (a store's `model.latent`)."""
        return cls(latent["num_heads"], latent["kv_lora_rank"], latent["nope_dim"], latent["v_dim"], layers, **kw)


def is_latent_attention(module: torch.nn.Module) -> bool:
    return hasattr(module, "kv_b_proj") and hasattr(module, "kv_a_layernorm")


def hook_latents(root: torch.nn.Module, stash: Callable[[int, torch.Tensor], None]) -> int:
    """Hook every MLA attention module under `root`: its kv_a_layernorm output (B, T, r) goes to
    `stash(layer_idx, c)`. Idempotent per module; returns how many layers are hooked."""
    n = 0
    for m in root.modules():
        if not is_latent_attention(m):
            continue
        n += 1
        if getattr(m, "_oscar_latent_hook", False):
            continue
        layer = int(m.layer_idx)
        m.kv_a_layernorm.register_forward_hook(lambda mod, inp, out, l=layer: stash(l, out))
        m._oscar_latent_hook = True
    return n


def dsa_mask(attention_mask: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The attention mask with GLM-5's DSA top-k applied as the model applies it for eager / SDPA: a key outside a
    query's top-k `indices` (B, T, k) is masked. transformers hands any other attention function the top-k as
    `indices` instead (for its sparse kernels), so a registered wrapper must apply it itself."""
    B, T, _ = indices.shape
    out = indices.new_ones((B, T, attention_mask.shape[-1]), dtype=torch.bool)
    index_mask = out.scatter(-1, indices.long(), False).unsqueeze(1)                    # (B, 1, T, Tk)
    if attention_mask.dtype == torch.bool:
        return attention_mask & ~index_mask
    return attention_mask.masked_fill(index_mask, torch.finfo(dtype).min)


def up_projections(module: torch.nn.Module, spec: LatentSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_UK (H, nope, r), W_UV (H, v, r)) of an MLA layer's kv_b_proj (k_nope,h = c W_UK,hᵀ, v_h = c W_UV,hᵀ)."""
    w = module.kv_b_proj.weight                                                     # (H*(nope+v), r)
    H, r = spec.num_heads, spec.kv_lora_rank
    if tuple(w.shape) != (H * (spec.nope_dim + spec.v_dim), r):
        raise OscarError(f"layer {module.layer_idx}: kv_b_proj weight {tuple(w.shape)} is not (heads x (nope + v), "
                         f"kv_lora_rank) = {(H * (spec.nope_dim + spec.v_dim), r)}")
    w = w.detach().view(H, spec.nope_dim + spec.v_dim, r)
    return w[:, : spec.nope_dim], w[:, spec.nope_dim:]


def _seed(seed: int, block: int, layer: int) -> int:
    h = hashlib.sha256(f"oscar-latent-reservoir/{seed}/{block}/{layer}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


class LatentAccumulator:
    """float64 sums of one MLA layer over one block (`pipeline.store.latent_layer_arrays`)."""

    def __init__(self, spec: LatentSpec, layer: int, block: int, device: torch.device):
        r = spec.kv_lora_rank
        z = lambda *s: torch.zeros(*s, dtype=torch.float64, device=device)  # noqa: E731
        self.spec, self.layer, self.block, self.device = spec, layer, block, device
        self.c_gram, self.qa_gram, self.ol_gram, self.uv_gram = z(r, r), z(r, r), z(r, r), z(r, r)
        self.mom = z(3, r)                      # Σc, Σc³, Σc⁴
        self.absmax2 = z(r)
        self.count = self.nonfinite = 0
        self._gen = torch.Generator().manual_seed(_seed(spec.seed, block, layer))
        self.keys: torch.Tensor | None = None   # (S, T) reservoir keys, one per (sequence, token)
        self.heads: torch.Tensor | None = None  # (S, T) the head whose absorbed query a row keeps
        self.cand: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (keys, c rows, q̃ rows)

    def update(self, module, q: torch.Tensor, c: torch.Tensor, attend: Callable, rows) -> None:
        """q: (B, H, T, nope + rope) the queries the attention received; c: (B, T, r) the latents; attend(values)
        reruns the layer's attention with `values` (B, H, T, r) (its scores, mask and top-k) -> (B, T, H, r)."""
        spec = self.spec
        B, H, T, _ = q.shape
        r = spec.kv_lora_rank
        if tuple(c.shape) != (B, T, r):
            raise OscarError(f"layer {self.layer}: latent {tuple(c.shape)} is not (batch, tokens, kv_lora_rank) "
                             f"= {(B, T, r)}")
        w_uk, w_uv = up_projections(module, spec)                                   # (H, nope, r), (H, v, r)
        ol = attend(c[:, None].expand(B, H, T, r).to(q.dtype))                      # (B, T, H, r)
        uv = torch.einsum("hvr,hvs->rs", w_uv.double(), w_uv.double())             # (r, r): Σ_h W_UV,hᵀ W_UV,h
        for b, sel in enumerate(rows.per_seq):  # a loop over the batch's sequences, not tokens
            if sel is None:
                continue
            tok = (torch.arange(sel.start, sel.stop, device=c.device) if isinstance(sel, slice) else sel)  # (n,)
            cb = c[b].index_select(0, tok).double()                                 # (n, r)
            ok = torch.isfinite(cb).all(1)
            qn = q[b, :, :, : spec.nope_dim].index_select(1, tok)                   # (H, n, nope)
            qa = torch.einsum("hnd,hdr->hnr", qn.double(), w_uk.double())           # (H, n, r) absorbed queries
            ob = ol[b].index_select(0, tok).double()                                # (n, H, r)
            ok &= torch.isfinite(qa).all(2).all(0) & torch.isfinite(ob).all(2).all(1)
            if not bool(ok.all()):  # NaN/Inf rows would poison every sum: dropped and counted
                self.nonfinite += int((~ok).sum())
                tok, cb, qa, ob = tok[ok], cb[ok], qa[:, ok], ob[ok]
            n = tok.numel()
            if n == 0:
                continue
            self.count += n
            self.c_gram += cb.mT @ cb
            self.qa_gram += torch.einsum("hnr,hns->rs", qa, qa)
            self.ol_gram += torch.einsum("nhr,nhs->rs", ob, ob)
            self.uv_gram += n * uv
            c2 = cb * cb
            self.mom += torch.stack([cb.sum(0), (c2 * cb).sum(0), (c2 * c2).sum(0)])
            torch.maximum(self.absmax2, c2.amax(0), out=self.absmax2)
            if spec.reservoir > 0:
                self._reservoir(b + rows.seq_offset, T, tok, cb, qa)

    def _reservoir(self, seq: int, T: int, tok: torch.Tensor, cb: torch.Tensor, qa: torch.Tensor) -> None:
        """Offer the sequence's rows with their keys (drawn once per block and layer); the R smallest are kept."""
        if self.keys is None:
            S, H = self.spec.seqs_per_block, self.spec.num_heads
            self.keys = torch.rand(S, T, generator=self._gen, dtype=torch.float64)               # (S, T)
            self.heads = torch.randint(0, H, (S, T), generator=self._gen)                        # (S, T)
        elif self.keys.shape[1] != T:
            raise OscarError(f"sequence length changed within block {self.block}")
        t = tok.cpu()
        k, h = self.keys[seq, t], self.heads[seq, t]                                             # (n,), (n,)
        sel = torch.topk(k, self.spec.reservoir, largest=False, sorted=False).indices if k.numel() > self.spec.reservoir \
            else torch.arange(k.numel())
        rows = sel.to(cb.device)
        self.cand.append((k[sel], cb[rows].float().cpu(), qa[h[sel].to(qa.device), rows].float().cpu()))

    def arrays(self) -> dict[str, np.ndarray]:
        """The block's values under their store names (numpy, CPU)."""
        r, R = self.spec.kv_lora_rank, self.spec.reservoir
        c_res, qa_res = np.zeros((R, r), np.float32), np.zeros((R, r), np.float32)
        n_res = 0
        if self.cand:
            keys = torch.cat([x[0] for x in self.cand])
            top = torch.topk(keys, min(R, keys.numel()), largest=False, sorted=True).indices
            n_res = top.numel()
            c_res[:n_res] = torch.cat([x[1] for x in self.cand]).index_select(0, top).numpy()
            qa_res[:n_res] = torch.cat([x[2] for x in self.cand]).index_select(0, top).numpy()
        np64 = lambda t: t.cpu().numpy()  # noqa: E731
        return {
            "c_gram": np64(self.c_gram), "c_sum": np64(self.mom[0]), "c_m3": np64(self.mom[1]),
            "c_m4": np64(self.mom[2]), "c_absmax": np64(self.absmax2.sqrt()), "qa_gram": np64(self.qa_gram),
            "ol_gram": np64(self.ol_gram), "uv_gram": np64(self.uv_gram), "c_res": c_res, "qa_res": qa_res,
            "count": np.array(self.count, np.int64), "q_count": np.array(self.count * self.spec.num_heads, np.int64),
            "nonfinite": np.array(self.nonfinite, np.int64), "res_count": np.array(n_res, np.int64),
            "qo_res_count": np.array(n_res, np.int64),
        }
