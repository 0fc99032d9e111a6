"""The paged INT2 latent cache (kernels/latent_paged.py): packed 2-bit history, decode in the absorbed form through
the latent kernel, against the simulator it must equal (kernels/latent.py `LatentSimCache`)."""

import os

import pytest
import torch

from oscar.common import OscarError
from oscar.kernels.latent import LatentSimCache
from oscar.kernels import latent_paged as LP
from oscar.kernels.latent_paged import LatentPagedCache, serve
from oscar.pipeline.calibrate import CalibConfig, calibrate
from oscar.pipeline.models import load_model
from oscar.stats.latent import LatentFitConfig, fit_latent

LATENT = ["tiny-glm5", "tiny-deepseek-v3"]


@pytest.fixture(scope="module", params=LATENT)
def fitted(request, tmp_path_factory):
    name = request.param
    store = str(tmp_path_factory.mktemp("lp") / "calib.zarr")
    calibrate(CalibConfig(model=name, store=store, seq_len=96, sink=4, seqs_per_block=1, tokens=96 * 2,
                          reservoir=32, threads=1), progress=False)
    model, tok, _ = load_model(name, latent=True)
    return name, model, tok, fit_latent(store, LatentFitConfig())


def _steps(model, cache, ids, n, ctx):
    """Logits of a prefill chunk and then `n` greedy decode steps, each step's token fed back."""
    out = []
    with torch.no_grad(), ctx:
        logits = model(ids, cache=cache, use_cache=True).logits[:, -1]  # (1, V)
        out.append(logits)
        for _ in range(n):
            nxt = logits.argmax(-1, keepdim=True)  # (1, 1)
            logits = model(nxt, cache=cache, use_cache=True).logits[:, -1]
            out.append(logits)
    return torch.stack(out)  # (n + 1, 1, V)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_paged_cache_decodes_as_the_simulator(fitted, kernels, monkeypatch):
    """Prefill 70 tokens (past GLM-5's top-k of 64: the decode gathers the selected tokens), then decode 12 steps
    that release pages to INT2 (sink 4, recent 16, pages of 16): every step's logits equal the simulator's, which
    expands the same INT2 history through kv_b_proj (float32: the absorbed form re-associates the products)."""
    if kernels == "triton" and os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    monkeypatch.setenv("OSCAR_KERNELS", kernels)
    name, model, tok, art = fitted
    ids = tok("The latent pages leave the recent window one by one. " * 12, return_tensors="pt").input_ids[:, :70]
    steps = 12 if kernels == "reference" else 3  # the interpreter runs a kernel launch in ~1 s per layer
    want = _steps(model, LatentSimCache(art, sink=4, recent=16), ids, steps, _null())
    cache = LatentPagedCache(art, sink=4, recent=16)
    calls = []
    real = LP.decode_inputs
    monkeypatch.setattr(LP, "decode_inputs", lambda *a: calls.append(a[1]) or real(*a))
    got = _steps(model, cache, ids, steps, serve(model, cache))
    L = len(cache.layers)
    assert len(calls) == steps * L  # every decode step of every layer read the storage, not expanded latents
    assert all((p is not None) == (name == "tiny-glm5") for p in calls)  # GLM-5's top-k gathered
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    layer = cache.layers[0]
    assert layer.n == 70 + steps and layer.codes.dtype == torch.uint8 and layer.codes.shape[1] == 256 // 4
    assert layer.n_quant == layer.lq.quantized_until(layer.n - 1, 4, 16)  # the last step's pages still owed
    exact = _steps(model, LatentSimCache(art, sink=1024), ids, steps, _null())
    assert not torch.allclose(got, exact, rtol=1e-4, atol=1e-4 * want.abs().max().item())  # INT2 showed


def test_generate_through_the_paged_cache(fitted):
    name, model, tok, art = fitted
    ids = tok("Two bits per latent value, served. " * 8, return_tensors="pt").input_ids
    cache = LatentPagedCache(art, sink=4, recent=16)
    with serve(model, cache):
        out = model.generate(ids, cache=cache, max_new_tokens=6, do_sample=False)
    want = model.generate(ids, cache=LatentSimCache(art, sink=4, recent=16), max_new_tokens=6, do_sample=False)
    assert torch.equal(out, want)
    assert model.config._attn_implementation != "oscar_latent"  # restored
    with pytest.raises(OscarError, match="holds one sequence"):
        with serve(model, LatentPagedCache(art)) as c:
            model(ids.repeat(2, 1), cache=c, use_cache=True)


def test_outside_serve_a_step_reads_the_whole_history_and_the_backend_builds_it(fitted):
    """Without `serve` the model's own attention runs: the cache then hands it the whole history (never the step's
    latent alone); the cache family builds the paged cache by name."""
    from oscar.kernels.backends import CacheSpec, make_cache
    from oscar.kernels.protocol import Protocol

    name, model, tok, art = fitted
    ids = tok("Unserved steps still see the history. " * 8, return_tensors="pt").input_ids[:, :40]
    cache = make_cache(CacheSpec.one(art, Protocol("p", sink=4, recent=16)), "latent-paged")
    assert isinstance(cache, LatentPagedCache)
    got = _steps(model, cache, ids, 3, _null())
    want = _steps(model, LatentSimCache(art, sink=4, recent=16), ids, 3, _null())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    with pytest.raises(OscarError, match="no prefill handed over"):
        make_cache(CacheSpec.one(art, Protocol("p", sink=4, recent=16), held=range(0, 1)), "latent-paged")
