"""Attention capture vs a brute-force float64 recomputation (tests/helpers/capture_reference.py).

Small random-init models built here: Llama with GQA, Qwen3 with q/k-norm and one KV head,
GLM-4-MoE with partial RoPE, qkv bias, q/k-norm and routed experts. Models run in float64
so that the capture and the reference agree to 1e-10 relative.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oscar.pipeline import capture as C
from helpers import capture_reference as ref

VOCAB, make_model, batch_data = ref.VOCAB, ref.make_model, ref.batch_data


def run_capture(model, tokens, mask, *, impl="sdpa", sink=2, reservoir=5, seed=3, block=0, batch_size=2, layers=None):
    """Capture one block through the registered attention function, batch by batch."""
    cfg = model.config
    hkv = cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    layers = tuple(range(cfg.num_hidden_layers)) if layers is None else tuple(layers)
    spec = C.CaptureSpec(cfg.num_attention_heads, hkv, d, layers=layers, sink=sink, reservoir=reservoir,
                         seed=seed, seqs_per_block=tokens.shape[0])
    C.install(model, impl)
    cap = C.Capture(spec)
    cap.start_block(block)
    for s0 in range(0, tokens.shape[0], batch_size):
        with cap.batch(mask[s0:s0 + batch_size], seq_offset=s0):
            C.base_model(model)(input_ids=tokens[s0:s0 + batch_size], attention_mask=mask[s0:s0 + batch_size],
                                use_cache=False)
    model.set_attn_implementation(impl)
    return cap.finish_block()


@pytest.mark.parametrize("kind,impl,ops", [("llama", "sdpa", "native"), ("llama", "eager", "native"),
                                           ("qwen3", "sdpa", "native"), ("glm4moe", "sdpa", "native"),
                                           ("glm4moe", "eager", "native"), ("llama", "sdpa", "torch"),
                                           ("glm4moe", "sdpa", "torch")])
def test_capture_matches_bruteforce(kind, impl, ops, monkeypatch):
    """ops: the C kernel where it can build (pipeline/native.py), or the torch-ops path forced."""
    if ops == "torch":
        monkeypatch.setattr(C, "_native_ok", lambda src: False)
    model = make_model(kind)
    tokens, mask = batch_data()
    got = run_capture(model, tokens, mask, impl=impl, batch_size=2)
    model.set_attn_implementation(impl)
    # transformers' eager attention takes its softmax in float32 even for a float64 model
    sm = torch.float32 if impl == "eager" else torch.float64
    want = ref.block_reference(model, tokens, mask, layers=range(model.config.num_hidden_layers), sink=2,
                               reservoir=5, seed=3, block=0, softmax_dtype=sm)
    for l, w in want.items():
        bad = ref.compare(got[l], w)
        assert not bad, f"{kind}/{impl} layer {l}: {bad}"
        # sink and padding exclusion: 3 seqs of 13 with 0, 4, 9 pad tokens and sink 2
        assert got[l]["kv_count"] == (13 - 2) + (9 - 2) + (4 - 2)
        assert got[l]["q_count"] == got[l]["kv_count"] * model.config.num_attention_heads // model.config.num_key_value_heads


def test_capture_does_not_change_the_model():
    """Same hidden states with the capturing wrapper as with the plain implementation (mask paired too)."""
    model = make_model("llama")
    tokens, mask = batch_data()
    base = C.base_model(model)
    for impl in ("sdpa", "eager"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            plain = base(input_ids=tokens, attention_mask=mask, use_cache=False).last_hidden_state
        C.install(model, impl)
        cap = C.Capture(C.CaptureSpec(6, 2, 10, layers=(0, 1, 2), sink=0, reservoir=0, seqs_per_block=3))
        cap.start_block(0)
        with cap.batch(mask, 0):
            wrapped = base(input_ids=tokens, attention_mask=mask, use_cache=False).last_hidden_state
        m = mask.bool()
        assert torch.equal(plain[m], wrapped[m]), impl
        # the capture is inert outside `batch()`
        with torch.no_grad():
            again = base(input_ids=tokens, attention_mask=mask, use_cache=False).last_hidden_state
        assert torch.equal(again[m], plain[m])
        model.set_attn_implementation(impl)


def test_reservoir_and_stats_independent_of_batch_size():
    model = make_model("qwen3")
    tokens, mask = batch_data(S=4, pad=(0, 3, 0, 7))
    a = run_capture(model, tokens, mask, batch_size=1, reservoir=7)
    b = run_capture(model, tokens, mask, batch_size=3, reservoir=7)
    for l in a:
        for name in a[l]:
            if name.endswith("_res") or "count" in name or name == "nonfinite":
                assert np.array_equal(a[l][name], b[l][name]), (l, name)
            else:
                assert ref.rel_err(a[l][name], b[l][name]) < 1e-12, (l, name)


def test_layer_subset_and_partial_stack():
    """A stage owning layers (1, 2) records only those, also when it runs only its own decoder layers."""
    model = make_model("glm4moe")
    tokens, mask = batch_data()
    full = run_capture(model, tokens, mask, batch_size=3)
    sub = run_capture(model, tokens, mask, batch_size=3, layers=(1, 2))
    assert set(sub) == {1, 2}
    for l in (1, 2):
        for name in sub[l]:
            assert np.array_equal(sub[l][name], full[l][name]), (l, name)

    # Run decoder layers 1..2 alone from the hidden states layer 0 produced (what a Ray stage does).
    from transformers.masking_utils import create_causal_mask

    base = C.base_model(model)
    with torch.no_grad():
        h1 = base(input_ids=tokens, attention_mask=mask, output_hidden_states=True, use_cache=False).hidden_states[1]
    C.install(model, "sdpa")
    spec = C.CaptureSpec(4, 2, 12, layers=(1, 2), sink=2, reservoir=5, seed=3, seqs_per_block=3)
    cap = C.Capture(spec)
    cap.start_block(0)
    pos = torch.arange(tokens.shape[1])[None]
    with cap.batch(mask, 0):
        cm = create_causal_mask(config=model.config, inputs_embeds=h1, attention_mask=mask, cache=None,
                                position_ids=pos)
        pe = base.rotary_emb(h1, pos)
        h = h1
        for layer in base.layers[1:3]:
            h = layer(h, attention_mask=cm, position_ids=pos, position_embeddings=pe)
    stage = cap.finish_block()
    model.set_attn_implementation("sdpa")
    for l in (1, 2):
        for name in stage[l]:
            assert ref.rel_err(stage[l][name], full[l][name]) < 1e-12, (l, name)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_nonfinite_rows_are_counted_and_excluded(impl):
    model = make_model("llama")
    tokens, mask = batch_data(pad=(0, 0, 0))
    bad_tok = VOCAB - 1
    tokens[tokens == bad_tok] = 0
    tokens[1, -1] = bad_tok                      # last token of sequence 1
    with torch.no_grad():
        model.model.embed_tokens.weight[bad_tok] = torch.nan
    got = run_capture(model, tokens, mask, impl=impl)
    model.set_attn_implementation(impl)
    with torch.no_grad():  # which rows the model itself turned non-finite (o shows in the layer output)
        hs = C.base_model(model)(input_ids=tokens, attention_mask=mask, output_hidden_states=True,
                                 use_cache=False).hidden_states
    T, sink = tokens.shape[1], 2
    for l, r in got.items():
        for name, a in r.items():
            assert np.isfinite(a).all(), (l, name)
        bad = ~torch.isfinite(hs[l + 1]).all(-1)[:, sink:]          # (S, T - sink)
        assert bad[1, -1] and not bad[[0, 2]].any()
        assert r["nonfinite"] == int(bad.sum()) > 0, (l, r["nonfinite"])
        assert r["kv_count"] == 3 * (T - sink) - r["nonfinite"]
    sm = torch.float32 if impl == "eager" else torch.float64
    want = ref.block_reference(model, tokens, mask, layers=range(3), sink=2, reservoir=5, seed=3, block=0,
                               softmax_dtype=sm, check_identity=False)
    for l, w in want.items():  # the remaining rows are exactly the reference's
        assert not ref.compare(got[l], w), (l, ref.compare(got[l], w))


def test_register_errors_and_idempotence():
    from oscar.common import OscarError

    assert C.register("sdpa") == C.register("oscar_capture_sdpa") == "oscar_capture_sdpa"
    with pytest.raises(OscarError, match="unknown attention implementation"):
        C.register("no_such_attention")
    model = make_model("llama")
    spec = C.CaptureSpec(6, 2, 10, layers=(0, 1, 2), seqs_per_block=1)
    cap = C.Capture(spec)
    cap.start_block(0)
    model.set_attn_implementation("sdpa")  # not the capturing wrapper: nothing recorded
    tokens, mask = batch_data(S=1)
    with cap.batch(mask, 0):
        C.base_model(model)(input_ids=tokens, attention_mask=mask, use_cache=False)
    with pytest.raises(OscarError, match="never reached layers"):
        cap.finish_block()
