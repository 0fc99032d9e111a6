"""oscar-ref: every step of the published recipe against numbers worked out by hand.

Expected values are literals derived in the comments (not re-computed with the code
under test); inputs are tiny so each number can be checked on paper.
"""

import math

import pytest
import torch

from oscar.common import OscarError
from oscar.quant import choose_qparams, dequantize, fake_quant, quantize
from oscar.stats import reference_recipe as rr
from oscar.stats.artifact import QuantConfig, identity_artifact, load_artifact, save_artifact

from helpers.synthetic_store import SynthSpec, write_synthetic_store


T = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
S2 = 1 / math.sqrt(2)


# --- targets -------------------------------------------------------------------------------

def test_key_target_pools_blocks_and_group():
    # two blocks, one KV head: Σ q qᵀ = [[2,0],[0,4]] + [[2,2],[2,0]] = [[4,2],[2,4]] over 2 + 2 rows
    q_gram = T([[[[2, 0], [0, 4]]], [[[2, 2], [2, 0]]]])  # (B=2, H=1, 2, 2)
    C = rr.key_target(q_gram, torch.tensor([2, 2]))
    assert torch.allclose(C, T([[[1.0, 0.5], [0.5, 1.0]]]), atol=1e-15)


def test_value_target_weights_normalised_to_mean_one():
    # C_Q = diag(1, 4); keys (1,0), (0,1), (1,1) -> w = kᵀ C_Q k = 1, 4, 5 (mean 10/3)
    # values (1,0), (0,1), (1,-1):
    #   Σ w v vᵀ = 1[[1,0],[0,0]] + 4[[0,0],[0,1]] + 5[[1,-1],[-1,1]] = [[6,-5],[-5,9]], Σ w = 10
    #   -> C_V = [[0.6,-0.5],[-0.5,0.9]] = (1/3) Σ (w/mean w) v vᵀ
    # stored as two blocks: tokens 1-2 (vw [[1,0],[0,4]], Σw 5), token 3 (vw [[5,-5],[-5,5]], Σw 5)
    vw = T([[[[1, 0], [0, 4]]], [[[5, -5], [-5, 5]]]])
    C = rr.value_target(vw, T([[5.0], [5.0]]))
    assert torch.allclose(C, T([[[0.6, -0.5], [-0.5, 0.9]]]), atol=1e-15)
    # an (unnormalised) rescaling of every w leaves the target unchanged
    assert torch.allclose(rr.value_target(vw * 7, T([[35.0], [35.0]])), C, atol=1e-15)


def test_targets_refuse_empty():
    with pytest.raises(OscarError, match="no counted query rows"):
        rr.key_target(torch.zeros(1, 1, 2, 2), torch.tensor([0]))
    with pytest.raises(OscarError, match="Σ w_t must be > 0"):
        rr.value_target(torch.zeros(1, 2, 2, 2), T([[1.0, 0.0]]))


def test_layer_average_over_heads():
    C = T([[[1, 1], [1, 3]], [[1, -1], [-1, 3]]])
    assert torch.equal(rr.layer_average(C), T([[1, 0], [0, 3]]))


# --- ordering ------------------------------------------------------------------------------

def test_eig_ascending():
    w, U = rr.eig_ascending(T([[3, 0, 0, 0], [0, 1, 0, 0], [0, 0, 4, 0], [0, 0, 0, 2]]))
    assert torch.equal(w, T([1, 2, 3, 4]))
    # columns: e1 (λ=1), e3 (λ=2), e0 (λ=3), e2 (λ=4), up to sign
    assert torch.equal(U.abs(), T([[0, 0, 1, 0], [1, 0, 0, 0], [0, 0, 0, 1], [0, 1, 0, 0]]))


def test_bitrev_and_permutation():
    assert rr.bitrev(8).tolist() == [0, 4, 2, 6, 1, 5, 3, 7]
    # ascending eigenvalues: desc = [7..0], perm[j] = 7 - bitrev(j)
    assert rr.reference_perm(T([1, 2, 3, 4, 5, 6, 7, 8])).tolist() == [7, 3, 5, 1, 6, 2, 4, 0]
    # already descending: desc = identity, perm = bitrev
    assert rr.reference_perm(T([4, 3, 2, 1])).tolist() == [0, 2, 1, 3]
    x = T([[10, 11, 12, 13]])
    assert (x @ rr.perm_matrix(torch.tensor([3, 1, 2, 0]))).tolist() == [[13, 11, 12, 10]]


# R for C = diag(3, 1, 4, 2) (D = 4):
#   U columns e1, e3, e0, e2 (eigenvalues 1, 2, 3, 4); H = ½[[1,1,1,1],[1,-1,1,-1],[1,1,-1,-1],[1,-1,-1,1]]
#   U H: row i = H row j where U[i, j] = 1 -> rows H2, H0, H3, H1
#   perm = desc[bitrev] = [3,2,1,0][[0,2,1,3]] = [3,1,2,0] -> R columns = (U H) columns 3, 1, 2, 0
R4 = 0.5 * T([[-1, 1, -1, 1],
              [1, 1, 1, 1],
              [1, -1, -1, 1],
              [-1, -1, 1, 1]])


def test_compose_matches_hand_computed():
    U = T([[0, 0, 1, 0], [1, 0, 0, 0], [0, 0, 0, 1], [0, 1, 0, 0]])
    R = rr.compose(U, T([1, 2, 3, 4]))
    assert torch.allclose(R, R4, atol=1e-15)
    assert torch.allclose(R @ R.T, torch.eye(4, dtype=torch.float64), atol=1e-14)


def test_reference_rotation_end_to_end_diag():
    R, w = rr.reference_rotation(T([[3, 0, 0, 0], [0, 1, 0, 0], [0, 0, 4, 0], [0, 0, 0, 2]]))
    assert torch.equal(w, T([1, 2, 3, 4]))
    assert torch.allclose(R, R4, atol=1e-15)


def test_hadamard_needs_power_of_two():
    assert torch.allclose(rr.hadamard(2), S2 * T([[1, 1], [1, -1]]), atol=1e-15)
    with pytest.raises(OscarError, match="power-of-two head_dim"):
        rr.hadamard(96)


def test_layer_rotations_shared_per_layer():
    # keys: head 0 [[1,1],[1,3]], head 1 [[1,-1],[-1,3]] (q_gram / q_count 2) -> average diag(1, 3)
    q_gram = T([[[[2, 2], [2, 6]], [[2, -2], [-2, 6]]]])  # (B=1, H=2, 2, 2)
    # values: head 0 C_V = [[0.6,-0.5],[-0.5,0.9]] (test above), head 1 its mirror [[0.6,0.5],[0.5,0.9]]
    vw = T([[[[1, 0], [0, 4]], [[1, 0], [0, 4]]], [[[5, -5], [-5, 5]], [[5, 5], [5, 5]]]])  # (B=2, H=2, 2, 2)
    w_sum = T([[5, 5], [5, 5]])
    ref = rr.layer_rotations(q_gram, torch.tensor([2]), vw, w_sum)
    # averages diag(1, 3) and diag(0.6, 0.9): U = I, eigenvalues ascending, desc = [1, 0],
    # bitrev(2) = [0, 1] -> perm [1, 0]: R = H with its columns swapped = (1/√2)[[1, 1], [-1, 1]]
    want = S2 * T([[1, 1], [-1, 1]])
    assert torch.allclose(ref.rot_k, want, atol=1e-15) and torch.allclose(ref.rot_v, want, atol=1e-15)
    assert torch.allclose(ref.eig_k, T([1, 3])) and torch.allclose(ref.eig_v, T([0.6, 0.9]))


# --- clipping and quantization ---------------------------------------------------------------

def test_row_quantile_clip_and_float32_minmax():
    spec = rr.reference_spec()
    x = torch.tensor([[-4.0, -1, 0, 1, 2, 3, 5, 12]])  # one token row, D = 8
    # |x| sorted 0,1,1,2,3,4,5,12; 0.96-quantile at position 0.96*7 = 6.72 -> 5 + 0.72*(12-5) = 10.04
    # clamp to ±10.04 -> min -4, max 10.04; scale = 14.04/3 = 4.68, zero = -4
    scale, zero = choose_qparams(x, spec, rr.CLIP_K)
    assert scale.dtype == torch.float32 and zero.dtype == torch.float32 and scale.shape == (1, 1)
    assert abs(scale.item() - 4.68) < 1e-6 and zero.item() == -4.0  # fp16 would store 4.6796875
    # codes floor((x + 4)/4.68 + 0.5), clamped to [0, 3]
    codes = quantize(x, scale, zero, spec)
    assert codes.tolist() == [[0, 1, 1, 1, 1, 1, 2, 3]]
    xh = dequantize(codes, scale, zero, spec)
    assert torch.allclose(xh, torch.tensor([[-4.0, 0.68, 0.68, 0.68, 0.68, 0.68, 5.36, 10.04]]), atol=1e-5)
    assert torch.allclose(fake_quant(x, spec, rr.CLIP_K), xh, atol=0)
    # value ratio 0.92: position 6.44 -> 5 + 0.44*7 = 8.08; scale = 12.08/3
    scale_v, zero_v = choose_qparams(x, spec, rr.CLIP_V)
    assert abs(scale_v.item() - 12.08 / 3) < 1e-6 and zero_v.item() == -4.0


def test_per_token_and_head_over_whole_head_dim():
    spec = rr.reference_spec()
    x = torch.zeros(1, 2, 3, 8)  # (B, Hkv, T, D)
    x[0, 1, 2] = torch.tensor([0.0, 1, 2, 3, 4, 5, 6, 10])
    # |row| quantile 0.96: 6 + 0.72*4 = 8.88 -> [0, 8.88], scale 2.96 for that token and head only
    scale, zero = choose_qparams(x, spec, rr.CLIP_K)
    assert scale.shape == (1, 2, 3, 1)
    assert abs(scale[0, 1, 2, 0].item() - 2.96) < 1e-6
    assert torch.all(scale.flatten()[:-1] == torch.tensor(1e-8, dtype=torch.float32))  # constant rows
    assert quantize(x, scale, zero, spec)[0, 1, 2].tolist() == [0, 0, 1, 1, 1, 2, 2, 3]


def test_bits_per_element():
    spec = rr.reference_spec()
    assert spec.bits_per_element(128) == 2.5  # 2 + 2*32/128
    assert spec.bits_per_element(64) == 3.0  # SmolLM2: 2 + 2*32/64


def test_reference_quant_config_and_artifact_round_trip(tmp_path):
    q = rr.reference_quant_config()
    assert (q.sink, q.recent, q.page_size, q.bits, q.group_size) == (64, 256, 8, 2, None)
    assert q.key_spec(64) == rr.reference_spec() and q.value_spec(64) == rr.reference_spec()
    from transformers import LlamaConfig

    cfg = LlamaConfig(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=4, hidden_size=8)
    art = identity_artifact(cfg, quant=q, clip=1.0, variant="oscar-ref")
    p = str(tmp_path / "a.safetensors")
    save_artifact(art, p)
    back = load_artifact(p)
    assert back.quant == q
    # an artifact written before clip_rule / param_dtype existed loads with the old behaviour
    assert QuantConfig(**{k: v for k, v in vars(QuantConfig()).items()}) == QuantConfig()
    old = QuantConfig(bits=2, group_size=None, key_axis="token", value_axis="token", mode="minmax",
                      sink=64, recent=256, page_size=16)
    assert old.key_spec(64).param_dtype == torch.float16 and old.key_spec(64).clip_rule == "ratio"


def test_quant_config_bad_values():
    with pytest.raises(OscarError, match="clip_rule"):
        QuantConfig(clip_rule="percentile")
    with pytest.raises(OscarError, match="param_dtype"):
        QuantConfig(param_dtype="bfloat16")
    with pytest.raises(OscarError, match="row-quantile"):
        QuantConfig(clip_rule="row-quantile", key_axis="channel")


# --- fit integration: `oscar fit --variant oscar-ref` -------------------------------------------

def _bitrev_literal(D):
    k = D.bit_length() - 1
    return [int(format(i, f"0{k}b")[::-1], 2) for i in range(D)]


def test_fit_oscar_ref_variant(tmp_path):
    """The artifact of `fit --variant oscar-ref` against the recipe recomputed with numpy from the store."""
    import numpy as np
    import zarr

    from oscar.stats.fit import FitConfig, fit

    p = str(tmp_path / "store")
    write_synthetic_store(p, SynthSpec(num_layers=2, num_kv_heads=2, head_dim=8, num_q_heads=4, num_blocks=2,
                                       rows=64, reservoir=16, seed=5))
    art = fit(p, FitConfig(variant="oscar-ref", progress=False, threads=1))
    g = zarr.open_group(p, mode="r")
    D, had = 8, np.array([[1.0]])
    while had.shape[0] < D:
        had = np.block([[had, had], [had, -had]])
    had /= np.sqrt(D)
    br = _bitrev_literal(D)
    for l in range(2):
        Cq = g[f"layers/{l}/q_gram"][:].sum(0) / g[f"layers/{l}/q_count"][:].sum()  # (H, D, D)
        Cv = g[f"layers/{l}/vw_gram"][:].sum(0) / g[f"layers/{l}/w_sum"][:].sum(0)[:, None, None]
        for C, R, ev in ((Cq, art.rot_k[l], art.extra[f"layers.{l}.eig_k"]),
                         (Cv, art.rot_v[l], art.extra[f"layers.{l}.eig_v"])):
            w, U = np.linalg.eigh(C.mean(0))  # ascending
            desc = list(range(D - 1, -1, -1))  # eigenvalue indices, largest first
            perm = [desc[b] for b in br]
            want = (U @ had)[:, perm]
            got = R.double().numpy()
            assert np.abs(got[0] - got[1]).max() == 0  # one rotation shared by the layer's KV heads
            # eigh's column signs may differ between LAPACK builds: compare U H P up to U's column signs
            # via R Pᵀ Hᵀ = U, then the composite itself after aligning the signs
            Ug = got[0][:, np.argsort(perm)] @ had.T
            s = np.sign((Ug * U).sum(0))
            assert np.abs(Ug - U * s).max() < 1e-5
            assert np.abs(got[0] - ((U * s) @ had)[:, perm]).max() < 1e-5
            if (s > 0).all():
                assert np.abs(got[0] - want).max() < 1e-5
            assert np.allclose(ev.double().numpy(), np.broadcast_to(w, (2, D)), rtol=1e-5)
        assert art.clip_k[l].tolist() == pytest.approx([0.96, 0.96]) and art.clip_v[l].tolist() == pytest.approx([0.92, 0.92])
    assert art.quant == rr.reference_quant_config()
    assert art.meta["variant"] == "oscar-ref" and art.meta["fit"]["clip_searched"] is False
    assert art.meta["fit"]["eig_order"] == "ascending" and art.meta["fallbacks"] == []
    out = str(tmp_path / "ref.safetensors")
    save_artifact(art, out)
    back = load_artifact(out)
    assert back.quant.clip_rule == "row-quantile" and back.quant.param_dtype == "float32" and back.quant.page_size == 8
    # the published fork's rotation files: one (D, D) rotation per layer (format_version 1), eigenvalues ascending
    from oscar.stats.interop import export_sglang

    files = export_sglang(back, str(tmp_path / "sg"))
    kf = torch.load(next(f for f in files if "k_rotation" in f), weights_only=True)
    assert kf["format_version"] == 1 and torch.equal(kf["layers"][0]["rotation"], back.rot_k[0][0])
    ev = kf["layers"][0]["eigenvalues"]
    assert ev.shape == (D,) and bool((ev[1:] >= ev[:-1]).all())


def test_fit_oscar_ref_needs_value_target(tmp_path):
    from oscar.stats.fit import FitConfig, fit

    p = str(tmp_path / "store")
    write_synthetic_store(p, SynthSpec(num_layers=1, num_kv_heads=1, head_dim=8, num_q_heads=2, num_blocks=1,
                                       rows=32, reservoir=8, only_fit_arrays=True))
    with pytest.raises(OscarError, match="oscar-ref needs layers/0/vw_gram"):
        fit(p, FitConfig(variant="oscar-ref", progress=False, threads=1))


# --- ablation integration: scheme `oscar-ref` ---------------------------------------------------

def test_ablation_scheme_oscar_ref():
    from oscar.validate.ablation.schemes import Ctx, make_scheme

    g = torch.Generator().manual_seed(0)
    D, N = 8, 200
    mix = torch.randn(D, D, generator=g, dtype=torch.float64)
    cal = {n: torch.randn(N, D, generator=g, dtype=torch.float64) @ mix * s for n, s in (("q", 1.0), ("k", 2.0), ("v", 0.5))}
    s = make_scheme("oscar-ref", 2).fit(cal, Ctx("oracle", 0))
    q, k, v = cal["q"], cal["k"], cal["v"]
    Cq = sum(torch.outer(r, r) for r in q) / N  # row by row, not the code's matmul
    w = torch.stack([r @ Cq @ r for r in k])
    Cv = sum(wi * torch.outer(r, r) for wi, r in zip(w, v)) / w.sum()
    assert torch.allclose(s.k.R, rr.reference_rotation(Cq)[0], atol=1e-10)
    assert torch.allclose(s.v.R, rr.reference_rotation(Cv)[0], atol=1e-10)
    assert (s.k.c, s.v.c) == (0.96, 0.92) and not s.k.center
    x = torch.randn(5, D, generator=g, dtype=torch.float64)
    code = s.k.encode(x)
    assert code["scale"].dtype == torch.float32 and code.bits_per_element == 2 + 64 / D
    # decode(encode(x)) = the per-row quantile clip + float32 min-max grid in the rotated space
    y = x @ s.k.R
    m = y.abs().sort(-1).values
    t = m[:, 6] + 0.96 * 7 % 1 * (m[:, 7] - m[:, 6])  # 0.96-quantile of 8 values: position 6.72
    yc = torch.maximum(torch.minimum(y, t[:, None]), -t[:, None])
    lo, hi = yc.min(-1).values.float(), yc.max(-1).values.float()
    sc = (hi - lo) / 3
    yh = (torch.floor((y - lo[:, None].double()) / sc[:, None].double() + 0.5).clamp(0, 3) * sc[:, None].double()
          + lo[:, None].double())
    assert torch.allclose(s.k.decode(code), yh @ s.k.R.T, atol=1e-6)


def test_row_quantile_per_head_ratio_tensor():
    """A (1, Hkv, 1, 1) ratio tensor (the cache's clip layout) = one scalar call per head."""
    spec = rr.reference_spec()
    x = torch.randn(3, 2, 4, 8, generator=torch.Generator().manual_seed(1))  # (N, Hkv, P, D)
    r = torch.tensor([0.96, 0.5]).reshape(1, 2, 1, 1)
    s, z = choose_qparams(x, spec, r)
    for h, rh in enumerate((0.96, 0.5)):
        sh, zh = choose_qparams(x[:, h], spec, rh)
        torch.testing.assert_close(s[:, h], sh, rtol=0, atol=1e-6)
        torch.testing.assert_close(z[:, h], zh, rtol=0, atol=1e-6)
