"""The native CPU attention (kernels/_flash_cpu.c) against a float64 softmax, and its use by the model.

Shapes sweep the kernel's paths: GQA ratios 1/3/7, head dims 32/64/128 and 48 (float32 only: the bf16
kernel takes pairs of 16-lane channel blocks), query and key counts that are not multiples of the
64-query / 64-key blocks or of the 4-row register tile, a single query, queries that continue a
longer key history (Tq < Tk), batch > 1. Tolerances: float32 inputs 2e-5 absolute on outputs of
unit-variance values (float32 accumulation over <= 300 keys); bfloat16 inputs 1.5e-2 (P is rounded to
bf16 for P @ V, a relative 2^-9 per weight) and always below torch's own bf16 SDPA error x 2.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from oscar.kernels import cpu_attention as CA

HAVE_CC = bool(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"))
needs_kernel = pytest.mark.skipif(not HAVE_CC or os.environ.get("OSCAR_NATIVE") == "0"
                                  or os.environ.get("OSCAR_CPU_FLASH") == "0", reason="no native kernel here")

SHAPES = [  # (B, Hq, Hkv, Tq, Tk, D)
    (1, 9, 3, 100, 100, 64),
    (1, 7, 1, 65, 65, 64),
    (2, 8, 8, 33, 97, 128),
    (1, 3, 3, 1, 70, 32),
    (1, 14, 2, 200, 300, 64),
    (1, 4, 2, 129, 129, 32),
    (1, 2, 1, 5, 5, 48),
]


def reference(q, k, v, scale=None):
    """Dense float64 softmax attention, query i at position Tk - Tq + i."""
    B, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    K = k.double().repeat_interleave(H // Hkv, 1)
    V = v.double().repeat_interleave(H // Hkv, 1)
    s = q.double() @ K.transpose(-1, -2) * (scale if scale is not None else D ** -0.5)
    s = s.masked_fill(~torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq), float("-inf"))
    return torch.softmax(s, -1) @ V, torch.logsumexp(s, -1)


def inputs(shape, dtype, seed=0):
    B, H, Hkv, Tq, Tk, D = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Tq, D, generator=g) * 1.5
    k = torch.randn(B, Hkv, Tk, D, generator=g) + 0.3  # a common key direction, as real keys have
    v = torch.randn(B, Hkv, Tk, D, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES)
def test_float32_matches_float64_softmax(shape):
    q, k, v = inputs(shape, torch.float32)
    out, lse = CA.causal_attention(q, k, v)
    ro, rl = reference(q, k, v)
    assert out.dtype == lse.dtype == torch.float32
    assert (out.double() - ro).abs().max() < 2e-5
    assert (lse.double() - rl).abs().max() < 2e-5


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES)
def test_bfloat16_matches_float64_softmax_better_than_sdpa(shape):
    q, k, v = inputs(shape, torch.bfloat16, seed=1)
    out, lse = CA.causal_attention(q, k, v)
    ro, rl = reference(q, k, v)  # of the same bf16 values
    err = (out.double() - ro).abs().max().item()
    rep = q.shape[1] // k.shape[1]
    Tq, Tk = q.shape[2], k.shape[2]
    sd = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                        attn_mask=torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq))
    sdpa_err = (sd.double() - ro).abs().max().item()
    assert err < 1.5e-2 and err <= 2 * sdpa_err + 1e-6, (err, sdpa_err)
    assert (lse.double() - rl).abs().max() < 1e-4  # scores are exact products summed in float32


@needs_kernel
def test_scale_and_blocks_beyond_one_tile():
    """A custom scale; 300 queries over 300 keys cross several 64-query and 64-key blocks."""
    q, k, v = inputs((1, 6, 2, 300, 300, 64), torch.float32, seed=2)
    out, lse = CA.causal_attention(q, k, v, scale=0.3)
    ro, rl = reference(q, k, v, scale=0.3)
    assert (out.double() - ro).abs().max() < 2e-5 and (lse.double() - rl).abs().max() < 2e-5


@needs_kernel
def test_rows_attend_only_to_their_past():
    """Changing a future key/value changes no earlier output (causality, block edges included)."""
    q, k, v = inputs((1, 4, 2, 130, 130, 64), torch.float32, seed=3)
    out, _ = CA.causal_attention(q, k, v)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 70:] += 5.0
    v2[:, :, 70:] -= 3.0
    out2, _ = CA.causal_attention(q, k2, v2)
    assert torch.equal(out[:, :, :70], out2[:, :, :70])
    assert not torch.allclose(out[:, :, 70:], out2[:, :, 70:])


def test_unsupported_inputs_are_declined():
    q = torch.randn(1, 4, 8, 20)  # head_dim 20: not a multiple of 16
    assert not CA.supports(q, torch.randn(1, 2, 8, 20))
    q = torch.randn(1, 4, 8, 64, dtype=torch.float16)
    assert not CA.supports(q, torch.randn(1, 2, 8, 64, dtype=torch.float16))
    q = torch.randn(1, 4, 8, 64, requires_grad=True)
    with torch.enable_grad():  # (another test may leave grad mode off)
        assert not CA.supports(q, torch.randn(1, 2, 8, 64))
    assert not CA.supports(torch.randn(1, 4, 9, 64), torch.randn(1, 2, 8, 64))  # more queries than keys


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("OSCAR_CPU_FLASH", "0")
    assert not CA.available()
    assert not CA.supports(torch.randn(1, 4, 8, 64), torch.randn(1, 2, 8, 64))


def test_causal_mask_detection():
    Tq, Tk = 5, 9
    m = torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq)[None, None]
    assert CA.is_causal_mask(None, Tq, Tk) and CA.is_causal_mask(m.clone(), Tq, Tk)
    pad = m.clone()
    pad[..., 0] = False  # left padding: not plain causality
    assert not CA.is_causal_mask(pad, Tq, Tk)
    assert not CA.is_causal_mask(m.float(), Tq, Tk)
    assert not CA.is_causal_mask(m, Tq, Tk + 1)


@pytest.fixture(scope="module")
def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=192, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


@needs_kernel
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.25)])
def test_model_prefill_and_continuation_match_sdpa(tiny_model, dtype, tol):
    """The model through `native_prefill` against its own SDPA: a one-shot prefill of 150 tokens, and a
    prefill of 90 continued by 60 (the masked path), logits within tol (bf16: the model's own rounding)."""
    from transformers import DynamicCache

    model = tiny_model.to(dtype)
    ids = torch.randint(0, 300, (1, 150), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = model(input_ids=ids).logits.float()
        with CA.native_prefill(model):
            assert model.config._attn_implementation == CA.NAME
            one = model(input_ids=ids).logits.float()
            c = DynamicCache()
            model(input_ids=ids[:, :90], cache=c, use_cache=True)
            cont = model(input_ids=ids[:, 90:], cache=c, use_cache=True).logits.float()
        assert model.config._attn_implementation == "sdpa"  # restored
    assert (one - ref).abs().max() < tol
    assert (cont - ref[:, 90:]).abs().max() < tol
    model.float()


_CAPTURE = """
import json, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from oscar.kernels import cpu_attention as CA
from oscar.pipeline import capture as C

torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=300, hidden_size=192, intermediate_size=256, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=512, attn_implementation="sdpa")
model = LlamaForCausalLM(cfg).eval()
ids = torch.randint(0, 300, (2, 96), generator=torch.Generator().manual_seed(1))  # (B, T)
mask = torch.ones_like(ids)  # no padding: plain causality, where the native kernel applies
calls = []
kernel = CA.causal_attention
CA.causal_attention = lambda *a, **k: calls.append(1) or kernel(*a, **k)


def stats():
    cap = C.Capture(C.CaptureSpec(6, 2, 32, layers=(0, 1), sink=2, reservoir=0, seqs_per_block=2))
    C.install(model, "sdpa")
    cap.start_block(0)
    with torch.no_grad(), cap.batch(mask, seq_offset=0):
        C.base_model(model)(input_ids=ids, attention_mask=mask, use_cache=False)
    model.set_attn_implementation("sdpa")
    return {f"{l}.{k}": torch.as_tensor(v).double() for l, a in cap.finish_block().items() for k, v in a.items()}


plain, plain_calls, plain_inner = stats(), len(calls), C.native_attention()
from oscar.__main__ import build_parser, native_attention
native_attention(build_parser().parse_args(sys.argv[1:]))  # what `oscar <command>` does before running it
reg = stats()
diff = max(float(((plain[k] - reg[k]).abs() / reg[k].abs().max().clamp_min(1e-30)).max()) for k in plain
           if reg[k].numel())
print("CAPTURE", json.dumps({"plain_calls": plain_calls, "plain_sdpa": plain_inner is ALL_ATTENTION_FUNCTIONS["sdpa"],
                             "native": C.native_attention() is CA.attention_forward,
                             "calls": len(calls) - plain_calls, "rel_diff": diff}))
"""


@needs_kernel
@pytest.mark.parametrize("argv", [["calibrate", "--model", "smollm2-135m", "--store", "s.zarr"],
                                  ["run", "--out", "runs/x"]])
def test_calibration_runs_the_native_kernel_once_the_command_registers_it(tmp_path, argv):
    """The capture (pipeline/) imports no kernels: its sdpa inner attention is whatever transformers' registry holds
    under native_build.CPU_ATTENTION. A plain pipeline import, nothing registered, runs SDPA; after the `oscar`
    dispatcher's registration (calibrate, run) the same capture runs the native kernel, and both compute the same
    statistics (within float32 rounding of the attention outputs, relative 1e-4 of each array's largest entry)."""
    import json
    import subprocess
    import sys

    env = {**os.environ, "OSCAR_NATIVE": "force", "OSCAR_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-c", _CAPTURE, *argv], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.split("CAPTURE", 1)[1])
    assert got["plain_calls"] == 0 and got["plain_sdpa"]
    assert got["native"] and got["calls"] == 2  # one per layer of the forward
    assert got["rel_diff"] < 1e-4, got
