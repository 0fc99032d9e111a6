"""Causal attention on CPU through a native flash kernel (`_flash_cpu.c`): exact prefills and perplexity windows.

The validation stages spend most of their time in exact causal attention over long prompts (the
needle prefill, the perplexity windows' far part). The C kernel computes the same softmax attention in
float32 (bfloat16 inputs through AVX512-BF16 dot products). Which is faster depends on the host: on a 2-CPU
AVX-512 BF16 host without AMX it ran 3.2x faster than torch's SDPA on a bf16 4k SmolLM2 prefill and 1.6x in
float32 (bench/cpu_attention.py); on an Intel Xeon with AMX, torch's bfloat16 SDPA ran 2.4-3.5x faster than it
while the C kernel still won in float32 up to 2k tokens (bench/native_paths.py). So each input dtype is measured
against torch once per machine (`chosen(dtype)`), and the kernel is used where it won and applies — CPU
tensors, float32/bfloat16, no mask other than causality, head_dim a multiple of 16 (32 for bf16), no gradient —
and torch's SDPA everywhere else.

    out, lse = causal_attention(q, k, v)               # q (B, Hq, Tq, D), k/v (B, Hkv, Tk, D), GQA
    with native_prefill(model): model(input_ids=...)   # the model's attention through it (else SDPA)

`OSCAR_CPU_FLASH=0` (or `OSCAR_NATIVE=0`, or no C compiler) keeps torch's kernel.

The calibration capture (pipeline/capture.py) runs before kernels in the data flow and does not import
this module: it looks its inner attention up in transformers' registry under `CPU_ATTENTION`, which
`register()` fills. The callers that may import kernels register it before calibrating: the `oscar`
dispatcher (oscar/__main__.py), the main job (oscar/run.py) and the Ray stage actors (cluster/actors.py).
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from oscar.native_build import CPU_ATTENTION, compile_library, measured_choice

SRC = Path(__file__).with_name("_flash_cpu.c")
BK = 64  # keys per block in the C kernel (the key padding)
NAME = CPU_ATTENTION  # registered with transformers (oscar/native_build.py says why the name lives there)
_LOCK = threading.Lock()
_LIB: "ctypes.CDLL | None | bool" = False
WHY_NOT = ""
_BF16 = True  # False once the library said it was built without AVX512-BF16


def available() -> bool:
    """The kernel built and loaded (once per process), and not switched off."""
    global _LIB, WHY_NOT
    if os.environ.get("OSCAR_CPU_FLASH", "1") == "0":
        WHY_NOT = "disabled by OSCAR_CPU_FLASH=0"
        return False
    with _LOCK:
        if _LIB is False:
            lib, WHY_NOT = compile_library(SRC, "flash_cpu")
            if lib is not None:
                for f in (lib.oscar_flash_causal, lib.oscar_flash_causal_bf16):
                    f.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 5 + [ctypes.c_int, ctypes.c_int64,
                                                                                 ctypes.c_float, ctypes.c_int]
                    f.restype = ctypes.c_int
            _LIB = lib
    return _LIB is not None


# The host choice per input dtype: bfloat16 is probed on its own because torch's bfloat16 SDPA may run on matrix
# units the C kernel does not use (AMX: 2.4-3.5x faster than the C kernel's AVX512-BF16 path on one such host,
# bench/native_paths.py), while in float32 the C kernel wins on the same host.
PROBES = {torch.float32: "flash_cpu", torch.bfloat16: "flash_cpu_bf16"}
# The probe's length: the calibration sequences' and the validated contexts' order. Shorter probes favour the C
# kernel: run as an AVX2-only host it ran 1.36x SDPA's speed at 512 tokens and 0.92x at 2048, one thread, on a
# busy Xeon (docs/speed.md, "The native attention's probe"), so a 512-token probe chose it where it loses.
PROBE_T = 2048
_CHOSEN: dict = {}  # dtype -> bool


def chosen(dtype: torch.dtype = torch.float32) -> bool:
    """The product uses the kernel for `dtype` inputs: built, and measured no slower than torch's SDPA on this host
    in that dtype (one thread, a PROBE_T-token causal probe of SmolLM2's heads; `native_build.measured_choice`,
    kept per machine)."""
    if not available() or dtype not in PROBES:  # checked each call: the environment may switch it off
        return False
    if dtype not in _CHOSEN:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, h, PROBE_T, 64, generator=g).to(dtype) for h in (9, 3, 3))  # (B, H, T, D)
        K, V = k.repeat_interleave(3, 1), v.repeat_interleave(3, 1)
        _CHOSEN[dtype] = measured_choice(PROBES[dtype], _LIB, lambda: causal_attention(q, k, v, threads=1),
                                         lambda: F.scaled_dot_product_attention(q, K, V, is_causal=True),
                                         probe=f"T={PROBE_T}")
    return _CHOSEN[dtype]


def _applies(q: torch.Tensor, k: torch.Tensor) -> bool:
    D = q.shape[-1]
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) and k.dtype == q.dtype
            and D % 16 == 0 and D <= 256 and q.shape[1] % k.shape[1] == 0 and k.shape[-2] > 0
            and q.shape[-2] <= k.shape[-2] and not (torch.is_grad_enabled() and q.requires_grad))


def supports(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the product runs `causal_attention` for these tensors (else callers use torch's SDPA)."""
    return _applies(q, k) and chosen(q.dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                     threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale + causal) v and its log-sum-exp, both float32.

    q (B, Hq, Tq, D), k/v (B, Hkv, Tk, D) with Hq a multiple of Hkv (query head h reads KV head
    h // (Hq / Hkv)); query i is position Tk - Tq + i, so it reads keys j <= Tk - Tq + i (for Tq == Tk
    plain causal attention). Returns out (B, Hq, Tq, D) and lse (B, Hq, Tq).
    """
    assert _applies(q, k) and available(), "causal_attention: not supported for these tensors (check supports() first)"
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    assert k.shape == v.shape == (B, Hkv, Tk, D), (tuple(k.shape), tuple(v.shape))
    scale = float(scale if scale is not None else D ** -0.5)
    threads = threads or torch.get_num_threads()
    Tkp = -(-Tk // BK) * BK
    out = torch.empty(B, Hq, Tq, D, dtype=torch.float32)
    lse = torch.empty(B, Hq, Tq, dtype=torch.float32)
    global _BF16
    bf16 = q.dtype == torch.bfloat16 and _BF16 and D % 32 == 0
    for b in range(B):
        if bf16:  # keys as channel pairs (Hkv, D/2, Tkp, 2), values as key pairs (Hkv, Tkp/2, D, 2): vdpbf16ps operands
            kp = torch.zeros(Hkv, Tkp, D, dtype=torch.bfloat16)
            kp[:, :Tk] = k[b]
            kp = kp.view(Hkv, Tkp, D // 2, 2).transpose(1, 2).contiguous()
            vp = torch.zeros(Hkv, Tkp, D, dtype=torch.bfloat16)
            vp[:, :Tk] = v[b]
            vp = vp.view(Hkv, Tkp // 2, 2, D).transpose(2, 3).contiguous()
            qb = q[b].contiguous()  # (Hq, Tq, D)
            rc = _LIB.oscar_flash_causal_bf16(qb.data_ptr(), kp.data_ptr(), vp.data_ptr(), out[b].data_ptr(),
                                              lse[b].data_ptr(), Hq, Hkv, Tq, Tk, Tkp, D, Tk - Tq, scale, threads)
            if rc == 2:  # built without AVX512-BF16: the float32 kernel from now on
                _BF16 = False
            elif rc != 0:
                raise ValueError(f"native bf16 attention failed ({rc}) for q {tuple(q.shape)}, k {tuple(k.shape)}")
            else:
                continue
        kt = torch.zeros(Hkv, D, Tkp, dtype=torch.float32)  # keys transposed: 16 keys per vector load
        kt[:, :, :Tk] = k[b].transpose(1, 2)
        vf = torch.zeros(Hkv, Tkp, D, dtype=torch.float32)
        vf[:, :Tk] = v[b]
        qf = q[b].to(torch.float32).contiguous()
        rc = _LIB.oscar_flash_causal(qf.data_ptr(), kt.data_ptr(), vf.data_ptr(), out[b].data_ptr(), lse[b].data_ptr(),
                                     Hq, Hkv, Tq, Tk, Tkp, D, Tk - Tq, scale, threads)
        if rc != 0:
            raise ValueError(f"native attention failed ({rc}) for q {tuple(q.shape)}, k {tuple(k.shape)}")
    return out, lse


_CAUSAL_SEEN: list = [None]  # the last mask found to be plain causal (every layer of a forward gets the same tensor)


def is_causal_mask(mask: torch.Tensor | None, Tq: int, Tk: int) -> bool:
    """None, or a boolean (B, 1, Tq, Tk) mask that is exactly "query i reads keys j <= Tk - Tq + i"
    (what transformers builds for a prefill continuing a cache without padding)."""
    if mask is None:
        return True
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or tuple(mask.shape[2:]) != (Tq, Tk):
        return False
    key = (mask.data_ptr(), tuple(mask.shape), mask._version)
    if _CAUSAL_SEEN[0] == key:
        return True
    want = torch.ones(Tq, Tk, dtype=torch.bool, device=mask.device).tril(Tk - Tq)
    ok = bool((mask == want).all())
    if ok:
        _CAUSAL_SEEN[0] = key
    return ok


def attention_forward(module, query, key, value, attention_mask=None, dropout=0.0, scaling=None, **kwargs):
    """A transformers attention function: the native kernel for a causal attention (no mask, or one that
    is plain causality) with values as wide as the keys, torch's SDPA otherwise (padding, sliding windows, dropout,
    other devices, MLA's value widths)."""
    if (dropout == 0.0 and kwargs.get("sliding_window") is None and supports(query, key)
            and value.shape == key.shape  # MLA values are narrower than its keys (and a latent capture's wider)
            and is_causal_mask(attention_mask, query.shape[2], key.shape[2])):
        out, _ = causal_attention(query, key, value, scaling)
        return out.to(query.dtype).transpose(1, 2).contiguous(), None

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def register() -> str:
    """Register `attention_forward` (with SDPA's mask function) with transformers as NAME."""

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


class native_prefill:
    """Context manager: a model whose attention is SDPA runs `attention_forward` inside (CPU only;
    anything else is left as it is)."""

    def __init__(self, model):
        self.model, self.prev = model, None

    def __enter__(self):
        m = self.model
        w = next(m.parameters())
        if m.config._attn_implementation == "sdpa" and w.device.type == "cpu" and chosen(w.dtype):
            self.prev = "sdpa"
            m.set_attn_implementation(register())
        return self

    def __exit__(self, *exc):
        if self.prev is not None:
            self.model.set_attn_implementation(self.prev)
