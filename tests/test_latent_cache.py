"""The INT2 latent cache: the absorbed-form reference against transformers' own eager MLA attention, the rotation
alone changing nothing, the simulator cache's history against the reference, generate() through it."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from oscar.kernels.latent import LatentLayerQuant, LatentSimCache, absorbed_attention, up_projections
from oscar.pipeline.calibrate import CalibConfig, calibrate
from oscar.pipeline.latent import dsa_mask
from oscar.pipeline.models import load_model
from oscar.stats.latent import LatentFitConfig, fit_latent

LATENT = ["tiny-glm5", "tiny-deepseek-v3"]
SEEN: list[dict] = []
LATENTS: dict[int, torch.Tensor] = {}


def _recording(module, query, key, value, attention_mask, **kw):
    """transformers' own eager MLA attention, recording what it read and returned (the test's oracle)."""
    indices = kw.pop("indices", None)  # GLM-5's DSA top-k, handed to any custom attention function
    if indices is not None:
        attention_mask = dsa_mask(attention_mask, indices, query.dtype)
    fn = __import__(type(module).__module__, fromlist=["eager_attention_forward"]).eager_attention_forward
    out, w = fn(module, query, key, value, attention_mask, **kw)
    SEEN.append({"layer": module.layer_idx, "q": query, "k_pe": key[:, 0, :, module.qk_nope_head_dim:],
                 "mask": attention_mask, "out": out, "scale": kw["scaling"], "module": module,
                 "c": LATENTS.get(module.layer_idx)})
    return out, w


AttentionInterface.register("oscar_test_record", _recording)
AttentionMaskInterface.register("oscar_test_record", ALL_MASK_ATTENTION_FUNCTIONS["eager"])


def _model(name):
    model, tok, info = load_model(name, attn_implementation="eager", latent=True)
    model.set_attn_implementation("oscar_test_record")
    for m in model.modules():
        if hasattr(m, "kv_a_layernorm") and hasattr(m, "kv_b_proj"):
            m.kv_a_layernorm.register_forward_hook(lambda mod, i, o, l=m.layer_idx: LATENTS.__setitem__(l, o.detach()))
    return model, tok, info


def _random_orthogonal(r: int, seed: int) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(r, r, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return q.float()


def _reference(rec: dict, rot: torch.Tensor, mean: torch.Tensor, c_rot: torch.Tensor | None = None) -> torch.Tensor:
    m = rec["module"]
    w_uk, w_uv = up_projections(m.kv_b_proj.weight.detach(), m.num_heads, m.qk_nope_head_dim, m.v_head_dim)
    c = rec["c"]                                                             # (B, T, r) the prompt's latents
    cr = ((c.float() - mean) @ rot) if c_rot is None else c_rot
    return absorbed_attention(rec["q"], cr, rec["k_pe"], w_uk, w_uv, rot, mean, rec["scale"], rec["mask"])


@pytest.mark.parametrize("name", LATENT)
def test_absorbed_form_equals_eager_attention_and_the_rotation_changes_nothing(name):
    model, tok, info = _model(name)
    ids = tok("Latent caches keep one vector per token. " * 12, return_tensors="pt").input_ids[:, :100]  # (1, 100)
    SEEN.clear()
    with torch.no_grad():
        model(ids, use_cache=False)
    assert len(SEEN) == info.num_layers
    r = info.latent["kv_lora_rank"]
    for rec in SEEN:
        out = rec["out"].float()                                             # (B, T, H, v) eager's o_proj input
        # float32 sums over r = 256 latent (or nope = 32) products in another order: |error| <= ~r x 2^-24 x |terms|
        tol = dict(rtol=1e-4, atol=1e-4 * out.abs().max().item())
        plain = _reference(rec, torch.eye(r), torch.zeros(r))
        torch.testing.assert_close(plain, out, **tol)
        rotated = _reference(rec, _random_orthogonal(r, rec["layer"]), torch.randn(r) * 0.1)
        torch.testing.assert_close(rotated, out, **tol)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    store = tmp_path_factory.mktemp("lc") / "calib.zarr"
    calibrate(CalibConfig(model="tiny-glm5", store=str(store), seq_len=96, sink=4, seqs_per_block=1, tokens=96 * 2,
                          reservoir=32, threads=1), progress=False)
    return fit_latent(str(store), LatentFitConfig())


def test_nothing_quantized_is_the_exact_cache(artifact):
    model, tok, _ = load_model("tiny-glm5", latent=True)
    ids = tok("An exact window. " * 20, return_tensors="pt").input_ids[:, :90]
    with torch.no_grad():
        ref = model(ids).logits
        got = model(ids, cache=LatentSimCache(artifact, sink=1024)).logits  # every token in the sink
    assert torch.equal(ref, got)


def test_history_is_served_as_the_reference_reads_it(artifact):
    """Prefill 90 tokens, decode one: the decode step's attention equals the absorbed reference over the cache's
    contents, sink 8 exact, [8, 64) as their INT2 round trip (pages of 16 leave a recent window of 16), the rest exact."""
    model, tok, info = _model("tiny-glm5")
    ids = tok("The history is stored in two bits per value. " * 10, return_tensors="pt").input_ids[:, :90]
    cache = LatentSimCache(artifact, sink=8, recent=16)
    with torch.no_grad():
        SEEN.clear()
        model(ids, cache=cache, use_cache=True)
        prompt_c = {rec["layer"]: rec["c"] for rec in SEEN}
        SEEN.clear()
        model(torch.tensor([[42]]), cache=cache, use_cache=True)
    for rec in SEEN:
        l = rec["layer"]
        lq = LatentLayerQuant(artifact, l)
        c = torch.cat([prompt_c[l], rec["c"]], dim=1)[0]                     # (91, r) every token's exact latent
        exact = (c.float() - lq.mean) @ lq.rot
        b = lq.quantized_until(91, 8, 16)
        assert b == 72  # 91 - 16 = 75 -> whole pages from 8: 8 + 64
        c_rot = torch.cat([exact[:8], lq.rotated(c[8:b]), exact[b:]])[None]  # what the INT2 cache stores, decoded
        want = _reference(rec, lq.rot, lq.mean, c_rot)
        out = rec["out"].float()
        torch.testing.assert_close(want, out, rtol=1e-4, atol=1e-4 * out.abs().max().item())
        assert not torch.allclose(_reference(rec, lq.rot, lq.mean, exact[None]), out, atol=1e-6)  # INT2 showed


def test_generate_through_the_latent_cache(artifact):
    model, tok, _ = load_model("tiny-glm5", latent=True)
    ids = tok("Two bits per latent value. " * 8, return_tensors="pt").input_ids
    out = model.generate(ids, cache=LatentSimCache(artifact, sink=4, recent=16), max_new_tokens=6,
                         do_sample=False)
    assert out.shape[1] == ids.shape[1] + 6


def test_the_latent_backend_of_the_cache_family(artifact):
    from oscar.kernels.backends import CacheSpec, make_cache
    from oscar.kernels.protocol import Protocol
    from oscar.stats.artifact import identity_artifact
    from oscar.modelconfig import preset_config
    from oscar.common import OscarError

    model, tok, _ = load_model("tiny-glm5", latent=True)
    ids = tok("One interface for every cache. " * 8, return_tensors="pt").input_ids
    cache = make_cache(CacheSpec.one(artifact, Protocol("serving", sink=4, recent=16)), "latent")
    assert isinstance(cache, LatentSimCache)
    want = model.generate(ids, cache=LatentSimCache(artifact, sink=4, recent=16), max_new_tokens=4, do_sample=False)
    assert torch.equal(model.generate(ids, cache=cache, max_new_tokens=4, do_sample=False), want)
    with pytest.raises(OscarError, match="the simulate backend serves per-head K/V artifacts; got a LatentArtifact"):
        make_cache(CacheSpec.one(artifact, Protocol("serving")), "simulate")
    with pytest.raises(OscarError, match="the latent backend serves latent .MLA. artifacts; got a Artifact"):
        make_cache(CacheSpec.one(identity_artifact(preset_config("tiny-llama")), Protocol("serving")), "latent")
