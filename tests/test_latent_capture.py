"""The latent (MLA) capture against brute force, and the latent store on every path: one process, block FP8 as its
twin, two Ray stages equal to one process; per-head readers refuse a latent store by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oscar.common import OscarError
from oscar.pipeline.calibrate import CalibConfig, calibrate
from oscar.pipeline.models import load_model, resolve_model
from oscar.pipeline.store import FORMAT_LATENT, CalibStore, latent_layer_arrays, reduce
from oscar.stats.reduce import open_store
from helpers import fp8 as fp8_ckpt
from helpers.cluster import assert_same_store

SINK = 4


def _opts(model, store, **kw):
    # threads=1: float32 summation order in the MoE layers depends on the torch thread count; each Ray stage actor
    # runs one thread. 3 blocks of one 80-token sequence: past the GLM-5 preset's DSA top-k of 64
    return dict(model=model, store=str(store), seq_len=80, sink=SINK, seqs_per_block=1, tokens=80 * 3, reservoir=8,
                batch_size=1, threads=1) | kw


@pytest.fixture(scope="module", params=["tiny-glm5", "tiny-deepseek-v3"])
def eager_store(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("latent") / "calib.zarr"
    calibrate(CalibConfig(**_opts(request.param, path, attn_implementation="eager")), progress=False)
    return request.param, path


def _brute(name: str, tokens: np.ndarray) -> dict[int, dict[str, np.ndarray]]:
    """Every latent statistic from the model's own eager forward: the attention module's input hidden states, its
    projections applied by hand, and the attention probabilities transformers returns (the DSA top-k included)."""
    model, _, info = load_model(name, attn_implementation="eager", latent=True)
    lat = info.latent
    r, nope, H = lat["kv_lora_rank"], lat["nope_dim"], lat["num_heads"]
    out: dict[int, dict[str, np.ndarray]] = {}
    inputs: dict[int, torch.Tensor] = {}
    for l, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_pre_hook(
            lambda m, args, kwargs, l=l: inputs.__setitem__(l, kwargs["hidden_states"]), with_kwargs=True)
    torch.set_grad_enabled(False)
    for ids in tokens.reshape(-1, tokens.shape[-1]):
        res = model(torch.from_numpy(ids.astype(np.int64))[None], output_attentions=True, use_cache=False)
        for l, layer in enumerate(model.model.layers):
            a = layer.self_attn
            x = inputs[l][0]                                                           # (T, hidden)
            c = a.kv_a_layernorm(a.kv_a_proj_with_mqa(x)[:, :r]).double()[SINK:]       # (n, r)
            q = a.q_b_proj(a.q_a_layernorm(a.q_a_proj(x))).view(x.shape[0], H, -1)     # (T, H, nope + rope)
            w = a.kv_b_proj.weight.double().view(H, -1, r)                             # (H, nope + v, r)
            qa = torch.einsum("thd,hdr->htr", q[SINK:, :, :nope].double(), w[:, :nope])  # (H, n, r)
            S = res.attentions[l][0].double()                                          # (H, T, T) probabilities
            c_all = a.kv_a_layernorm(a.kv_a_proj_with_mqa(x)[:, :r]).double()          # (T, r)
            ol = (S @ c_all)[:, SINK:]                                                 # (H, n, r)
            uv = torch.einsum("hvr,hvs->rs", w[:, nope:], w[:, nope:])
            n = c.shape[0]
            acc = {"c_gram": c.T @ c, "c_sum": c.sum(0), "c_m3": (c ** 3).sum(0), "c_m4": (c ** 4).sum(0),
                   "qa_gram": torch.einsum("htr,hts->rs", qa, qa), "ol_gram": torch.einsum("htr,hts->rs", ol, ol),
                   "uv_gram": n * uv, "count": torch.tensor(n), "q_count": torch.tensor(n * H)}
            o = out.setdefault(l, {})
            for k, v in acc.items():
                o[k] = o.get(k, 0) + v.numpy()
            o["c_absmax"] = np.maximum(o.get("c_absmax", 0), c.abs().amax(0).numpy())
    torch.set_grad_enabled(True)
    return out


def test_latent_statistics_equal_brute_force(eager_store):
    name, path = eager_store
    st = CalibStore(path)
    assert st.meta.format == FORMAT_LATENT and st.done().all()
    assert set(st.spec) == set(latent_layer_arrays(256, 8))
    want = _brute(name, st.group["tokens"][:])
    for l in range(st.num_layers):
        for k, v in want[l].items():
            got = reduce(st, k, [l])[l]
            # exact float64 sums of the same float32 rows, except õ: `attend` multiplies S by the latent in float32
            # (relative error <= T x 2^-24 ~ 5e-6 at T = 80), brute force in float64
            rtol = 1e-4 if k == "ol_gram" else 1e-9
            np.testing.assert_allclose(got, v, rtol=rtol, atol=rtol * np.abs(v).max(), err_msg=f"layer {l} {k}")
    res = reduce(st, "c_res", [0])[0]
    assert res.shape[-1] == 256 and np.isfinite(res).all() and np.abs(res).sum() > 0


def test_per_head_readers_refuse_a_latent_store(eager_store):
    _, path = eager_store
    with pytest.raises(OscarError, match="latent"):
        open_store(str(path))


@pytest.fixture(scope="module")
def glm5_store(tmp_path_factory):
    from oscar.kernels import cpu_attention

    cpu_attention.register()  # the attention the Ray stage actors' capture runs (they register it too)
    path = tmp_path_factory.mktemp("glm5") / "calib.zarr"
    calibrate(CalibConfig(**_opts("tiny-glm5", path)), progress=False)
    return path


def _same_statistics(a_path, b_path, attrs: bool = True):
    """Every array bit for bit (and the attributes, unless the stores come from two checkpoints)."""
    assert CalibStore(str(a_path)).meta.format == CalibStore(str(b_path)).meta.format == FORMAT_LATENT
    assert_same_store(str(a_path), str(b_path), attrs=attrs)


@pytest.mark.slow
def test_block_fp8_calibrates_as_its_twin(tmp_path):
    fp8, twin = str(tmp_path / "fp8"), str(tmp_path / "twin")
    fp8_ckpt.write_pair(resolve_model("tiny-glm5"), fp8, twin)
    calibrate(CalibConfig(**_opts(fp8, tmp_path / "fp8.zarr", tokens=80)), progress=False)
    calibrate(CalibConfig(**_opts(twin, tmp_path / "twin.zarr", tokens=80)), progress=False)
    _same_statistics(tmp_path / "twin.zarr", tmp_path / "fp8.zarr", attrs=False)  # the checkpoints' configs differ


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(600)
def test_two_ray_stages_equal_one_process(glm5_store, tmp_path):
    """tiny-glm5 on 2 layer-range stages of a real local Ray cluster (the boundary before layer 2: layer 1 reuses
    layer 0's DSA top-k): the store equals the single process's bit for bit."""
    from oscar.cluster.localray import LocalHead
    from oscar.cluster.pipeline import ClusterConfig, calibrate_on_ray

    o = _opts("tiny-glm5", tmp_path / "ray.zarr")
    o.pop("threads")
    with LocalHead(num_cpus=4, object_store_mb=256).session() as h:  # loopback-only, private token
        import ray

        ray.init(address=h.address, log_to_driver=False)
        try:
            rep = calibrate_on_ray(CalibConfig(**o), ClusterConfig(stages=2, layers="0:2,2:3"), address=h.address,
                                   progress=False)
        finally:
            ray.shutdown()
    assert len(rep.stages) == 2 and rep.block_retries == 0
    _same_statistics(glm5_store, tmp_path / "ray.zarr")
