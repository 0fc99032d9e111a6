"""Pick the kernel backend: Triton on CUDA, the torch reference on CPU; and name the cache family's backends.

Override with ``OSCAR_KERNELS=triton|reference``. Under ``TRITON_INTERPRET=1``
Triton runs on CPU tensors, which is how the kernel tests run without a GPU.
Both backends have the same signatures and the same semantics (reference.py).
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING

import torch

from oscar.common import OscarError
from oscar.kernels import reference

if TYPE_CHECKING:
    from oscar.kernels.paged import PagedLayerCache


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_usable(device: torch.device | str) -> bool:
    """Triton can run on tensors of this device (CUDA, or any device under TRITON_INTERPRET=1)."""
    if not triton_available():
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return torch.device(device).type == "cuda"


def backend(device: torch.device | str, want: str | None = None) -> str:
    """'triton' or 'reference' for tensors on `device`: `want` (a cache's explicit choice), else
    $OSCAR_KERNELS, else Triton on CUDA. The one backend choice (decode and page quantization)."""
    src = "backend"
    if want is None:
        want, src = os.environ.get("OSCAR_KERNELS", "").strip().lower() or None, "OSCAR_KERNELS"
    if want not in (None, "triton", "reference"):
        raise OscarError(f"{src}={want!r}: expected 'triton' or 'reference'")
    if want == "reference":
        return "reference"
    if want == "triton":
        if not triton_usable(device):
            raise OscarError(f"{src}=triton but Triton cannot run on {device} "
                             "(needs the triton package and CUDA, or TRITON_INTERPRET=1)")
        return "triton"
    return "triton" if torch.device(device).type == "cuda" and triton_usable(device) else "reference"


def check_query(q: torch.Tensor, cache: PagedLayerCache, seqs) -> None:
    cfg = cache.cfg
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise OscarError(f"q must be (B, Hq, D), got {tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    B, Hq, D = q.shape
    if D != cfg.head_dim or Hq % cfg.num_kv_heads:
        raise OscarError(f"q (B, Hq={Hq}, D={D}) does not fit the cache (Hkv={cfg.num_kv_heads}, D={cfg.head_dim}): "
                         "Hq must be a multiple of Hkv and D equal")
    if len(seqs) != B:
        raise OscarError(f"{len(seqs)} sequence ids for a batch of {B} queries")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise OscarError(f"q dtype {q.dtype} not supported (float16, bfloat16, float32)")
    if q.device.type != torch.device(cfg.device).type:
        raise OscarError(f"q is on {q.device}, the cache is on {cfg.device}")
    empty = [s for s in seqs if 0 <= s < cfg.max_seqs and cache.pages[s] is not None and cache.lengths[s] == 0]
    if empty:
        raise OscarError(f"sequences {empty} are empty: append the current token before decode attention")


def decode_attention(q: torch.Tensor, cache: PagedLayerCache, seqs: list[int], scale: float | None = None,
                     return_lse: bool = False, config=None, want: str | None = None):
    """Decode attention of one query token per sequence over the paged cache.

    q (B, Hq, D) model space -> o (B, Hq, D) in q.dtype [, lse (B, Hq) float32].
    `config`: a `triton_decode.DecodeConfig` (ignored by the reference); `want`: see `backend`.
    """
    check_query(q, cache, seqs)
    if backend(q.device, want) == "triton":
        from oscar.kernels import triton_decode  # late: optional dependency (triton)

        return triton_decode.decode_attention(q, cache, seqs, scale=scale, return_lse=return_lse, config=config)
    return reference.decode_attention(q, cache, seqs, scale=scale, return_lse=return_lse)


def quantize_pages(cache: PagedLayerCache, ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Quantize + pack whole pages k, v (N, Hkv, P, D) (rotated, cfg.dtype) into the pool at ids (N,).

    The Triton quantizer computes ratio clips with fp16 or 8-bit (e4m3) scale/zero; the published OSCAR format
    (row-quantile clips, float32 scale/zero) is quantized by the reference on every device."""
    impl = reference.quantize_pages
    if backend(k.device) == "triton":
        from oscar.kernels import triton_quant  # late: optional dependency (triton)

        impl = triton_quant.quantize_pages if triton_quant.supports(cache.cfg) else impl
    impl(cache, ids, k, v)


def dequantize_sequence(cache: PagedLayerCache, seq: int, dtype: torch.dtype | None = None, rotated: bool = False):
    """A sequence's full K, V (Hkv, n, D) as stored (torch; a prefill helper, not a hot path)."""
    return reference.dequantize_sequence(cache, seq, dtype=dtype, rotated=rotated)
