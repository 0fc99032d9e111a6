"""The published OSCAR code's recipe, step by step (variant ``oscar-ref``).

A re-implementation from the public description of the reference SGLang fork's
calibration and cache (README of the published code; see docs/reference-recipe.md),
so reports can show this project's recipe against it on the same model, data and bits.
Every step is a small typed function on torch float64 tensors; ``layer_rotations``
chains them from the calibration store's sums (docs/store-format.md).

1. Targets (uncentered second moments of post-RoPE q/k/v, per KV head h):
   key   C_K,h = Σ q qᵀ / N_q over the query heads of h's GQA group   (``q_gram / q_count``)
   value C_V,h = Σ_t w_t v_t v_tᵀ / Σ_t w_t,  w_t = k_tᵀ C_Q k_t      (``vw_gram / w_sum``)
   i.e. the weights normalised to mean 1 (C_Q: the capture's per-sequence query
   second moment, see docs/decisions/0015-capture-value-target-w-t-v-t-v-t-uses-the-c-q-of.md "Capture: value target").
2. One rotation per layer: the per-head targets averaged over the KV heads.
3. ``eigh`` of the average: eigenvalues ascending, eigenvectors as the columns of U
   (as ``torch.linalg.eigh`` returns them; no reordering, no sign fixing).
4. ``R = U H P``: H the normalised Sylvester Hadamard; P the permutation whose column j
   picks index ``desc[bitrev(j)]``, desc = eigenvalue indices in descending order
   (stable), so ``(x @ R)[:, j] = (x @ U H)[:, desc[bitrev(j)]]``.
5. Fixed clipping, per rotated token row: clamp to ±(the ratio-quantile of the row's
   |values|), K 0.96, V 0.92 (``QuantSpec.clip_rule = "row-quantile"``).
6. INT2 asymmetric min-max per token and KV head over the whole head_dim, float32 scale
   and zero: 2 + 64/D bits per element (2.5 at D = 128, 3.0 at D = 64); BF16 sink 64 and
   recent window 256, recent tokens flushed to INT2 in pages of 8 (``page_size = 8``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oscar.common import OscarError
from oscar.quant import QuantSpec
from oscar.stats.artifact import QuantConfig
from oscar.stats.hadamard import hadamard_tensor

CLIP_K = 0.96
CLIP_V = 0.92
SINK = 64
RECENT = 256
FLUSH_PAGE = 8  # recent tokens leave the BF16 window in whole pages of this many tokens


def _f64(x) -> torch.Tensor:
    return torch.as_tensor(x).to(torch.float64)


# 1. targets ------------------------------------------------------------------------------

def key_target(q_gram: torch.Tensor, q_count: torch.Tensor) -> torch.Tensor:
    """Per-KV-head query second moment, pooled over the GQA group and all blocks.

    q_gram (B, Hkv, D, D) Σ q qᵀ per block, q_count (B,) rows per KV head -> (Hkv, D, D).
    """
    n = _f64(q_count).sum()
    if not n > 0:
        raise OscarError("reference key target: no counted query rows (q_count sums to 0)")
    return _f64(q_gram).sum(0) / n


def value_target(vw_gram: torch.Tensor, w_sum: torch.Tensor) -> torch.Tensor:
    """Σ_t w_t v_t v_tᵀ / Σ_t w_t per KV head (weights normalised to mean 1, then / N).

    vw_gram (B, Hkv, D, D), w_sum (B, Hkv) -> (Hkv, D, D).
    """
    w = _f64(w_sum).sum(0)  # (Hkv,)
    if not bool((w > 0).all()):
        raise OscarError(f"reference value target: Σ w_t must be > 0 for every KV head, got {w.tolist()}")
    return _f64(vw_gram).sum(0) / w[:, None, None]


# 2. one rotation per layer -----------------------------------------------------------------

def layer_average(C: torch.Tensor) -> torch.Tensor:
    """(Hkv, D, D) -> (D, D): the target shared by every KV head of the layer."""
    return _f64(C).mean(0)


# 3. eigenbasis ---------------------------------------------------------------------------

def eig_ascending(C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(eigenvalues (D,) ascending, U (D, D) eigenvectors as columns) of a symmetric C."""
    C = _f64(C)
    if not torch.isfinite(C).all():
        raise OscarError("reference eigenbasis: target contains NaN/Inf")
    w, U = torch.linalg.eigh((C + C.mT) / 2)
    return w, U


# 4. composite rotation -------------------------------------------------------------------

def hadamard(D: int) -> torch.Tensor:
    """Normalised Sylvester Hadamard (D, D) float64, D a power of two (the published code's only case):
    oscar.stats.hadamard's, restricted to that case."""
    return hadamard_tensor(D, sylvester_for="the reference recipe's Hadamard")


def bitrev(D: int) -> torch.Tensor:
    """(D,) int64: i with its log2(D) bits reversed."""
    k = D.bit_length() - 1
    i = torch.arange(D)
    out = torch.zeros_like(i)
    for b in range(k):
        out |= ((i >> b) & 1) << (k - 1 - b)
    return out


def reference_perm(eigvals: torch.Tensor) -> torch.Tensor:
    """(D,) index array: column j of x @ P is column ``desc[bitrev(j)]`` of x."""
    desc = torch.sort(_f64(eigvals), descending=True, stable=True).indices
    return desc[bitrev(desc.numel())]


def perm_matrix(perm: torch.Tensor) -> torch.Tensor:
    """P (D, D) float64 with (x @ P)[:, j] = x[:, perm[j]]."""
    D = perm.numel()
    P = torch.zeros(D, D, dtype=torch.float64)
    P[perm, torch.arange(D)] = 1.0
    return P


def compose(U: torch.Tensor, eigvals: torch.Tensor) -> torch.Tensor:
    """R = U H P (D, D), orthogonal; apply as x_rot = x @ R."""
    D = U.shape[-1]
    return _f64(U) @ hadamard(D) @ perm_matrix(reference_perm(eigvals))


def reference_rotation(C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Target (D, D) -> (R (D, D), eigenvalues ascending (D,))."""
    w, U = eig_ascending(C)
    return compose(U, w), w


@dataclass
class ReferenceLayer:
    rot_k: torch.Tensor  # (D, D) float64, shared by the KV heads
    rot_v: torch.Tensor
    eig_k: torch.Tensor  # (D,) ascending eigenvalues of the averaged targets
    eig_v: torch.Tensor


def layer_rotations(q_gram, q_count, vw_gram, w_sum) -> ReferenceLayer:
    """One layer of the store (leading block axis, as stored) -> its shared R_K, R_V."""
    rk, wk = reference_rotation(layer_average(key_target(q_gram, q_count)))
    rv, wv = reference_rotation(layer_average(value_target(vw_gram, w_sum)))
    return ReferenceLayer(rk, rv, wk, wv)


# 5-6. clipping and quantization -------------------------------------------------------------

def reference_quant_config(bits: int = 2) -> QuantConfig:
    """The published cache format: per-token min/max over head_dim, float32 scale/zero,
    per-row quantile clip, BF16 sink 64 + recent 256, flushed in pages of 8."""
    return QuantConfig(bits=bits, group_size=None, key_axis="token", mode="minmax", sink=SINK, recent=RECENT,
                       page_size=FLUSH_PAGE, clip_rule="row-quantile", param_dtype="float32")


def reference_spec(bits: int = 2) -> QuantSpec:
    """The QuantSpec of both K and V under the reference format (clip = the row-quantile ratio)."""
    return QuantSpec(bits=bits, axis="token", group_size=None, mode="minmax", param_dtype=torch.float32,
                     clip_rule="row-quantile")
